"""The results store: an embedded SQLite database of runs, their results and raw samples.

Every point is committed as soon as it is measured, so an interrupted run keeps what it measured.
Statistics shown later are derived again from the raw samples, not trusted from a cache.
"""

from __future__ import annotations

import csv
import io
import json
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from infermux.errors import RunError, UsageError
from infermux.stats import latency_summary_ms

__all__ = ["DEFAULT_DB", "Store"]

DEFAULT_DB = "infermux.db"
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    started_at TEXT NOT NULL,
    finished_at TEXT,
    command TEXT,
    config_json TEXT NOT NULL,
    env_json TEXT NOT NULL,
    summary_json TEXT
);
CREATE TABLE IF NOT EXISTS results (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    model TEXT NOT NULL,
    unit TEXT NOT NULL,
    engine TEXT NOT NULL,
    batch INTEGER NOT NULL,
    instances INTEGER NOT NULL,
    data TEXT NOT NULL,
    status TEXT NOT NULL,
    valid INTEGER NOT NULL,
    validity_note TEXT,
    items INTEGER NOT NULL,
    window_s REAL NOT NULL,
    throughput_items_per_s REAL,
    record_json TEXT NOT NULL,
    error TEXT
);
CREATE TABLE IF NOT EXISTS samples (
    result_id INTEGER NOT NULL REFERENCES results(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    instance INTEGER NOT NULL,
    latency_ns INTEGER NOT NULL,
    h2d_ns INTEGER NOT NULL,
    compute_ns INTEGER NOT NULL,
    d2h_ns INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_by_result ON samples(result_id);
CREATE INDEX IF NOT EXISTS results_by_run ON results(run_id);
CREATE TABLE IF NOT EXISTS telemetry (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    result_id INTEGER REFERENCES results(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    t_ns INTEGER NOT NULL,
    source TEXT NOT NULL,
    device TEXT NOT NULL,
    power_w REAL,
    energy_j REAL,
    util_pct REAL,
    clock_mhz REAL,
    temp_c REAL,
    reading_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS telemetry_by_result ON telemetry(result_id);
CREATE INDEX IF NOT EXISTS telemetry_by_run ON telemetry(run_id);
-- The runtime (`infermux run`, runs of kind 'run'): one row per trial (a plain run has one; a
-- peak search has the offline trial 0 and its server trials), per model and per worker, plus
-- the raw batches and queries every figure is derived from.
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
    throughput_samples_per_s REAL,
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
    throughput_samples_per_s REAL,
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

#: Result columns shown in lists, comparisons and CSV, in order.
RESULT_COLUMNS = (
    "id", "model", "unit", "engine", "batch", "instances", "data", "status", "valid",
    "throughput_items_per_s", "p50_ms", "p90_ms", "p95_ms", "p99_ms", "max_ms",
    "h2d_ms", "compute_ms", "d2h_ms", "items", "window_s", "validity_note", "error",
)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class Sample:
    """One batch's timing, as stored."""

    instance: int
    latency_ns: int
    h2d_ns: int
    compute_ns: int
    d2h_ns: int


class Store:
    """A SQLite file (default `./infermux.db`); opened per use, safe to reopen after a crash."""

    def __init__(self, path: str | Path = DEFAULT_DB) -> None:
        self.path = Path(path)
        if self.path.exists() and self.path.is_dir():
            raise UsageError(f"--db {str(path)!r} is a directory: give a file path, e.g. infermux.db")
        if not self.path.parent.exists():
            raise UsageError(f"--db {str(path)!r}: folder {str(self.path.parent)!r} does not exist")
        try:
            self._db = sqlite3.connect(str(self.path), timeout=30)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.executescript(_SCHEMA)
            self._db.execute(
                "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )
            self._db.commit()
        except sqlite3.DatabaseError as exc:
            raise UsageError(
                f"--db {str(path)!r} is not an infermux results database ({exc}); "
                "pass another path or move that file away"
            ) from exc

    @property
    def connection(self) -> sqlite3.Connection:
        """The open connection, for areas that keep tables of their own (CREATE TABLE IF NOT EXISTS)."""
        return self._db

    def close(self) -> None:
        """Close the connection."""
        self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._db:
            yield self._db

    # -- writing ----------------------------------------------------------------------------

    def begin_run(self, kind: str, config: dict[str, Any], env: dict[str, Any],
                  command: str = "") -> int:
        """Record a run as started; returns its id."""
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO runs(kind, status, started_at, command, config_json, env_json) "
                "VALUES (?, 'running', ?, ?, ?, ?)",
                (kind, _now(), command, json.dumps(config), json.dumps(env)),
            )
        return int(cur.lastrowid or 0)

    def finish_run(self, run_id: int, status: str, summary: dict[str, Any] | None = None) -> None:
        """Mark a run complete, interrupted or failed."""
        with self._tx() as db:
            db.execute(
                "UPDATE runs SET status = ?, finished_at = ?, summary_json = ? WHERE id = ?",
                (status, _now(), json.dumps(summary or {}), run_id),
            )

    def add_result(self, run_id: int, record: dict[str, Any], samples: Sequence[Sample]) -> int:
        """Store one measured point and its raw samples in one transaction."""
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO results(run_id, model, unit, engine, batch, instances, data, status, "
                "valid, validity_note, items, window_s, throughput_items_per_s, record_json, error)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    run_id, record["model"], record["unit"], record["engine"], record["batch"],
                    record["instances"], record["data"], record["status"], int(record["valid"]),
                    record.get("validity_note", ""), record["items"], record["window_s"],
                    record.get("throughput_items_per_s"), json.dumps(record),
                    record.get("error"),
                ),
            )
            result_id = int(cur.lastrowid or 0)
            db.executemany(
                "INSERT INTO samples(result_id, seq, instance, latency_ns, h2d_ns, compute_ns, "
                "d2h_ns) VALUES (?,?,?,?,?,?,?)",
                [
                    (result_id, i, s.instance, s.latency_ns, s.h2d_ns, s.compute_ns, s.d2h_ns)
                    for i, s in enumerate(samples)
                ],
            )
        return result_id

    def add_telemetry(self, run_id: int, result_id: int | None, rows: Sequence[dict[str, Any]]) -> int:
        """Store a telemetry time series (rows of `TelemetryWindow.rows()`) for a result or a run.

        `t_ns` is relative to the window's start; the whole reading is kept as JSON beside the
        columns most queries need.
        """
        with self._tx() as db:
            db.executemany(
                "INSERT INTO telemetry(run_id, result_id, seq, t_ns, source, device, power_w, "
                "energy_j, util_pct, clock_mhz, temp_c, reading_json) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                [
                    (run_id, result_id, row["seq"], row["t_ns"], r.source, r.device, r.power_w,
                     r.energy_j, r.util_pct, r.clock_mhz, r.temp_c, json.dumps(r.to_dict()))
                    for row in rows
                    for r in (row["reading"],)
                ],
            )
        return len(rows)
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
                "duration_s, completed, failed, throughput_samples_per_s, p50_ms, p90_ms, p99_ms, "
                "record_json) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (run_id, trial, record["scenario"], record.get("rate_qps"), int(record["valid"]),
                 "; ".join(record.get("validity_notes", [])), record["duration_s"],
                 record["completed"], record["failed"], record.get("throughput_samples_per_s"),
                 lat.get("p50_ms"), lat.get("p90_ms"), lat.get("p99_ms"), json.dumps(record)),
            )
            for name, m in record.get("models", {}).items():
                ph = m.get("phases", {})
                db.execute(
                    "INSERT INTO run_models(run_id, trial, model, completed, failed, "
                    "throughput_samples_per_s, p50_ms, p99_ms, queueing_p99_ms, "
                    "batching_wait_p99_ms, compute_p99_ms, batch_histogram_json, record_json) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (run_id, trial, name, m["completed"], m["failed"],
                     m.get("throughput_samples_per_s"), m["latency"].get("p50_ms"),
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

    # -- reading ----------------------------------------------------------------------------

    def telemetry(self, *, result_id: int | None = None, run_id: int | None = None
                  ) -> list[dict[str, Any]]:
        """The stored telemetry of one result (or of a run's own window, e.g. from `monitor`)."""
        if result_id is not None:
            where, arg = "result_id = ?", result_id
        elif run_id is not None:
            where, arg = "run_id = ? AND result_id IS NULL", run_id
        else:
            raise UsageError("give a result id or a run id to read telemetry")
        rows = self._db.execute(
            f"SELECT seq, t_ns, reading_json FROM telemetry WHERE {where} ORDER BY seq, rowid",
            (arg,),
        ).fetchall()
        return [{"seq": r["seq"], "t_ns": r["t_ns"], **json.loads(r["reading_json"])} for r in rows]


    def runs(self, limit: int = 50) -> list[dict[str, Any]]:
        """The latest runs, newest first, with their result counts."""
        rows = self._db.execute(
            "SELECT r.*, (SELECT COUNT(*) FROM results WHERE run_id = r.id) AS results "
            "FROM runs r ORDER BY r.id DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [self._run_dict(row, with_blobs=False) for row in rows]

    def run(self, run_id: int) -> dict[str, Any]:
        """One run with its configuration, environment and results (statistics re-derived)."""
        row = self._db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            last = self._db.execute("SELECT MAX(id) FROM runs").fetchone()[0]
            raise UsageError(
                f"run {run_id} is not in {str(self.path)!r} "
                f"(runs there: {'1..' + str(last) if last else 'none'}); see `infermux results list`"
            )
        run = self._run_dict(row, with_blobs=True)
        run["results"] = [self._result_dict(r) for r in self._db.execute(
            "SELECT * FROM results WHERE run_id = ? ORDER BY id", (run_id,)
        ).fetchall()]
        return run

    def samples(self, result_id: int) -> list[Sample]:
        """The raw per-batch timings of one result, in measured order."""
        rows = self._db.execute(
            "SELECT instance, latency_ns, h2d_ns, compute_ns, d2h_ns FROM samples "
            "WHERE result_id = ? ORDER BY seq",
            (result_id,),
        ).fetchall()
        return [Sample(*tuple(r)) for r in rows]

    def _run_dict(self, row: sqlite3.Row, *, with_blobs: bool) -> dict[str, Any]:
        data = dict(row)
        config = json.loads(data.pop("config_json"))
        env = json.loads(data.pop("env_json"))
        data["summary"] = json.loads(data.pop("summary_json") or "{}")
        data["model"] = config.get("model", {}).get("ref") if isinstance(
            config.get("model"), dict) else config.get("model")
        if with_blobs:
            data["config"] = config
            data["environment"] = env
        return data

    def _result_dict(self, row: sqlite3.Row) -> dict[str, Any]:
        record = json.loads(row["record_json"])
        samples = self.samples(row["id"])
        record["id"] = row["id"]
        record.update(latency_summary_ms([s.latency_ns for s in samples]))
        if samples:
            for phase in ("h2d", "compute", "d2h"):
                total = sum(getattr(s, f"{phase}_ns") for s in samples)
                record[f"{phase}_ms"] = total / len(samples) / 1e6
        record["samples"] = len(samples)
        return record

    # -- export -----------------------------------------------------------------------------

    def export_csv(self, run_ids: Sequence[int]) -> str:
        """Results of the given runs as CSV, one row per measured point."""
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(("run_id", *RESULT_COLUMNS))
        for run_id in run_ids:
            for result in self.run(run_id)["results"]:
                writer.writerow((run_id, *(result.get(c, "") for c in RESULT_COLUMNS)))
        return out.getvalue()


def open_store(path: str | Path | None) -> Store:
    """Open the store at `path` (default `./infermux.db`), translating failures to one line."""
    try:
        return Store(path or DEFAULT_DB)
    except sqlite3.Error as exc:  # pragma: no cover - disk full, permissions
        raise RunError(f"cannot open results database {str(path)!r}: {exc}") from exc
