"""The characterization's tables (runs of kind `characterize`).

`characterize_variants` has one row per (unit, engine, precision, option set) with the headline
figures and the whole record as JSON; `characterize_builds` one row per build (baseline and
every knob's study) with its raw batch latencies; `characterize_causes` one row per knob pinned.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from infermux.store.core import StoreCore

__all__ = ["CharacterizeTables"]


class CharacterizeTables(StoreCore):
    """Variants, their builds and the causes of their variance."""

    SCHEMA = """
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

    def add_characterize_variant(self, variant_row: Sequence[Any],
                                 build_rows: Sequence[Sequence[Any]],
                                 cause_rows: Sequence[Sequence[Any]]) -> None:
        """Store one variant's row, its builds' rows and its causes' rows in one transaction."""
        with self._tx() as db:
            db.execute("INSERT INTO characterize_variants VALUES "
                       "(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", tuple(variant_row))
            db.executemany("INSERT INTO characterize_builds VALUES (?,?,?,?,?,?,?,?,?,?)",
                           [tuple(r) for r in build_rows])
            db.executemany("INSERT INTO characterize_causes VALUES (?,?,?,?,?,?,?)",
                           [tuple(r) for r in cause_rows])

    def characterize_variants(self, run_id: int) -> list[dict[str, Any]]:
        """The stored variant records of a run, in order."""
        rows = self._db.execute(
            "SELECT record_json FROM characterize_variants WHERE run_id = ? ORDER BY variant",
            (run_id,)).fetchall()
        return [json.loads(r[0]) for r in rows]
