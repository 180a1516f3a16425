"""A training pass as the rows of its tables (`infermux.store.train`) and a `results` row.

A pass is one row of `results` (so `infermux results list/show/export` show it; its samples
are the minibatches: latency = the minibatch's wall time, compute = forward + backward +
optimizer), one of `train_passes` and one of `train_steps` per minibatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from infermux.store import Sample, Store
from infermux.train.knobs import Knobs
from infermux.train.loop import PassResult

__all__ = ["PassRecord", "add_pass", "add_predictions", "load_passes"]


@dataclass
class PassRecord:
    """One measured pass of one configuration, as stored and as the predictor reads it."""

    config: int
    knobs: Knobs
    kind: str  # profile | epoch
    pass_name: str  # cold | warm
    status: str = "ok"
    error: str | None = None
    result: PassResult | None = None
    dataset_items: int = 0
    energy_j: float | None = None
    energy_source: str = "none"
    flags: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def wall_s(self) -> float | None:
        """The pass's wall time."""
        return self.result.wall_ns / 1e9 if self.result else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: knobs, timing totals, energy, flags (minibatches live in `train_steps`)."""
        data: dict[str, Any] = {
            "config": self.config, "label": self.knobs.label, "knobs": self.knobs.to_dict(),
            "kind": self.kind, "pass": self.pass_name, "status": self.status,
            "error": self.error, "dataset_items": self.dataset_items,
            "energy_j": self.energy_j, "energy_source": self.energy_source,
            "flags": self.flags, **self.extra,
        }
        if self.result is not None:
            data.update(self.result.summary())
            data.update(startup_ns=self.result.startup_ns, tail_ns=self.result.tail_ns,
                        wall_ns=self.result.wall_ns)
        return data

    def as_data(self) -> dict[str, Any]:
        """`to_dict` with the minibatches, the form `predict` reads (as `records.load_passes`)."""
        data = self.to_dict()
        data["steps"] = [s.to_dict() for s in self.result.steps] if self.result else []
        return data


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
    wall_s = rec.result.wall_ns / 1e9 if rec.result else 0.0
    totals = [phases.get(p, 0) / 1e9 if rec.result else None
              for p in ("startup", "fetch", "h2d", "forward", "backward", "optimizer", "tail")]
    row = (run_id, result_id, rec.config, k.label, rec.kind, rec.pass_name, rec.status, k.batch,
           k.workers, k.prefetch_factor, int(k.pin_memory), int(k.persistent_workers),
           k.storage, json.dumps(list(k.cores) if k.cores else None), k.precision,
           len(steps), rec.result.items if rec.result else 0, wall_s, *totals,
           rec.result.cpu_s if rec.result else None, rec.energy_j, rec.energy_source,
           rec.error, json.dumps(rec.to_dict()))
    store.add_train_pass(row, [
        (run_id, rec.config, rec.kind, rec.pass_name, s.seq, s.items, s.fetch_ns, s.h2d_ns,
         s.forward_ns, s.backward_ns, s.optimizer_ns, s.load_ns, s.load_cpu_ns, s.read_ns)
        for s in steps])
    if telemetry_rows:
        store.add_telemetry(run_id, result_id, telemetry_rows)
    return result_id


def add_predictions(store: Store, run_id: int, rows: list[dict[str, Any]]) -> None:
    """Store prediction rows (`predict.Prediction.rows()`)."""
    store.add_train_predictions(run_id, rows)


def load_passes(store: Store, run_id: int) -> list[dict[str, Any]]:
    """Every stored pass of a run (its record), with its minibatches, in measured order."""
    return store.train_passes(run_id)
