"""Training runs in the results database (runs of kind `train`).

- `results`: one row per measured pass (a configuration's cold or warm pass of a profile, or a
  full epoch), so `infermux results list/show/export` show them; its samples are the
  minibatches (latency = the minibatch's wall time, compute = forward + backward + optimizer).
- `train_passes`: the same passes with every phase's total, CPU time, energy and the knobs.
- `train_steps`: every minibatch, every phase (ns), and the loader's own time for it.
- `train_predictions`: each configuration's predicted epoch time and energy (with bounds), and
  the measured figures where a validation measured them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from infermux.store import Sample, Store

if TYPE_CHECKING:
    from infermux.train.profile import PassRecord

__all__ = ["add_pass", "add_predictions", "ensure_tables", "load_passes"]

_SCHEMA = """
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


def ensure_tables(store: Store) -> None:
    """Create the training tables if this database has none yet."""
    store.connection.executescript(_SCHEMA)
    store.connection.commit()


def _result_record(rec: PassRecord, model_name: str, unit: str) -> dict[str, Any]:
    summary = rec.result.summary() if rec.result else {}
    k = rec.knobs
    return {
        "model": model_name, "unit": unit, "engine": "torch-train", "batch": k.batch,
        "instances": 1, "data": k.storage, "status": rec.status, "valid": rec.status == "ok",
        "validity_note": "; ".join(rec.flags), "items": summary.get("items", 0),
        "window_s": summary.get("wall_s", 0.0),
        "items_per_s": summary.get("items_per_s"), "error": rec.error,
        "train": rec.to_dict(),
    }


def add_pass(store: Store, run_id: int, rec: PassRecord, *, model_name: str, unit: str,
             telemetry_rows: list[dict[str, Any]] | None = None) -> int:
    """Store one pass (and its minibatches and telemetry) in one go; returns its result id."""
    steps = rec.result.steps if rec.result else []
    samples = [Sample(0, s.wall_ns, s.h2d_ns, s.forward_ns + s.backward_ns + s.optimizer_ns, 0)
               for s in steps]
    result_id = store.add_result(run_id, _result_record(rec, model_name, unit), samples)
    k = rec.knobs
    phases = rec.result.phase_totals_ns() if rec.result else {}
    with store.connection as db:
        db.execute(
            "INSERT INTO train_passes(run_id, result_id, config, label, kind, pass, status, batch,"
            " workers, prefetch_factor, pin_memory, persistent_workers, storage, cores, precision,"
            " steps, items, wall_s, startup_s, fetch_s, h2d_s, forward_s, backward_s,"
            " optimizer_s, tail_s, cpu_s, energy_j, energy_source, error, record_json)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (run_id, result_id, rec.config, k.label, rec.kind, rec.pass_name, rec.status, k.batch,
             k.workers, k.prefetch_factor, int(k.pin_memory), int(k.persistent_workers),
             k.storage, json.dumps(list(k.cores) if k.cores else None), k.precision,
             len(steps), rec.result.items if rec.result else 0,
             rec.result.wall_ns / 1e9 if rec.result else 0.0,
             *(phases.get(p, 0) / 1e9 if rec.result else None
               for p in ("startup", "fetch", "h2d", "forward", "backward", "optimizer", "tail")),
             rec.result.cpu_s if rec.result else None, rec.energy_j, rec.energy_source,
             rec.error, json.dumps(rec.to_dict())),
        )
        db.executemany(
            "INSERT INTO train_steps(run_id, config, kind, pass, seq, items, fetch_ns, h2d_ns, "
            "forward_ns, backward_ns, optimizer_ns, load_ns, load_cpu_ns, read_ns) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            [(run_id, rec.config, rec.kind, rec.pass_name, s.seq, s.items, s.fetch_ns, s.h2d_ns,
              s.forward_ns, s.backward_ns, s.optimizer_ns, s.load_ns, s.load_cpu_ns, s.read_ns)
             for s in steps],
        )
    if telemetry_rows:
        store.add_telemetry(run_id, result_id, telemetry_rows)
    return result_id


def add_predictions(store: Store, run_id: int, rows: list[dict[str, Any]]) -> None:
    """Store prediction rows (`predict.Prediction.rows()`)."""
    with store.connection as db:
        db.executemany(
            "INSERT INTO train_predictions(run_id, config, label, epoch, method, profiled, "
            "predicted_s, low_s, high_s, predicted_energy_j, energy_low_j, energy_high_j, "
            "measured_s, measured_energy_j, record_json) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            [(run_id, r["config"], r["label"], r["epoch"], r["method"], int(r["profiled"]),
              r["predicted_s"], r.get("low_s"), r.get("high_s"), r.get("predicted_energy_j"),
              r.get("energy_low_j"), r.get("energy_high_j"), r.get("measured_s"),
              r.get("measured_energy_j"), json.dumps(r)) for r in rows],
        )


def load_passes(store: Store, run_id: int) -> list[dict[str, Any]]:
    """Every stored pass of a run (its record), with its minibatches, in measured order."""
    ensure_tables(store)
    rows = store.connection.execute(
        "SELECT config, kind, pass, record_json FROM train_passes WHERE run_id = ? ORDER BY rowid",
        (run_id,)).fetchall()
    passes = []
    for row in rows:
        record = json.loads(row["record_json"])
        steps = store.connection.execute(
            "SELECT seq, items, fetch_ns, h2d_ns, forward_ns, backward_ns, optimizer_ns, load_ns,"
            " load_cpu_ns, read_ns FROM train_steps WHERE run_id = ? AND config = ? AND kind = ?"
            " AND pass = ? ORDER BY seq", (run_id, row["config"], row["kind"], row["pass"]),
        ).fetchall()
        record["steps"] = [dict(s) for s in steps]
        passes.append(record)
    return passes
