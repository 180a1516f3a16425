"""The cluster's table (runs of kind `cluster`): one row per node per trial."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from infermux.store.core import StoreCore

__all__ = ["ClusterTables"]


class ClusterTables(StoreCore):
    """Each node's share of a cluster run: what it completed, when it was lost, what moved."""

    SCHEMA = """
CREATE TABLE IF NOT EXISTS cluster_nodes (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    trial INTEGER NOT NULL,
    node TEXT NOT NULL,
    entry TEXT,                    -- the cluster plan's node entry it came from
    node_id TEXT,
    address TEXT,
    status TEXT,                   -- ok | lost
    completed_samples INTEGER,
    share REAL,
    items_per_s REAL,
    lost_at_s REAL,
    rerouted_samples INTEGER,
    failed_samples INTEGER,
    record_json TEXT
);
CREATE INDEX IF NOT EXISTS cluster_nodes_by_run ON cluster_nodes(run_id);
"""

    def add_cluster_nodes(self, run_id: int, trial: int, nodes: Sequence[dict[str, Any]]) -> None:
        """Store each node's figures of one trial.

        The columns keep their first names (`*_samples`, as databases written before hold
        them); they hold the node rows' `completed_items`, `rerouted_items`, `failed_items`.
        """
        with self._tx() as db:
            db.executemany(
                "INSERT INTO cluster_nodes(run_id, trial, node, entry, node_id, address, status, "
                "completed_samples, share, items_per_s, lost_at_s, rerouted_samples, "
                "failed_samples, record_json) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                [(run_id, trial, n["node"], n["entry"], n["node_id"], n["address"], n["status"],
                  n["completed_items"], n["share"], n["items_per_s"], n["lost_at_s"],
                  n["rerouted_items"], n["failed_items"], json.dumps(n, default=str))
                 for n in nodes])
