"""The tuner's trial cache (`tune_trials`): every measured candidate, reused across tunes."""

from __future__ import annotations

import json
from typing import Any

from infermux.store.core import StoreCore

__all__ = ["TuneTables"]


class TuneTables(StoreCore):
    """One row per measured (or reused) candidate, keyed by the machine and settings."""

    SCHEMA = """
CREATE TABLE IF NOT EXISTS tune_trials (
    id INTEGER PRIMARY KEY,
    run_id INTEGER REFERENCES runs(id) ON DELETE CASCADE,
    fingerprint TEXT NOT NULL,     -- machine, model sources, trial settings
    key TEXT NOT NULL,             -- the candidate (canonical)
    label TEXT NOT NULL,
    method TEXT NOT NULL,          -- engine | runtime
    status TEXT NOT NULL,          -- ok | oom | error | invalid
    items_per_s REAL,
    p99_ms REAL,
    energy_per_item_j REAL,
    power_w REAL,
    memory_bytes INTEGER,
    cost_s REAL NOT NULL,
    reused INTEGER NOT NULL,
    record_json TEXT NOT NULL,
    created TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS tune_trials_by_key ON tune_trials(fingerprint, key);
"""

    def tune_trial(self, fingerprint: str, key: str) -> tuple[dict[str, Any], float] | None:
        """The latest measured trial of a candidate that ended ok or out of memory.

        (record, its measuring cost in s), or None; reused trials are not themselves reused.
        """
        row = self._db.execute(
            "SELECT record_json, cost_s FROM tune_trials WHERE fingerprint = ? AND key = ? "
            "AND reused = 0 AND status IN ('ok', 'oom') ORDER BY id DESC LIMIT 1",
            (fingerprint, key)).fetchone()
        return None if row is None else (json.loads(row[0]), float(row[1]))

    def add_tune_trial(self, run_id: int | None, fingerprint: str, key: str, label: str,
                       record: dict[str, Any], cost_s: float) -> None:
        """Store one trial (`record` is `Trial.to_dict()` with its runtime record)."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO tune_trials (run_id, fingerprint, key, label, method, status, "
                "items_per_s, p99_ms, energy_per_item_j, power_w, memory_bytes, cost_s, reused, "
                "record_json, created) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,datetime('now'))",
                (run_id, fingerprint, key, label, record["method"], record["status"],
                 record.get("items_per_s"), record.get("p99_ms"), record.get("energy_per_item_j"),
                 record.get("power_w"), record.get("memory_bytes"), cost_s,
                 int(bool(record.get("reused"))), json.dumps(record, default=str)))
