"""The training tables (runs of kind `train`).

- `train_passes`: each measured pass with every phase's total, CPU time, energy and the knobs
  (its minibatches are also a `results` row's samples, so `infermux results` shows them).
- `train_steps`: every minibatch, every phase (ns), and the loader's own time for it.
- `train_predictions`: each configuration's predicted epoch time and energy (with bounds), and
  the measured figures where a validation measured them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from infermux.store.core import StoreCore

__all__ = ["TrainTables"]


class TrainTables(StoreCore):
    """Passes, minibatches and predictions of `infermux train-profile` / `train-predict`."""

    SCHEMA = """
CREATE TABLE IF NOT EXISTS train_passes (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    result_id INTEGER REFERENCES results(id) ON DELETE CASCADE,
    config INTEGER NOT NULL,
    label TEXT NOT NULL,
    kind TEXT NOT NULL,              -- profile | epoch
    pass TEXT NOT NULL,              -- cold (first: data read from its medium) | warm
    status TEXT NOT NULL,
    batch INTEGER NOT NULL,
    workers INTEGER NOT NULL,
    prefetch_factor INTEGER NOT NULL,
    pin_memory INTEGER NOT NULL,
    persistent_workers INTEGER NOT NULL,
    storage TEXT NOT NULL,
    cores TEXT NOT NULL,
    precision TEXT NOT NULL,
    steps INTEGER NOT NULL,
    items INTEGER NOT NULL,
    wall_s REAL NOT NULL,
    startup_s REAL, fetch_s REAL, h2d_s REAL, forward_s REAL, backward_s REAL,
    optimizer_s REAL, tail_s REAL,
    cpu_s REAL,
    energy_j REAL,
    energy_source TEXT,
    error TEXT,
    record_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS train_passes_by_run ON train_passes(run_id);
CREATE TABLE IF NOT EXISTS train_steps (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    config INTEGER NOT NULL,
    kind TEXT NOT NULL,
    pass TEXT NOT NULL,
    seq INTEGER NOT NULL,
    items INTEGER NOT NULL,
    fetch_ns INTEGER NOT NULL,
    h2d_ns INTEGER NOT NULL,
    forward_ns INTEGER NOT NULL,
    backward_ns INTEGER NOT NULL,
    optimizer_ns INTEGER NOT NULL,
    load_ns INTEGER NOT NULL,
    load_cpu_ns INTEGER NOT NULL,
    read_ns INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS train_steps_by_run ON train_steps(run_id);
CREATE TABLE IF NOT EXISTS train_predictions (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    config INTEGER NOT NULL,
    label TEXT NOT NULL,
    epoch TEXT NOT NULL,             -- first | later
    method TEXT NOT NULL,            -- profile (its own minibatches) | simple | learned | transfer
    profiled INTEGER NOT NULL,
    predicted_s REAL NOT NULL,
    low_s REAL, high_s REAL,
    predicted_energy_j REAL, energy_low_j REAL, energy_high_j REAL,
    measured_s REAL,
    measured_energy_j REAL,
    record_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS train_predictions_by_run ON train_predictions(run_id);
"""

    def add_train_pass(self, row: Sequence[Any], steps: Sequence[Sequence[Any]]) -> None:
        """Store one pass's row (the 30 columns of `train_passes`) and its minibatches."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO train_passes(run_id, result_id, config, label, kind, pass, status, "
                "batch, workers, prefetch_factor, pin_memory, persistent_workers, storage, cores,"
                " precision, steps, items, wall_s, startup_s, fetch_s, h2d_s, forward_s,"
                " backward_s, optimizer_s, tail_s, cpu_s, energy_j, energy_source, error,"
                " record_json) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                tuple(row))
            db.executemany(
                "INSERT INTO train_steps(run_id, config, kind, pass, seq, items, fetch_ns, h2d_ns,"
                " forward_ns, backward_ns, optimizer_ns, load_ns, load_cpu_ns, read_ns) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", [tuple(s) for s in steps])

    def add_train_predictions(self, run_id: int, rows: Sequence[dict[str, Any]]) -> None:
        """Store prediction rows (`train.predict.Prediction.rows()`)."""
        with self._tx() as db:
            db.executemany(
                "INSERT INTO train_predictions(run_id, config, label, epoch, method, profiled, "
                "predicted_s, low_s, high_s, predicted_energy_j, energy_low_j, energy_high_j, "
                "measured_s, measured_energy_j, record_json) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                [(run_id, r["config"], r["label"], r["epoch"], r["method"], int(r["profiled"]),
                  r["predicted_s"], r.get("low_s"), r.get("high_s"), r.get("predicted_energy_j"),
                  r.get("energy_low_j"), r.get("energy_high_j"), r.get("measured_s"),
                  r.get("measured_energy_j"), json.dumps(r)) for r in rows])

    def train_passes(self, run_id: int) -> list[dict[str, Any]]:
        """Every stored pass of a run (its record), with its minibatches, in measured order."""
        rows = self._db.execute(
            "SELECT config, kind, pass, record_json FROM train_passes WHERE run_id = ? "
            "ORDER BY rowid", (run_id,)).fetchall()
        passes = []
        for row in rows:
            record = json.loads(row["record_json"])
            steps = self._db.execute(
                "SELECT seq, items, fetch_ns, h2d_ns, forward_ns, backward_ns, optimizer_ns, "
                "load_ns, load_cpu_ns, read_ns FROM train_steps WHERE run_id = ? AND config = ? "
                "AND kind = ? AND pass = ? ORDER BY seq",
                (run_id, row["config"], row["kind"], row["pass"])).fetchall()
            record["steps"] = [dict(s) for s in steps]
            passes.append(record)
        return passes
