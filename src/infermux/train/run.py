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
from dataclasses import dataclass, field, replace
from typing import Any

from infermux.errors import UsageError
from infermux.store import Recording, Store
from infermux.train import records
from infermux.train.data import fs_type
from infermux.train.knobs import Knobs
from infermux.train.predict import (
    MIN_STEADY_STEPS,
    Components,
    Prediction,
    choose_profiled,
    covering_order,
    fit_components,
    mape,
    model_cell,
    predict_all,
    steady,
    warmup_steps,
)
from infermux.train.profile import (
    MINIBATCH_SHARE,
    PassRecord,
    ProgressFn,
    TrainConfig,
    TrainSetup,
    measure_configs,
    prepare,
    recorded,
    start_sampler,
)

__all__ = ["PredictReport", "repredict", "run_train_predict"]


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
    #: The profile share of an epoch the run was given (the budget rule's limit).
    share: float = 0.1
    #: The first profiled configuration measured again after validation (`_drift_check`).
    drift: dict[str, Any] | None = None

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

    def budget(self, share: float = 0.1) -> dict[str, Any]:
        """What the profile cost against the rule: ≤ `share` of an epoch, ≤ a third of the grid.

        A configuration's profile time is the wall time of its profile passes (start-up, every
        minibatch, tail; not the page-cache eviction before them), against its own shorter
        predicted epoch (first or later).
        """
        rows: list[dict[str, Any]] = []
        for i in self.profiled:
            recs = [p for p in self.passes if p.config == i and p.result is not None]
            pred = self.predictions[i] if i < len(self.predictions) else None
            if not recs or pred is None:
                continue
            spent = sum(p.result.wall_ns for p in recs if p.result) / 1e9
            epoch = min(e["predicted_s"] or math.inf for e in pred.epochs.values())
            knobs = self.configs[i]
            rows.append({
                "label": knobs.label, "profile_s": spent,
                "profile_minibatches": sum(len(p.result.steps) for p in recs if p.result),
                "epoch_minibatches": math.ceil(self.dataset_items / knobs.batch),
                "epoch_s": epoch, "share": spent / epoch if epoch else None,
                "flags": sorted({f for p in recs for f in p.flags if f.startswith("short")})})
        shares = [r["share"] for r in rows if r["share"] is not None]
        allowed = math.ceil(len(self.configs) / 3)
        return {
            "rule": f"profile ≤ {share:.0%} of an epoch for ≤ 1/3 of the configurations",
            "configurations": len(self.configs), "profiled": len(self.profiled),
            "profiled_allowed": allowed, "max_share": max(shares) if shares else None,
            "mean_share": sum(shares) / len(shares) if shares else None,
            "profile_s": sum(r["profile_s"] for r in rows),
            "ok": bool(shares) and len(self.profiled) <= allowed and max(shares) <= share,
            "per_config": rows,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        profiled_steps = sum(len(p.result.steps) for p in self.passes if p.result)
        return {
            "run_id": self.run_id, "status": self.status, "model": self.model,
            "dataset_items": self.dataset_items,
            "profiled": [self.configs[i].label for i in self.profiled],
            "profiled_minibatches": profiled_steps,
            "model_info": self.info, "scores": self.scores(), "budget": self.budget(
                self.share),
            "predictions": [r for p in self.predictions for r in p.rows()],
            "profile_passes": [p.to_dict() for p in self.passes],
            "validation_passes": [p.to_dict() for p in self.validation],
            "notes": self.notes, "elapsed_s": self.elapsed_s, "profile_s": self.profile_s,
            "validate_s": self.validate_s, "drift": self.drift,
        }


def profile_fits(knobs: Knobs, items: int, share: float) -> bool:
    """Whether a profile of `knobs` fits in `share` of its epoch's minibatches.

    The profile (`profile.profile_steps`) has `profile.MINIBATCH_SHARE` of the share for its
    minibatches (the rest for its start-up and tail): its ramp (one minibatch per worker) and
    `MIN_STEADY_STEPS` steady minibatches in each half must fit there.
    """
    per_epoch = math.ceil(items / knobs.batch)
    return (warmup_steps(knobs.workers) + 2 * MIN_STEADY_STEPS
            <= MINIBATCH_SHARE * share * per_epoch)


def estimated_share(knobs: Knobs, passes: list[dict[str, Any]], config: TrainConfig,
                    items: int, comps: Components | None = None) -> float | None:
    """A profile's share of its epoch, estimated from the profiles measured so far.

    The simple model (`predict.fit_components`) predicts the profile as a short epoch (one
    loader over `profile.profile_steps` minibatches: start-up, ramp, steady minibatches, tail)
    and the configuration's shorter epoch; None without passes to fit on. `comps`: the model
    already fitted on `passes`.
    """
    from infermux.train.profile import profile_steps

    if comps is None:
        comps = _components(passes)
    if comps is None:
        return None
    cold, warm = profile_steps(config, knobs, items)
    profile = comps.predict(knobs, "cold", (cold + warm) * knobs.batch)["epoch_s"]
    epoch = min(comps.predict(knobs, p, items)["epoch_s"] for p in ("cold", "warm"))
    return profile / epoch if epoch > 0 else None


def _components(passes: list[dict[str, Any]]) -> Components | None:
    """The simple model fitted on `passes`; None without passes it can be fitted on."""
    if not passes:
        return None
    try:
        return fit_components(passes, len(os.sched_getaffinity(0)))
    except UsageError:
        return None


#: A profile is aimed at this much of its share: its estimate, made before it runs, errs both
#: ways. On H100 hosts the share that profiles came to (against their epochs as finally
#: predicted) was up to 1.37× the estimate: aimed at 90% of a 10% share, a ResNet18 profile
#: with eight loader workers came to 10.6% and 11.4% of its epoch in two runs of three.
SHARE_MARGIN = 0.7


def fitting_config(knobs: Knobs, passes: list[dict[str, Any]], config: TrainConfig,
                   items: int) -> tuple[TrainConfig | None, float | None]:
    """The profile of `knobs` within `SHARE_MARGIN` of the share: (its config, its estimate).

    `config` itself where its profile is estimated within the margin (or cannot be estimated
    yet); else one with fewer minibatches (a smaller `profile_share` for this profile alone)
    whose estimate is; None where even the shortest profile (`profile.profile_steps`' floor)
    is estimated over it. The estimate returned is the returned profile's (with None, the
    profile's as configured).
    """
    aim = SHARE_MARGIN * config.profile_share
    comps = _components(passes)
    est = estimated_share(knobs, passes, config, items, comps)
    if est is None or est <= aim:
        return config, est
    trial = config
    for _ in range(16):
        trial = replace(trial, profile_share=trial.profile_share * 0.85)
        got = estimated_share(knobs, passes, trial, items, comps)
        if got is None:
            break
        if got <= aim:
            return trial, got
    return None, est


def _profile_within_share(setup: TrainSetup, configs: list[Knobs], pool: list[int], count: int,
                          *, progress: ProgressFn | None, notes: list[str]
                          ) -> tuple[list[PassRecord], list[int]]:
    """Profile `count` configurations of `pool` whose profiles fit in the profile share.

    Candidates come in the order a covering design adds them; before each (after the first),
    its profile's share of its epoch is estimated from the profiles measured so far
    (`estimated_share`); one estimated over `SHARE_MARGIN` of the share is profiled with fewer
    minibatches (`fitting_config`), and one whose shortest profile is still over it is passed
    over for the next: another configuration of its model cell where one is left
    (`cell_first`), so the cell still gets a profile at that batch. The budget
    (`TrainConfig.budget_s`) holds for all of them together.
    """
    config = setup.config
    started = time.perf_counter()
    records_: list[PassRecord] = []
    chosen: list[int] = []
    passed_over: list[str] = []
    shortened: list[str] = []
    order = _coverage_order(configs, pool, count)
    while order:
        i = order.pop(0)
        if len(chosen) >= count:
            break
        data = [p.as_data() for p in records_ if p.status == "ok"]
        fitted, est = fitting_config(configs[i], data, config, setup.dataset_items)
        if fitted is None:
            passed_over.append(f"{configs[i].label} (~{est:.0%})")
            order = cell_first(configs, order, i)
            continue
        if fitted is not config:
            shortened.append(f"{configs[i].label} (~{est:.0%})")
        spent = time.perf_counter() - started
        if config.budget_s is not None and chosen and spent * (1 + 1 / len(chosen)) > \
                config.budget_s:  # the next one, at the mean so far, would not fit
            notes.append(f"{count - len(chosen)} profile(s) did not fit in the budget")
            break

        def on_progress(label: str, _: float, done: int = len(chosen)) -> None:
            if progress is not None:
                progress(label, 0.5 * done / count)

        recs, _ = measure_configs(setup if fitted is config else replace(setup, config=fitted),
                                  [configs[i]], progress=on_progress, indices=[i])
        records_ += recs
        chosen.append(i)
    if shortened:
        notes.append(f"profiled with fewer minibatches, to stay within {SHARE_MARGIN:.0%} of "
                     f"the {config.profile_share:.0%} share: {', '.join(shortened)}")
    if passed_over:
        notes.append(f"not profiled, even their shortest profile estimated over "
                     f"{SHARE_MARGIN * config.profile_share:.0%} of their epoch: "
                     f"{', '.join(passed_over)}")
    return records_, sorted(chosen)


def _stored_passes(store: Store, run_id: int, configs: list[Knobs]) -> list[dict[str, Any]]:
    """A stored run's passes, renumbered by the grid's configurations (matched by label)."""
    index = {k.label: i for i, k in enumerate(configs)}
    passes = []
    for data in records.load_passes(store, run_id):
        if data["label"] in index and data["kind"] != "probe":
            data["config"] = index[data["label"]]
            passes.append(data)
    return passes


def _reference(store: Store | None, run_id: int) -> list[dict[str, Any]]:
    if store is None:
        raise UsageError("--reference needs the results database: drop --no-store")
    store.run(run_id)  # one line if the run is not there
    passes = [p for p in records.load_passes(store, run_id) if p["kind"] != "probe"]
    if not passes:
        raise UsageError(f"--reference {run_id} holds no training passes: give the id of a "
                         "train-profile or train-predict run (see `infermux results list`)")
    # Each configuration of the reference run is its own group: keep their numbers apart.
    for data in passes:
        data["config"] = 10_000 + data["config"]
    return passes


def _pick_validation(configs: list[Knobs], profiled: list[int], validate: int | None,
                     predictions: list[Prediction] | None = None,
                     budget_s: float | None = None) -> list[int]:
    """Held-out configurations to measure, covering the knob levels.

    `validate` of them (None: all), and with `budget_s` only as many as their predicted two
    epochs fit in it.
    """
    held = [i for i in range(len(configs)) if i not in profiled]
    count = len(held) if validate is None else min(validate, len(held))
    if budget_s is None or predictions is None:
        return held if count >= len(held) else _covering(configs, held, count)
    picked: list[int] = []
    spent = 0.0
    for i in _coverage_order(configs, held, count):
        if len(picked) >= count:
            break
        cost = sum(e["predicted_s"] or 0.0 for e in predictions[i].epochs.values()) * 1.15
        if picked and spent + cost > budget_s:
            continue
        picked.append(i)
        spent += cost
    return sorted(picked)


def cell_first(configs: list[Knobs], order: list[int], passed: int) -> list[int]:
    """`order` with the configurations of `passed`'s model cell moved to its front.

    The cell is (cores, precision, with or without workers, batch); the configurations moved
    keep their places among themselves, the others theirs.
    """
    cell = model_cell(configs[passed])
    same = [j for j in order if model_cell(configs[j]) == cell]
    return same + [j for j in order if j not in same]


def _covering(configs: list[Knobs], held: list[int], count: int) -> list[int]:
    """`count` of the `held` configurations covering the knob levels."""
    chosen = choose_profiled([configs[i] for i in held], count)
    return [held[i] for i in chosen]


def _coverage_order(configs: list[Knobs], held: list[int], count: int) -> list[int]:
    """The held-out configurations in the order a covering design of `count` adds them."""
    return [held[i] for i in covering_order([configs[i] for i in held], count)]


def run_train_predict(config: TrainConfig, *, store: Store | None = None,
                      progress: ProgressFn | None = None, command: str = "",
                      profile_configs: int | None = None, from_run: int | None = None,
                      reference_run: int | None = None, method: str = "auto",
                      validate: int | None = 0,
                      validate_budget_s: float | None = None) -> PredictReport:
    """Profile a subset, predict all, validate held-out configurations (module docstring).

    `validate`: 0 = no validation, None = every held-out configuration, N = that many;
    `validate_budget_s`: only as many as their predicted epochs fit in this many seconds.
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
                           setup.dataset_items, setup.notes, share=config.profile_share)
    rec = Recording(None)
    try:
        with recorded(setup, store, command, {
                "configs": [k.label for k in configs], "method": method, "from_run": from_run,
                "reference_run": reference_run}) as rec:
            report.run_id = rec.run_id
            _predict_body(setup, report, rec, store=store, progress=progress, share=share,
                          from_run=from_run, reference=reference, method=method,
                          validate=validate, validate_budget_s=validate_budget_s,
                          started=started)
        return report
    finally:
        report.status = rec.status
        report.elapsed_s = time.perf_counter() - started
        setup.close()


def _predict_body(setup: TrainSetup, report: PredictReport, rec: Recording, *,
                  store: Store | None, progress: ProgressFn | None, share: int,
                  from_run: int | None, reference: list[dict[str, Any]] | None, method: str,
                  validate: int | None, validate_budget_s: float | None, started: float
                  ) -> None:
    """Profile (or read stored profiles), predict, validate, store: `run_train_predict`'s work."""
    config, configs = setup.config, report.configs
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
        fits = [i for i, k in enumerate(configs)
                if profile_fits(k, setup.dataset_items, config.profile_share)]
        if len(fits) < len(configs):
            report.notes.append(
                f"{len(configs) - len(fits)} configuration(s) have too few minibatches per epoch "
                f"to profile within {config.profile_share:.0%} of it with "
                f"{MIN_STEADY_STEPS} steady minibatches per half (their loader's ramp is "
                "longer): they are predicted, not profiled")
        pool = fits if len(fits) >= share else list(range(len(configs)))
        report.passes, report.profiled = _profile_within_share(
            setup, configs, pool, share, progress=progress, notes=report.notes)
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
        chosen = _pick_validation(configs, report.profiled, validate, report.predictions,
                                  validate_budget_s)
        if len(chosen) < len([i for i in range(len(configs)) if i not in report.profiled]):
            report.notes.append(f"validated {len(chosen)} held-out configuration(s)"
                                + (f" within the {validate_budget_s:.0f} s validation budget"
                                   if validate_budget_s is not None else ""))

        def on_progress(label: str, fraction: float) -> None:
            if progress is not None:
                progress(label, 0.5 + 0.5 * fraction)

        report.validation, _ = measure_configs(setup, [configs[i] for i in chosen],
                                               kind="epoch", progress=on_progress,
                                               indices=chosen)
        for done in report.validation:
            if done.status == "ok" and done.result is not None:
                report.predictions[done.config].measured[
                    "first" if done.pass_name == "cold" else "later"] = {
                    "s": done.result.wall_ns / 1e9, "energy_j": done.energy_j}
    report.validate_s = time.perf_counter() - t1
    if report.validation and from_run is None:
        report.drift = _drift_check(setup, report)
    if store is not None and setup.run_id is not None:
        records.add_predictions(store, setup.run_id,
                                [r for p in report.predictions for r in p.rows()])
    rec.summary = {
        "configs": len(configs), "profiled": len(report.profiled),
        "model": report.info.get("chosen"), "scores": report.scores(),
        "budget": {k: v for k, v in report.budget(config.profile_share).items()
                   if k != "per_config"}, "drift": report.drift,
        "elapsed_s": time.perf_counter() - started}


#: A reference profile that moved by more than this between profiling and the end of validation
#: is reported: the machine itself changed speed, and the measured epochs carry that.
DRIFT_NOTE = 0.1


def _drift_check(setup: TrainSetup, report: PredictReport) -> dict[str, Any] | None:
    """Profile the first profiled configuration again after validation: did the machine drift.

    The same knobs, minibatches and files as its profile (stored as kind `probe`, never fitted
    on). The ratio of the steady per-minibatch times, after over before, says how much faster
    or slower the machine ran the same work once the validation epochs were measured; a
    prediction error of that size is the machine's, not the predictor's.
    """
    for i in report.profiled:
        before = [p for p in report.passes if p.config == i and p.status == "ok" and p.result]
        if len(before) == 2:
            break
    else:
        return None
    probe, _ = measure_configs(setup, [report.configs[i]], kind="probe", indices=[i])
    after = [p for p in probe if p.status == "ok" and p.result]
    if len(after) != 2:
        return {"label": report.configs[i].label, "error": next(
            (p.error for p in probe if p.error), "the probe did not complete")}
    out = drift_of(report.configs[i].label, [p.as_data() for p in before],
                   [p.as_data() for p in after])
    if out and out["ratio"] is not None and abs(out["ratio"] - 1) > DRIFT_NOTE:
        report.notes.append(
            f"the machine drifted: {out['label']} profiled again after validation ran "
            f"{out['ratio']:.2f}× as long per minibatch ({out['before_ms']:.1f} → "
            f"{out['after_ms']:.1f} ms); the measured epochs carry that, so part of the error "
            "is the machine's")
    return out


def drift_of(label: str, before: list[dict[str, Any]], after: list[dict[str, Any]]
             ) -> dict[str, Any] | None:
    """Steady per-minibatch time of a profile (its passes' data) and of its probe, and the ratio."""
    t_before = [f for f in (steady(p) for p in before) if f]
    t_after = [f for f in (steady(p) for p in after) if f]
    if not t_before or len(t_before) != len(t_after):
        return None
    b = sum(f["T"] for f in t_before) / len(t_before)
    a = sum(f["T"] for f in t_after) / len(t_after)
    return {"label": label, "before_ms": b * 1e3, "after_ms": a * 1e3,
            "ratio": a / b if b else None}


def _grid_configs(grid: dict[str, Any]) -> list[Knobs]:
    """A stored grid's configurations in the order `Grid.configs` made them.

    Not validated: the core sets may be another machine's.
    """
    import itertools

    seen: dict[Knobs, None] = {}
    cores = [tuple(c) if c is not None else None for c in grid["cores"]]
    for b, w, pf, pin, per, st, co, pr in itertools.product(
            grid["batch"], grid["workers"], grid["prefetch_factor"], grid["pin_memory"],
            grid["persistent_workers"], grid["storage"], cores, grid["precision"]):
        knobs = Knobs(b, w, pf, pin, per, st, co, pr)
        if w == 0:
            knobs = Knobs(b, 0, 2, pin, False, st, co, pr)
        seen.setdefault(knobs, None)
    return list(seen)


def repredict(store: Store, run_id: int, *, reference_run: int | None = None,
              method: str = "auto") -> dict[str, Any]:
    """Predict a stored `train-predict` run again from its stored profiles, offline.

    The run's profile passes feed `predict_all` (with a reference run's for transfer) and its
    stored validation epochs are the measurements: the model can be changed and scored again on
    a run measured elsewhere, without a device. Returns the predictions, the model's
    information and the scores (as `PredictReport.scores`).
    """
    run = store.run(run_id)
    config = run["config"]
    if "grid" not in config:
        raise UsageError(f"run {run_id} is not a training run (kind {run.get('kind')!r})")
    configs = _grid_configs(config["grid"])
    index = {k.label: i for i, k in enumerate(configs)}
    passes = records.load_passes(store, run_id)
    profile = [p for p in passes if p["kind"] == "profile" and p.get("status", "ok") == "ok"]
    epochs = [p for p in passes if p["kind"] == "epoch" and p.get("status", "ok") == "ok"]
    for p in profile + epochs:
        p["config"] = index[p["label"]]
    reference = _reference(store, reference_run) if reference_run is not None else None
    cpu = (run.get("environment") or {}).get("cpu") or {}
    all_cores = int(cpu.get("usable_cores") or cpu.get("logical_cores") or os.cpu_count() or 1)
    tmpfs = {s: s == "tmpfs" for s in config["grid"]["storage"]}
    predictions, info = predict_all(configs, profile, items=config["dataset_items"],
                                    all_cores=all_cores, tmpfs=tmpfs, method=method,
                                    reference=reference)
    for p in epochs:
        predictions[p["config"]].measured["first" if p["pass"] == "cold" else "later"] = {
            "s": p["wall_ns"] / 1e9, "energy_j": p.get("energy_j")}
    report = PredictReport(run_id, config.get("model", {}), configs,
                           sorted({p["config"] for p in profile}), predictions, info, [], [],
                           config["dataset_items"])
    shares = {}
    for i in report.profiled:
        spent = sum(p["wall_ns"] for p in profile if p["config"] == i) / 1e9
        epoch = min(e["predicted_s"] or math.inf for e in predictions[i].epochs.values())
        shares[configs[i].label] = spent / epoch
    probes = [p for p in passes if p["kind"] == "probe" and p.get("status", "ok") == "ok"]
    drift = drift_of(probes[0]["label"], [p for p in profile if p["label"] == probes[0]["label"]],
                     probes) if probes else None
    return {"run_id": run_id, "configs": [k.label for k in configs], "profile_shares": shares,
            "profiled": [configs[i].label for i in report.profiled], "model_info": info,
            "scores": report.scores(), "drift": drift,
            "predictions": [r for p in predictions for r in p.rows()]}
