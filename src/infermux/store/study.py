"""The studies' table (runs of kind `study`): one row per point of the grid."""

from __future__ import annotations

import json
from typing import Any

from infermux.store.core import StoreCore

__all__ = ["StudyTables"]


class StudyTables(StoreCore):
    """A study's points: parameters, status, the `run` that measured each, its figures."""

    SCHEMA = """
CREATE TABLE IF NOT EXISTS study_points (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    point INTEGER NOT NULL,
    variant TEXT NOT NULL,         -- what the point is (a unit combination, an execution mode)
    status TEXT NOT NULL,          -- ok | invalid | oom | error | skipped
    error TEXT,
    sub_run_id INTEGER,            -- the `run` run that measured it
    params_json TEXT NOT NULL,     -- its parameters (units, batch, instances, models, load)
    figures_json TEXT NOT NULL     -- items/s, p99, per unit and per model
);
CREATE INDEX IF NOT EXISTS study_points_by_run ON study_points(run_id);
"""

    def add_study_point(self, run_id: int, index: int, variant: str, status: str,
                        error: str | None, sub_run_id: int | None, params: dict[str, Any],
                        figures: dict[str, Any]) -> None:
        """Store one point of a study."""
        with self._tx() as db:
            db.execute("INSERT INTO study_points VALUES (?,?,?,?,?,?,?,?)",
                       (run_id, index, variant, status, error, sub_run_id, json.dumps(params),
                        json.dumps(figures, default=str)))

    def study_points(self, run_id: int) -> list[dict[str, Any]]:
        """A study's points as dicts, in order."""
        rows = self._db.execute(
            "SELECT * FROM study_points WHERE run_id = ? ORDER BY point", (run_id,)).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["params"] = json.loads(d.pop("params_json"))
            d["figures"] = json.loads(d.pop("figures_json"))
            out.append(d)
        return out
