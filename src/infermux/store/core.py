"""The store's core: runs and their lifecycle, benchmark results, raw samples, telemetry.

Every point is committed as soon as it is measured, so an interrupted run keeps what it measured.
Statistics shown later are derived again from the raw samples, not trusted from a cache. Each
area's own tables live in a module of this package as a class over `StoreCore`; `Store`
(the package's) is all of them, and creates every table when it opens a file.
"""

from __future__ import annotations

import csv
import io
import json
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar, Protocol

from infermux.errors import UsageError, first_line
from infermux.stats import latency_summary_ms

__all__ = ["DEFAULT_DB", "RESULT_COLUMNS", "Recording", "Sample", "StoreCore", "StoredRecord"]

DEFAULT_DB = "infermux.db"
SCHEMA_VERSION = 2

_CORE_SCHEMA = """
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
    items_per_s REAL,
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
"""

#: Result columns shown in lists, comparisons and CSV, in order.
RESULT_COLUMNS = (
    "id", "model", "unit", "engine", "batch", "instances", "data", "status", "valid",
    "items_per_s", "p50_ms", "p90_ms", "p95_ms", "p99_ms", "max_ms",
    "h2d_ms", "compute_ms", "d2h_ms", "items", "window_s", "validity_note", "error",
)


#: Names of throughput before version 2 made it one (`items_per_s`), in columns and records.
_RENAMED_V2 = {"throughput_items_per_s": "items_per_s", "throughput_samples_per_s": "items_per_s",
               "offline_samples_per_s": "offline_items_per_s"}


def _renamed(value: Any, names: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {names.get(k, k): _renamed(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, names) for v in value]
    return value


def _migrate(db: sqlite3.Connection, version: int) -> None:
    """Bring a database written by an older infermux up to `SCHEMA_VERSION`, in place."""
    if version < 2:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        with db:
            for table in tables:
                columns = [r[1] for r in db.execute(f"PRAGMA table_info({table})")]
                for old, new in _RENAMED_V2.items():
                    if old in columns and new not in columns:
                        db.execute(f"ALTER TABLE {table} RENAME COLUMN {old} TO {new}")
                for column in (c for c in columns if c.endswith("_json")):
                    rows = db.execute(
                        f"SELECT rowid, {column} FROM {table} WHERE {column} LIKE '%_per_s%'"
                    ).fetchall()
                    db.executemany(
                        f"UPDATE {table} SET {column} = ? WHERE rowid = ?",
                        [(json.dumps(_renamed(json.loads(text), _RENAMED_V2)), rowid)
                         for rowid, text in rows if text])


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class StoredRecord(Protocol):
    """A typed record the store keeps as JSON: its `to_dict()` is the stored form.

    Records are types from where they are made to here; the store is where they become dicts
    (and each type's `from_dict()` reads them back).
    """

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form that is stored."""
        ...


def _as_dict(record: StoredRecord | dict[str, Any]) -> dict[str, Any]:
    return record if isinstance(record, dict) else record.to_dict()


@dataclass
class Sample:
    """One batch's timing, as stored."""

    instance: int
    latency_ns: int
    h2d_ns: int
    compute_ns: int
    d2h_ns: int


@dataclass
class Recording:
    """A run being recorded: its id, and the status and summary it will finish with.

    The code inside `Store.recording` sets `status` (default `complete`) and fills `summary`;
    an interrupt finishes the run `interrupted`, any other exception `failed` with its first
    line. Without a store (`run_id` None) it records nothing.
    """

    run_id: int | None
    status: str = "complete"
    summary: dict[str, Any] = field(default_factory=dict)


class StoreCore:
    """A SQLite file (default `./infermux.db`); opened per use, safe to reopen after a crash."""

    #: The tables of the area a class over `StoreCore` owns (CREATE ... IF NOT EXISTS).
    SCHEMA: ClassVar[str] = _CORE_SCHEMA

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
            self._db.execute("CREATE TABLE IF NOT EXISTS meta "
                             "(key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            row = self._db.execute(
                "SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is not None and int(row[0]) < SCHEMA_VERSION:
                _migrate(self._db, int(row[0]))
            for cls in reversed(type(self).__mro__):
                if "SCHEMA" in vars(cls):
                    self._db.executescript(vars(cls)["SCHEMA"])
            self._db.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)",
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
        """The open connection, for reading (the report's queries); writes go through methods."""
        return self._db

    def close(self) -> None:
        """Close the connection."""
        self._db.close()

    def __enter__(self) -> StoreCore:
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

    @contextmanager
    def recording(self, kind: str, config: dict[str, Any], command: str = "",
                  env: dict[str, Any] | None = None) -> Iterator[Recording]:
        """Record one run: begins it (with the environment), finishes it however the block ends.

        `with store.recording("bench", cfg, command) as rec:` … `rec.summary = {...}`.
        """
        if env is None:
            from infermux.env import capture_environment

            env = capture_environment()
        rec = Recording(self.begin_run(kind, config, env, command))
        try:
            yield rec
        except KeyboardInterrupt:
            rec.status = "interrupted"
            raise
        except BaseException as exc:
            if rec.status in ("complete", "running"):
                rec.status = "failed"
            rec.summary.setdefault("error", first_line(exc))
            raise
        finally:
            assert rec.run_id is not None
            self.finish_run(rec.run_id, rec.status, rec.summary)

    def add_result(self, run_id: int, point: StoredRecord | dict[str, Any],
                   samples: Sequence[Sample]) -> int:
        """Store one measured point (a `bench.BenchPoint`) and its raw samples in one transaction."""
        record = _as_dict(point)
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO results(run_id, model, unit, engine, batch, instances, data, status, "
                "valid, validity_note, items, window_s, items_per_s, record_json, error)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    run_id, record["model"], record["unit"], record["engine"], record["batch"],
                    record["instances"], record["data"], record["status"], int(record["valid"]),
                    record.get("validity_note", ""), record["items"], record["window_s"],
                    record.get("items_per_s"), json.dumps(record),
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

    def export_json(self, run_ids: Sequence[int]) -> list[dict[str, Any]]:
        """The given runs with every point and, per point, its raw samples."""
        from dataclasses import asdict

        runs = []
        for run_id in run_ids:
            run = self.run(run_id)
            for result in run["results"]:
                result["raw_samples"] = [asdict(s) for s in self.samples(result["id"])]
            runs.append(run)
        return runs

    def export_csv(self, run_ids: Sequence[int]) -> str:
        """Results of the given runs as CSV, one row per measured point."""
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(("run_id", *RESULT_COLUMNS))
        for run_id in run_ids:
            for result in self.run(run_id)["results"]:
                writer.writerow((run_id, *(result.get(c, "") for c in RESULT_COLUMNS)))
        return out.getvalue()

