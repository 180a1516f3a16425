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

    # -- reading ----------------------------------------------------------------------------

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
