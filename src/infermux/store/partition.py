"""The partitioner's tables (runs of kind `partition`): its profile and its candidate plans."""

from __future__ import annotations

import json
from typing import Any

from infermux.store.core import StoreCore

__all__ = ["PartitionTables"]


class PartitionTables(StoreCore):
    """Every compute and transfer time profiled, and every candidate plan measured."""

    SCHEMA = """
CREATE TABLE IF NOT EXISTS partition_profiles (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    kind TEXT NOT NULL,            -- compute | transfer
    unit TEXT NOT NULL,            -- the unit computing, or the destination of a transfer
    source TEXT,                   -- a transfer's source unit (host for the input)
    position INTEGER NOT NULL,     -- piece index (compute) or boundary index (transfer)
    name TEXT NOT NULL,            -- the piece (start→end) or the boundary's node name
    batch INTEGER NOT NULL,
    time_s REAL NOT NULL,
    bytes INTEGER
);
CREATE INDEX IF NOT EXISTS partition_profiles_by_run ON partition_profiles(run_id);
CREATE TABLE IF NOT EXISTS partition_candidates (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    plan_yaml TEXT NOT NULL,
    stages INTEGER NOT NULL,
    predicted_items_per_s REAL,
    measured_items_per_s REAL,
    error_pct REAL,
    status TEXT NOT NULL,
    chosen INTEGER NOT NULL,
    record_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS partition_candidates_by_run ON partition_candidates(run_id);
"""

    def add_partition_profile(self, run_id: int, profile: Any) -> None:
        """Store every compute and transfer time of a `partition.profile.Profile`."""
        rows = []
        names = profile.boundaries
        for unit, times in profile.compute_s.items():
            for i, t in enumerate(times):
                rows.append((run_id, "compute", unit, None, i, f"{names[i]}→{names[i + 1]}",
                             profile.batch, t, None))
        for (src, dst), per in profile.transfer_s.items():
            for b, t in per.items():
                rows.append((run_id, "transfer", dst, src, b, names[b], profile.batch, t,
                             profile.bytes_per_item[b] * profile.batch))
        with self._tx() as db:
            db.executemany("INSERT INTO partition_profiles VALUES (?,?,?,?,?,?,?,?,?)", rows)

    def add_partition_candidate(self, run_id: int, record: dict[str, Any], plan_yaml: str) -> None:
        """Store one candidate: its plan, predicted and measured throughput."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO partition_candidates VALUES (?,?,?,?,?,?,?,?,?,?)",
                (run_id, record["rank"], plan_yaml, record["stages"],
                 record.get("predicted_items_per_s"), record.get("measured_items_per_s"),
                 record.get("error_pct"), record["status"], int(record.get("chosen", False)),
                 json.dumps(record, default=str)),
            )

    def choose_partition_candidate(self, run_id: int, rank: int) -> None:
        """Mark the candidate of `rank` as the one the partitioner kept."""
        with self._tx() as db:
            db.execute("UPDATE partition_candidates SET chosen = 1 WHERE run_id = ? AND rank = ?",
                       (run_id, rank))
