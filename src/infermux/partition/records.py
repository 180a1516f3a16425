"""The partitioner's tables in the results database (runs of kind `partition`)."""

from __future__ import annotations

import json
from typing import Any

from infermux.store import Store

__all__ = ["add_candidate", "add_profile", "ensure_tables"]

_SCHEMA = """
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


def ensure_tables(store: Store) -> None:
    """Create the partitioner's tables if this database lacks them."""
    store.connection.executescript(_SCHEMA)
    store.connection.commit()


def add_profile(store: Store, run_id: int, profile: Any) -> None:
    """Store every compute and transfer time of a `Profile`."""
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
    with store.connection as db:
        db.executemany("INSERT INTO partition_profiles VALUES (?,?,?,?,?,?,?,?,?)", rows)


def add_candidate(store: Store, run_id: int, record: dict[str, Any], plan_yaml: str) -> None:
    """Store one candidate: its plan, predicted and measured throughput."""
    with store.connection as db:
        db.execute(
            "INSERT INTO partition_candidates VALUES (?,?,?,?,?,?,?,?,?,?)",
            (run_id, record["rank"], plan_yaml, record["stages"],
             record.get("predicted_items_per_s"), record.get("measured_items_per_s"),
             record.get("error_pct"), record["status"], int(record.get("chosen", False)),
             json.dumps(record, default=str)),
        )
