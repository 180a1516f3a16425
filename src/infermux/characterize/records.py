"""The characterization's tables in the results database (runs of kind `characterize`).

`characterize_variants` has one row per (unit, engine, precision, option set) with the headline
figures and the whole record as JSON; `characterize_builds` one row per build (baseline and
every knob's study) with its raw batch latencies; `characterize_causes` one row per knob pinned.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from infermux.store import Store

if TYPE_CHECKING:
    from infermux.characterize.run import VariantResult

__all__ = ["add_variant", "ensure_tables", "variants"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS characterize_variants (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    variant INTEGER NOT NULL,
    unit TEXT NOT NULL,
    engine TEXT NOT NULL,
    precision TEXT NOT NULL,
    config TEXT NOT NULL,
    status TEXT NOT NULL,
    builds_ok INTEGER NOT NULL,
    top1 REAL,
    top5 REAL,
    agree_top1 REAL,
    max_abs_err REAL,
    mean_abs_err REAL,
    rel_err REAL,
    distinct_outputs INTEGER,
    max_abs_diff REAL,
    top1_flips INTEGER,
    latency_median_ms REAL,
    latency_spread REAL,
    variance TEXT NOT NULL,          -- comma list of rebuild, run-to-run, batch-size
    record_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS characterize_variants_by_run ON characterize_variants(run_id);
CREATE TABLE IF NOT EXISTS characterize_builds (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    variant INTEGER NOT NULL,
    study TEXT NOT NULL,             -- baseline, or the knob pinned
    build INTEGER NOT NULL,
    status TEXT NOT NULL,
    build_s REAL,
    latency_median_ms REAL,
    items_per_s REAL,
    error TEXT,
    record_json TEXT NOT NULL        -- raw batch latencies (ns) included
);
CREATE INDEX IF NOT EXISTS characterize_builds_by_run ON characterize_builds(run_id);
CREATE TABLE IF NOT EXISTS characterize_causes (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    variant INTEGER NOT NULL,
    knob TEXT NOT NULL,
    removes_json TEXT NOT NULL,      -- variance kind → true (gone), false (still there), null
    variance_left TEXT NOT NULL,
    throughput_ratio REAL,           -- items/s with the knob pinned ÷ the baseline's
    record_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS characterize_causes_by_run ON characterize_causes(run_id);
"""


def ensure_tables(store: Store) -> None:
    """Create the characterization's tables if this database lacks them."""
    store.connection.executescript(_SCHEMA)
    store.connection.commit()


def _value(entry: Any) -> float | None:
    return entry.get("value") if isinstance(entry, dict) else None


def add_variant(store: Store, run_id: int, index: int, result: VariantResult) -> None:
    """Store one variant: its row, its builds (every study) and its causes."""
    from infermux.characterize.run import _finite

    record = _finite(result.to_dict())
    det = record["determinism"]
    acc = record.get("accuracy") or {}
    rebuild = det.get("rebuild") or {}
    lat = det.get("latency") or {}
    v = result.variant
    with store.connection as db:
        db.execute(
            "INSERT INTO characterize_variants VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (run_id, index, v.unit.id, v.engine, v.precision, v.config, record["status"],
             det["builds_ok"], _value(acc.get("top1")), _value(acc.get("top5")),
             _value(acc.get("agree_top1")), acc.get("max_abs_err"),
             _value(acc.get("mean_abs_err")), acc.get("rel_err"), rebuild.get("distinct"),
             rebuild.get("max_abs_diff"), rebuild.get("top1_flips"), lat.get("median_ms"),
             lat.get("spread"), ",".join(det["variance"]), json.dumps(record, default=str)),
        )
        studies = [("baseline", result.baseline)] + [(c.knob.name, c.study) for c in result.causes]
        rows = []
        for name, study in studies:
            for b, build in enumerate(study.builds):
                build_lat = build.get("latency") or {}
                rows.append((run_id, index, name, b, build.get("status", "error"),
                             build.get("build_s"), build_lat.get("median_ms"),
                             build_lat.get("items_per_s"), build.get("error"),
                             json.dumps(_finite({k: val for k, val in build.items()
                                                 if k != "traceback"}), default=str)))
        db.executemany("INSERT INTO characterize_builds VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
        db.executemany(
            "INSERT INTO characterize_causes VALUES (?,?,?,?,?,?,?)",
            [(run_id, index, c["knob"], json.dumps(c["removes"]), ",".join(c["variance_left"]),
              c["throughput_ratio"], json.dumps(c, default=str)) for c in record["causes"]])


def variants(store: Store, run_id: int) -> list[dict[str, Any]]:
    """The stored variant records of a run, in order."""
    rows = store.connection.execute(
        "SELECT record_json FROM characterize_variants WHERE run_id = ? ORDER BY variant",
        (run_id,)).fetchall()
    return [json.loads(r[0]) for r in rows]
