"""Reading runs for a report: the store alone, every kind of run, tables found by their `run_id`.

A report never measures and never writes: the database must exist (a missing path is a usage
error, not a new empty store), and each run is read with its configuration, environment,
summary, results (statistics re-derived from the raw samples, as `infermux results show`
does) and the rows of every other table that has a `run_id` column, so a kind of run this
module has never heard of still has its records to show.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infermux.errors import UsageError
from infermux.store import Store

__all__ = ["RunData", "StoreReader", "open_reader", "parse_run_ids"]

#: Tables every kind shares, read by the report itself (not listed as a kind's own tables).
CORE_TABLES = frozenset({"meta", "runs", "sqlite_sequence", "results", "samples", "telemetry"})
#: Raw tables (one row per batch or query) that are summarised, never listed row by row.
RAW_TABLES = frozenset({"samples", "run_batches", "run_queries"})


@dataclass
class RunData:
    """One stored run as the report sees it."""

    id: int
    kind: str
    status: str
    started_at: str
    finished_at: str | None
    command: str
    config: dict[str, Any]
    environment: dict[str, Any]
    summary: dict[str, Any]
    #: Rows of `results` (bench points, partition candidates, ...), statistics re-derived.
    results: list[dict[str, Any]]
    reader: StoreReader = field(repr=False)

    @property
    def model(self) -> str:
        """Which model or models the run was about, as one line."""
        cfg = self.config
        model = cfg.get("model")
        if isinstance(model, dict):
            return str(model.get("ref") or model.get("name") or "")
        if isinstance(model, str):
            return model
        models = cfg.get("models")
        if isinstance(models, list):
            return ", ".join(str(m.get("ref") if isinstance(m, dict) else m) for m in models)
        plan = cfg.get("plan")
        if isinstance(plan, dict):
            return ", ".join(str(m.get("model")) for m in plan.get("models", []))
        return ""

    @property
    def machine(self) -> str:
        """The CPU and GPUs the run was measured on, as one line."""
        env = self.environment
        cpu = (env.get("cpu") or {}).get("model") or "unknown CPU"
        cores = (env.get("cpu") or {}).get("usable_cores")
        gpus = [g.get("name", "?") for g in env.get("gpus") or []]
        text = f"{cpu} ({cores} cores)" if cores else str(cpu)
        return text + (" · " + ", ".join(gpus) if gpus else "")

    def rows(self, table: str, order: str = "rowid") -> list[dict[str, Any]]:
        """The run's rows of `table` (empty when the database has no such table)."""
        return self.reader.rows(table, self.id, order)

    def own_tables(self) -> list[str]:
        """Tables other than the shared ones that hold rows of this run."""
        return [t for t in self.reader.run_tables()
                if t not in CORE_TABLES and self.reader.count(t, self.id)]


