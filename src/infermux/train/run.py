"""`train-predict`: profile a third of the grid briefly, predict every epoch, validate on the rest.

1. The configurations to profile: `profile_configs` of the grid (default a third), chosen to
   cover every pair of knob levels (`predict.choose_profiled`), or the passes of a stored
   profile run (`from_run`).
2. Each is profiled (`profile.measure_configs`, kind `profile`: a cold and a warm pass over a
   few dozen minibatches, within `profile_share` of an epoch).
3. Every configuration's first and later epoch is predicted (`predict.predict_all`), with a
   reference network's runs for transfer when given.
4. `validate`: held-out configurations are trained for two full epochs (kind `epoch`) and the
   predictions are scored against them (MAPE for time, and for energy).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from infermux.errors import UsageError
from infermux.store import Store
from infermux.train import records
from infermux.train.data import fs_type
from infermux.train.knobs import Knobs
from infermux.train.predict import Prediction, choose_profiled, mape, predict_all
from infermux.train.profile import (
    PassRecord,
    ProgressFn,
    TrainConfig,
    begin,
    measure_configs,
    prepare,
    start_sampler,
)

__all__ = ["PredictReport", "run_train_predict"]


@dataclass
class PredictReport:
    """Predictions for every configuration, how they were made, and how they held up."""

    run_id: int | None
    model: dict[str, Any]
    configs: list[Knobs]
    profiled: list[int]
    predictions: list[Prediction]
    info: dict[str, Any]
    passes: list[PassRecord]
    validation: list[PassRecord]
    dataset_items: int
    notes: list[str] = field(default_factory=list)
    status: str = "complete"
    elapsed_s: float = 0.0
    profile_s: float = 0.0
    validate_s: float = 0.0

    def scores(self) -> dict[str, Any]:
        """MAPE of the held-out (not profiled) configurations that were measured, %."""
        held = [p for p in self.predictions if p.measured and not p.profiled]
        out: dict[str, Any] = {"configurations": len(held)}
        for epoch in ("first", "later"):
            out[f"{epoch}_time_mape_pct"] = mape(
                [(p.epochs[epoch]["predicted_s"], p.measured.get(epoch, {}).get("s"))
                 for p in held])
            out[f"{epoch}_energy_mape_pct"] = mape(
                [(p.epochs[epoch]["predicted_energy_j"],
                  p.measured.get(epoch, {}).get("energy_j")) for p in held])
            inside = [p for p in held if p.measured.get(epoch, {}).get("s") is not None and (
                (p.epochs[epoch]["low_s"] or 0) <= p.measured[epoch]["s"]  # type: ignore[operator]
                <= (p.epochs[epoch]["high_s"] or math.inf))]
            out[f"{epoch}_within_bounds"] = f"{len(inside)}/{len(held)}"
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        profiled_steps = sum(len(p.result.steps) for p in self.passes if p.result)
        return {
            "run_id": self.run_id, "status": self.status, "model": self.model,
            "dataset_items": self.dataset_items,
            "profiled": [self.configs[i].label for i in self.profiled],
            "profiled_minibatches": profiled_steps,
            "model_info": self.info, "scores": self.scores(),
            "predictions": [r for p in self.predictions for r in p.rows()],
            "profile_passes": [p.to_dict() for p in self.passes],
            "validation_passes": [p.to_dict() for p in self.validation],
            "notes": self.notes, "elapsed_s": self.elapsed_s, "profile_s": self.profile_s,
            "validate_s": self.validate_s,
        }


def _stored_passes(store: Store, run_id: int, configs: list[Knobs]) -> list[dict[str, Any]]:
    """A stored run's passes, renumbered by the grid's configurations (matched by label)."""
    index = {k.label: i for i, k in enumerate(configs)}
    passes = []
    for data in records.load_passes(store, run_id):
        if data["label"] in index:
            data["config"] = index[data["label"]]
            passes.append(data)
    return passes


def _reference(store: Store | None, run_id: int) -> list[dict[str, Any]]:
    if store is None:
        raise UsageError("--reference needs the results database: drop --no-store")
    store.run(run_id)  # one line if the run is not there
    passes = records.load_passes(store, run_id)
    if not passes:
        raise UsageError(f"--reference {run_id} holds no training passes: give the id of a "
                         "train-profile or train-predict run (see `infermux results list`)")
    # Each configuration of the reference run is its own group: keep their numbers apart.
    for data in passes:
        data["config"] = 10_000 + data["config"]
    return passes


def _pick_validation(configs: list[Knobs], profiled: list[int], validate: int | None
                     ) -> list[int]:
    held = [i for i in range(len(configs)) if i not in profiled]
    if validate is None or validate >= len(held):
        return held
    chosen = choose_profiled([configs[i] for i in held], validate)
    return [held[i] for i in chosen]


def run_train_predict(config: TrainConfig, *, store: Store | None = None,
                      progress: ProgressFn | None = None, command: str = "",
                      profile_configs: int | None = None, from_run: int | None = None,
                      reference_run: int | None = None, method: str = "auto",
                      validate: int | None = 0) -> PredictReport:
    """Profile a subset, predict all, validate held-out configurations (module docstring).

    `validate`: 0 = no validation, None = every held-out configuration, N = that many.
    """
    if method not in ("auto", "simple", "learned"):
        raise UsageError(f"--method {method!r} is not auto, simple or learned")
    if validate is not None and validate < 0:
        raise UsageError(f"--validate {validate} must be 0 or more (or all)")
    started = time.perf_counter()
    configs = config.grid.configs(config.unit)
    share = profile_configs if profile_configs is not None else math.ceil(len(configs) / 3)
    if not 1 <= share <= len(configs):
        raise UsageError(f"--profile-configs {share} is out of range: 1 to {len(configs)} "
                         "(the grid's configurations), e.g. a third of them")
    reference = _reference(store, reference_run) if reference_run is not None else None
    setup = prepare(config, progress=progress)
    report = PredictReport(None, setup.model.describe(), configs, [], [], {}, [], [],
                           setup.dataset_items, setup.notes)
    status = "failed"
    try:
        begin(setup, store, command, {"configs": [k.label for k in configs], "method": method,
                                      "from_run": from_run, "reference_run": reference_run})
        report.run_id = setup.run_id
        start_sampler(setup)
        t0 = time.perf_counter()
        if from_run is not None:
            if store is None:
                raise UsageError("--from needs the results database: drop --no-store")
            passes = _stored_passes(store, from_run, configs)
            if not passes:
                raise UsageError(f"--from {from_run}: none of its configurations is in this grid; "
                                 "give the same --batch/--workers/... as that run")
            report.profiled = sorted({p["config"] for p in passes})
        else:
            report.profiled = choose_profiled(configs, share)
            budget = config.budget_s
            report.passes, skipped = measure_configs(
                setup, [configs[i] for i in report.profiled], progress=progress,
                budget_s=budget, indices=report.profiled)
            if skipped:
                report.notes.append(f"{len(skipped)} profile(s) did not fit in the budget")
            passes = [p.as_data() for p in report.passes if p.status == "ok"]
        report.profile_s = time.perf_counter() - t0
        tmpfs = {s: fs_type(path) == "tmpfs" for s, (path, _) in setup.datasets.items()}
        if progress is not None:
            progress("fitting the predictor", 0.5)
        report.predictions, report.info = predict_all(
            configs, passes, items=setup.dataset_items, all_cores=len(os.sched_getaffinity(0)),
            tmpfs=tmpfs, method=method, reference=reference)
        t1 = time.perf_counter()
        if validate != 0:
            chosen = _pick_validation(configs, report.profiled, validate)

            def on_progress(label: str, fraction: float) -> None:
                if progress is not None:
                    progress(label, 0.5 + 0.5 * fraction)

            report.validation, _ = measure_configs(setup, [configs[i] for i in chosen],
                                                   kind="epoch", progress=on_progress,
                                                   indices=chosen)
            for rec in report.validation:
                if rec.status == "ok" and rec.result is not None:
                    report.predictions[rec.config].measured[
                        "first" if rec.pass_name == "cold" else "later"] = {
                        "s": rec.result.wall_ns / 1e9, "energy_j": rec.energy_j}
        report.validate_s = time.perf_counter() - t1
        if store is not None and setup.run_id is not None:
            records.add_predictions(store, setup.run_id,
                                    [r for p in report.predictions for r in p.rows()])
        status = "complete"
        return report
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        report.status = status
        report.elapsed_s = time.perf_counter() - started
        setup.close()
        if store is not None and setup.run_id is not None:
            store.finish_run(setup.run_id, status, {
                "configs": len(configs), "profiled": len(report.profiled),
                "model": report.info.get("chosen"), "scores": report.scores(),
                "elapsed_s": report.elapsed_s})
