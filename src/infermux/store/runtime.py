"""The runtime's tables (runs of kind `run`): trials, per model, per worker, raw batches, queries."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from infermux.store.core import StoreCore

__all__ = ["RuntimeTables"]


class RuntimeTables(StoreCore):
    """`infermux run`'s tables.

    One row per trial (a plain run has one; a peak search has the offline trial 0 and its
    server trials), per model and per worker, plus the raw batches and queries every figure is
    derived from.
    """

    SCHEMA = """
CREATE TABLE IF NOT EXISTS run_trials (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    trial INTEGER NOT NULL,
    scenario TEXT NOT NULL,
    rate_qps REAL,
    valid INTEGER NOT NULL,
    validity_note TEXT,
    duration_s REAL NOT NULL,
    completed INTEGER NOT NULL,
    failed INTEGER NOT NULL,
    items_per_s REAL,
    p50_ms REAL,
    p90_ms REAL,
    p99_ms REAL,
    record_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS run_models (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    trial INTEGER NOT NULL,
    model TEXT NOT NULL,
    completed INTEGER NOT NULL,
    failed INTEGER NOT NULL,
    items_per_s REAL,
    p50_ms REAL,
    p99_ms REAL,
    queueing_p99_ms REAL,
    batching_wait_p99_ms REAL,
    compute_p99_ms REAL,
    batch_histogram_json TEXT NOT NULL,
    record_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS run_workers (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    trial INTEGER NOT NULL,
    worker TEXT NOT NULL,
    unit TEXT NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    error TEXT,
    batches INTEGER NOT NULL,
    items INTEGER NOT NULL,
    share REAL NOT NULL,
    busy_s REAL NOT NULL,
    batch_histogram_json TEXT NOT NULL,
    record_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS run_batches (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    trial INTEGER NOT NULL,
    worker TEXT NOT NULL,
    model TEXT NOT NULL,
    size INTEGER NOT NULL,
    bucket INTEGER NOT NULL,
    taken_ns INTEGER NOT NULL,
    start_ns INTEGER NOT NULL,
    end_ns INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS run_queries (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    trial INTEGER NOT NULL,
    query INTEGER NOT NULL,
    model TEXT NOT NULL,
    samples INTEGER NOT NULL,
    issued_ns INTEGER NOT NULL,
    latency_ns INTEGER,
    ok INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS run_trials_by_run ON run_trials(run_id);
CREATE INDEX IF NOT EXISTS run_models_by_run ON run_models(run_id);
CREATE INDEX IF NOT EXISTS run_workers_by_run ON run_workers(run_id);
CREATE INDEX IF NOT EXISTS run_batches_by_run ON run_batches(run_id);
CREATE INDEX IF NOT EXISTS run_queries_by_run ON run_queries(run_id);
"""

    def add_runtime_trial(self, run_id: int, trial: int, record: dict[str, Any], result: Any,
                          batches: Sequence[Any]) -> None:
        """Store one runtime trial: headline, per model, per worker, raw batches and queries.

        `result` is a `load.ScenarioResult`, `batches` the runtime's `BatchRecord`s.
        """
        lat = record.get("latency") or {}
        start = result.start_ns
        with self._tx() as db:
            db.execute(
                "INSERT INTO run_trials(run_id, trial, scenario, rate_qps, valid, validity_note, "
                "duration_s, completed, failed, items_per_s, p50_ms, p90_ms, p99_ms, "
                "record_json) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (run_id, trial, record["scenario"], record.get("rate_qps"), int(record["valid"]),
                 "; ".join(record.get("validity_notes", [])), record["duration_s"],
                 record["completed"], record["failed"], record.get("items_per_s"),
                 lat.get("p50_ms"), lat.get("p90_ms"), lat.get("p99_ms"), json.dumps(record)),
            )
            for name, m in record.get("models", {}).items():
                ph = m.get("phases", {})
                db.execute(
                    "INSERT INTO run_models(run_id, trial, model, completed, failed, "
                    "items_per_s, p50_ms, p99_ms, queueing_p99_ms, "
                    "batching_wait_p99_ms, compute_p99_ms, batch_histogram_json, record_json) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (run_id, trial, name, m["completed"], m["failed"],
                     m.get("items_per_s"), m["latency"].get("p50_ms"),
                     m["latency"].get("p99_ms"), ph.get("queueing", {}).get("p99_ms"),
                     ph.get("batching_wait", {}).get("p99_ms"), ph.get("compute", {}).get("p99_ms"),
                     json.dumps(m.get("batch_histogram", {})), json.dumps(m)),
                )
            for name, w in record.get("workers", {}).items():
                db.execute(
                    "INSERT INTO run_workers(run_id, trial, worker, unit, model, status, error, "
                    "batches, items, share, busy_s, batch_histogram_json, record_json) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (run_id, trial, name, w["unit"], w["model"], w["status"], w.get("error"),
                     w["batches"], w["items"], w["share"], w["busy_s"],
                     json.dumps(w.get("batch_histogram", {})), json.dumps(w)),
                )
            db.executemany(
                "INSERT INTO run_batches(run_id, trial, worker, model, size, bucket, taken_ns, "
                "start_ns, end_ns) VALUES (?,?,?,?,?,?,?,?,?)",
                [(run_id, trial, b.worker, b.model, b.size, b.bucket, b.taken_ns - start,
                  b.start_ns - start, b.end_ns - start) for b in batches],
            )
            db.executemany(
                "INSERT INTO run_queries(run_id, trial, query, model, samples, issued_ns, "
                "latency_ns, ok) VALUES (?,?,?,?,?,?,?,?)",
                # Latency from when the query was due (its scheduled arrival), as the record's.
                [(run_id, trial, q, m, n, i - start, (c - d) if c else None, int(ok and bool(c)))
                 for q, (m, n, i, d, c, ok) in enumerate(zip(
                     result.query_model, result.query_samples, result.issued_ns, result.due_ns,
                     result.completed_ns, result.ok, strict=True))],
            )

    def runtime_trials(self, run_id: int) -> list[dict[str, Any]]:
        """The stored trials of a runtime run, each its full record (models, workers, ...)."""
        rows = self._db.execute(
            "SELECT record_json FROM run_trials WHERE run_id = ? ORDER BY trial", (run_id,)
        ).fetchall()
        return [json.loads(r["record_json"]) for r in rows]