class StoreReader:
    """Read access to a results database that must already exist."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise UsageError(f"--db {str(path)!r} does not exist: pass the results database "
                             "the runs were stored in (`infermux results list --db PATH`)")
        _check_results_db(self.path)
        self.store = Store(self.path)
        self._db = self.store.connection
        self._tables: list[str] | None = None

    def close(self) -> None:
        """Close the database."""
        self.store.close()

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_tables(self) -> list[str]:
        """Every table with a `run_id` column, by name."""
        if self._tables is None:
            names = [r[0] for r in self._db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
            self._tables = [n for n in names if "run_id" in self.columns(n)]
        return self._tables

    def columns(self, table: str) -> list[str]:
        """The column names of `table`."""
        return [r[1] for r in self._db.execute(f'PRAGMA table_info("{table}")')]

    def has_table(self, table: str) -> bool:
        """Whether the database has `table` with a `run_id` column."""
        return table in self.run_tables()

    def count(self, table: str, run_id: int) -> int:
        """Rows of `run_id` in `table`."""
        if not self.has_table(table):
            return 0
        return int(self._db.execute(f'SELECT COUNT(*) FROM "{table}" WHERE run_id = ?',
                                    (run_id,)).fetchone()[0])

    def rows(self, table: str, run_id: int, order: str = "rowid",
             limit: int | None = None) -> list[dict[str, Any]]:
        """Rows of `run_id` in `table`, `*_json` columns decoded."""
        if not self.has_table(table):
            return []
        sql = f'SELECT * FROM "{table}" WHERE run_id = ? ORDER BY {order}'
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        out = []
        for row in self._db.execute(sql, (run_id,)):
            data = dict(row)
            for key in [k for k in data if k.endswith("_json")]:
                text = data.pop(key)
                try:
                    data[key[:-5]] = json.loads(text) if text else None
                except (TypeError, ValueError):
                    data[key[:-5]] = text
            out.append(data)
        return out

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        """A read query (for figures that aggregate raw tables in SQL)."""
        return list(self._db.execute(sql, tuple(args)))

    def telemetry(self, *, result_id: int | None = None, run_id: int | None = None
                  ) -> list[dict[str, Any]]:
        """A telemetry series (of one result, or of a run's own window)."""
        return self.store.telemetry(result_id=result_id, run_id=run_id)

    def latency_quantiles_ms(self, result_id: int, points: int = 101) -> list[float]:
        """`points` evenly spaced quantiles of one result's per-batch latency, in ms."""
        import numpy as np

        lat = [s.latency_ns for s in self.store.samples(result_id)]
        if not lat:
            return []
        q = np.quantile(np.asarray(lat, dtype=np.float64), np.linspace(0, 1, points))
        return [float(v) / 1e6 for v in q]

    def load(self, run_id: int) -> RunData:
        """One run with everything the report shows."""
        run = self.store.run(run_id)  # an unknown id is one clear line
        return RunData(
            id=run["id"], kind=run["kind"], status=run["status"], started_at=run["started_at"],
            finished_at=run.get("finished_at"), command=run.get("command") or "",
            config=run.get("config") or {}, environment=run.get("environment") or {},
            summary=run.get("summary") or {}, results=run["results"], reader=self,
        )

    def latest_ids(self, n: int) -> list[int]:
        """The ids of the `n` newest runs, oldest first."""
        rows = self._db.execute("SELECT id FROM runs ORDER BY id DESC LIMIT ?", (n,)).fetchall()
        return sorted(int(r[0]) for r in rows)


def _check_results_db(path: Path) -> None:
    """A usage error unless `path` is a results database (checked read-only: nothing written)."""
    if path.is_dir():
        raise UsageError(f"--db {str(path)!r} is a directory: give the results database file")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            found = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                               "name = 'runs'").fetchone()
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"--db {str(path)!r} is not an infermux results database ({exc})"
                         ) from exc
    if found is None:
        raise UsageError(f"--db {str(path)!r} holds no runs table: it is not an infermux "
                         "results database")


def open_reader(path: str | Path) -> StoreReader:
    """A reader of an existing results database (a missing file is a usage error)."""
    return StoreReader(path)


def parse_run_ids(specs: Sequence[str], reader: StoreReader | None = None) -> list[int]:
    """Run ids from `3`, `3-7` (a range), `3,5` or `last` / `last:N` (the newest runs)."""
    ids: list[int] = []
    for spec in specs:
        for part in (p.strip() for p in str(spec).split(",")):
            if not part:
                continue
            if part == "last" or part.startswith("last:"):
                count = part.partition(":")[2] or "1"
                if not count.isdigit() or int(count) < 1:
                    raise UsageError(f"run {part!r}: write last or last:N with N ≥ 1")
                if reader is None:
                    raise UsageError(f"run {part!r} needs the database to resolve it")
                found = reader.latest_ids(int(count))
                if not found:
                    raise UsageError(f"run {part!r}: the database has no runs yet")
                ids.extend(found)
                continue
            lo, dash, hi = part.partition("-")
            if dash and lo.isdigit() and hi.isdigit() and int(lo) <= int(hi):
                ids.extend(range(int(lo), int(hi) + 1))
            elif not dash and part.isdigit():
                ids.append(int(part))
            else:
                raise UsageError(f"run {part!r} is not a run id: give ids (3), ranges (3-7) or "
                                 "last / last:N; see `infermux results list`")
    if not ids:
        raise UsageError("no run given: pass run ids, e.g. `infermux report 3 4 -o report.html`")
    return list(dict.fromkeys(ids))
