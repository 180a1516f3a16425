"""`train-predict`: profile a third of the grid briefly, predict every epoch, validate on the rest.

1. The configurations to profile: `profile_configs` of the grid (default a third), chosen to
   cover every pair of knob levels (`covering.choose_profiled`), or the passes of a stored
   profile run (`from_run`).
2. Each is profiled (`profile.measure_configs`, kind `profile`: a cold and a warm pass over a
   few dozen minibatches, within `profile_share` of an epoch).
3. Every configuration's first and later epoch is predicted (`predict.predict_all`), with a
   reference network's runs for transfer when given.
4. `validate`: held-out configurations, drawn at random one model cell at a time, are
   trained for two full epochs (kind `epoch`), each with what it was predicted from at its own
   batch (`drift_basis`) re-measured before and after it for the machine's drift, and the
   predictions are scored against them (MAPE
   for time, as measured and corrected for drift, and for energy), each validated epoch's
   error cut into the model's terms (`attribution`: start-up, compute, loader, contention)
   and the term that missed named.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from infermux.errors import UsageError
from infermux.store import Recording, Store
from infermux.train import records
from infermux.train.attribution import attribute, attribute_passes
from infermux.train.components import Components, fit_components
from infermux.train.covering import covered, covering_order, model_cell
from infermux.train.data import fs_type
from infermux.train.drift import DRIFT_Z, applied_drift, compute_drift_scale, drift_of, epoch_drift
from infermux.train.knobs import Knobs
from infermux.train.predict import Prediction, mape, predict_all
from infermux.train.profile import (
    COMPUTE_PROBE_STEPS,
    MINIBATCH_SHARE,
    PROBE_POWER_S,
    SHORT_PROFILE_ADVICE,
    PassRecord,
    ProgressFn,
    TrainConfig,
    TrainSetup,
    measure_compute,
    measure_configs,
    prepare,
    recorded,
    start_sampler,
)
from infermux.train.reference import read_speed, speed_drift
from infermux.train.steady import MIN_STEADY_STEPS, warmup_steps

__all__ = ["PredictReport", "drift_basis", "repredict", "run_train_predict"]


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
    #: The reference configuration re-measured between validations (`_validate`).
    drift: dict[str, Any] | None = None
    #: How the configurations were profiled (`_profile_plan`): `rule` (≤ the share of an
    #: epoch, ≥ `MIN_STEADY_STEPS` steady minibatches a half), `thin` (fewer minibatches, more
    #: configurations, to reach the grid's cells), with `+whole` where whole epochs of
    #: configurations whose epoch costs seconds were measured instead.
    profile_mode: str = "rule"
    #: Held-out configurations in all, and the seed that drew the validated ones.
    held_out: int = 0
    validation_seed: int = 0
    #: Which term of the model missed the validated epochs (`attribution.attribute`).
    attribution: dict[str, Any] = field(default_factory=dict)
    #: The drift probes taken beside the validated epochs (`_validate`; never fitted on).
    drift_passes: list[PassRecord] = field(default_factory=list)
    #: Which rule could not hold and why, where epochs are too short for any profile
    #: (`short_epoch_line`); None where every configuration could be profiled within it.
    short_epochs: str | None = None
    #: The machine's own speed by fixed reference work, read after the profiles and after
    #: each validated configuration (`reference.read_speed`; reported, never applied).
    machine_speed: list[dict[str, Any]] = field(default_factory=list)

    def scores(self) -> dict[str, Any]:
        """MAPE of the held-out (not profiled) configurations that were measured, %."""
        held = [p for p in self.predictions if p.measured and not p.profiled]
        out: dict[str, Any] = {
            "configurations": len(held), "held_out": self.held_out,
            "subset": (f"{len(held)} of {self.held_out} held-out configurations, drawn at "
                       f"random (seed {self.validation_seed}) one model cell at a time, "
                       "before any prediction was looked at"),
            "extrapolated": sum(p.extrapolated for p in held)}
        for epoch in ("first", "later"):
            out[f"{epoch}_time_mape_pct"] = mape(
                [(p.epochs[epoch]["predicted_s"], p.measured.get(epoch, {}).get("s"))
                 for p in held])
            # The machine's speed moved by `drift` between the profiles and this epoch: the
            # prediction scaled by it (the reference configuration's own change).
            # Only a drift resolved from its noise scales it (`drift.applied_drift`).
            corrected: list[tuple[float | None, float | None]] = [
                ((p.epochs[epoch]["predicted_s"] or 0.0)
                 * (applied_drift(p.measured[epoch]) or 1.0),
                 p.measured[epoch].get("s")) for p in held
                if p.measured.get(epoch, {}).get("drift")]
            out[f"{epoch}_time_mape_drift_corrected_pct"] = (
                mape(corrected) if len(corrected) == len(held) else None)
            # Apart: the configurations of profiled cells (not extrapolated).
            out[f"{epoch}_time_mape_in_cells_pct"] = mape(
                [(p.epochs[epoch]["predicted_s"], p.measured.get(epoch, {}).get("s"))
                 for p in held if not p.extrapolated])
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
        # Compute probes are not a configuration's profile: each is counted against the rule's
        # cost in all, as its wall time over the shortest predicted epoch of its batch size.
        probes: list[dict[str, Any]] = []
        for p in self.passes:
            if p.kind != "compute" or p.result is None:
                continue
            k = p.knobs
            same = [self.predictions[j] for j, c in enumerate(self.configs)
                    if (c.cores, c.precision, c.batch) == (k.cores, k.precision, k.batch)
                    and j < len(self.predictions)]
            epoch = min((e["predicted_s"] or math.inf for q in same
                         for e in q.epochs.values()), default=math.inf)
            probes.append({"label": f"b{k.batch} {k.precision}",
                           "probe_s": p.result.wall_ns / 1e9,
                           "minibatches": len(p.result.steps),
                           "share": p.result.wall_ns / 1e9 / epoch
                           if math.isfinite(epoch) and epoch > 0 else None})
        probe_epochs = sum(r["share"] or 0.0 for r in probes)
        total = sum(shares) + probe_epochs
        # Drift probes beside the validated epochs, counted as the compute probes are: each
        # one's wall time over the shortest predicted epoch of the configuration it measures.
        drift: list[dict[str, Any]] = []
        for p in self.drift_passes:
            if p.result is None or not 0 <= p.config < len(self.predictions):
                continue
            epoch = min((e["predicted_s"] or math.inf
                         for e in self.predictions[p.config].epochs.values()), default=math.inf)
            drift.append({"label": p.knobs.label, "kind": p.kind,
                          "for": p.extra.get("drift_for"), "probe_s": p.result.wall_ns / 1e9,
                          "minibatches": len(p.result.steps),
                          "share": p.result.wall_ns / 1e9 / epoch
                          if math.isfinite(epoch) and epoch > 0 else None})
        drift_epochs = sum(r["share"] or 0.0 for r in drift)
        return {
            "rule": f"profile ≤ {share:.0%} of an epoch for ≤ 1/3 of the configurations",
            "mode": self.profile_mode,
            "configurations": len(self.configs), "profiled": len(self.profiled),
            "profiled_allowed": allowed, "max_share": max(shares) if shares else None,
            "mean_share": sum(shares) / len(shares) if shares else None,
            "profile_s": sum(r["profile_s"] for r in rows)
            + sum(r["probe_s"] for r in probes),
            "ok": bool(shares) and len(self.profiled) <= allowed and max(shares) <= share
            and total <= share * allowed,
            # The rule's cost in all (a third of the grid at the share each) against what the
            # profiles and compute probes cost in epochs: a thin plan profiles more
            # configurations for as much.
            "total_epochs": total, "total_epochs_allowed": share * allowed,
            "compute_probe_epochs": probe_epochs,
            "ok_in_total": bool(shares) and max(shares) <= share and total <= share * allowed,
            "per_config": rows, "compute_probes": probes,
            # The drift probes are validation's cost, taken only when validating, and feed no
            # prediction: counted beside the rule's total, not in `ok`.
            "drift_probes": drift, "drift_probe_epochs": drift_epochs,
            "drift_probe_minibatches": sum(r["minibatches"] for r in drift),
            "total_epochs_with_drift_probes": total + drift_epochs,
            "ok_with_drift_probes": bool(shares) and max(shares) <= share
            and total + drift_epochs <= share * allowed,
            "drift_probes_counted": (
                f"{len(drift)} drift probe(s) beside the validated epochs, "
                f"{sum(r['minibatches'] for r in drift)} minibatches, {drift_epochs:.2f} epochs "
                "(each its wall time over its configuration's shortest predicted epoch, as the "
                "compute probes are counted): validation's cost, beside the rule's total "
                f"({total:.2f} of {share * allowed:.2f} epochs), not in it" if drift else None),
            # Where even the thinnest profile is over the share of a configuration's epoch,
            # the one line saying so (`short_epoch_line`).
            "short_epochs": self.short_epochs,
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
            "drift_passes": [p.to_dict() for p in self.drift_passes],
            "notes": self.notes, "elapsed_s": self.elapsed_s, "profile_s": self.profile_s,
            "validate_s": self.validate_s, "drift": self.drift,
            "profile_mode": self.profile_mode, "attribution": self.attribution,
            "machine_speed": {"readings": self.machine_speed,
                              "drift": speed_drift(self.machine_speed)},
        }


#: A thin profile's steady minibatches per half (`profile.profile_steps`' floor): the least a
#: steady time and its spread are taken from.
THIN_STEADY_STEPS = 3
#: A thin plan's profiles leave this share of the rule's cost to the compute probes of the
#: batch sizes they cannot reach (`_compute_probes`).
PROBE_RESERVE = 0.25
#: The share of what the rule's cost leaves after the profiles that the compute probes' power
#: reads may use (`_compute_probes`).
PROBE_ROOM_USED = 0.8
#: Where no profile within the rule reaches a cell and a configuration of it is predicted to
#: take at most this long an epoch, its whole epochs are measured instead (`--whole-epochs-below`).
WHOLE_EPOCH_S = 10.0


def profile_fits(knobs: Knobs, items: int, share: float, steady: int = MIN_STEADY_STEPS
                 ) -> bool:
    """Whether a profile of `knobs` fits in `share` of its epoch's minibatches.

    The profile (`profile.profile_steps`) has `profile.MINIBATCH_SHARE` of the share for its
    minibatches (the rest for its start-up and tail): its ramp (one minibatch per worker) and
    `steady` steady minibatches in each half must fit there.
    """
    per_epoch = math.ceil(items / knobs.batch)
    return warmup_steps(knobs.workers) + 2 * steady <= MINIBATCH_SHARE * share * per_epoch


def _profile_plan(configs: list[Knobs], items: int, share: float, count: int
                  ) -> tuple[str, list[int], int, float, list[str]]:
    """(mode, candidates, how many to profile, each one's share, notes): what the rule can do.

    `rule`: `count` profiles of ≤ `share` of an epoch among the configurations with room for
    the ramp and `MIN_STEADY_STEPS` steady minibatches a half. Where those cannot reach every
    model cell of the grid (too few of them, or too few configurations for the cells), `thin`:
    one profile per cell (at most half the grid), each of `share` × `count` / that many (the
    rule's cost in all, spread over more configurations), with `THIN_STEADY_STEPS` steady
    minibatches a half, where that reaches more cells.
    """
    cells = {model_cell(k) for k in configs}
    fits = [i for i, k in enumerate(configs) if profile_fits(k, items, share)]
    reach = min(count, len({model_cell(configs[i]) for i in fits}))
    notes = []
    if len(fits) < len(configs):
        notes.append(
            f"{len(configs) - len(fits)} configuration(s) have too few minibatches per epoch "
            f"to profile within {share:.0%} of it with {MIN_STEADY_STEPS} steady minibatches "
            "per half (their loader's ramp is longer)")
    # At most half the grid, so that half is left to validate on.
    many = max(count, min(len(cells), len(configs) // 2))
    thin_share = share * count / many
    thin = [i for i, k in enumerate(configs)
            if profile_fits(k, items, thin_share, THIN_STEADY_STEPS)]
    # Batch sizes no thin profile can reach get compute probes, counted in the same cost:
    # the profiles leave them `PROBE_RESERVE` of it.
    batches = {(k.cores, k.precision, k.batch) for k in configs}
    probed = batches - {(configs[i].cores, configs[i].precision, configs[i].batch)
                        for i in thin}
    reserved = False
    if probed:
        less = [i for i, k in enumerate(configs)
                if profile_fits(k, items, thin_share * (1 - PROBE_RESERVE), THIN_STEADY_STEPS)]
        # Only where the thinner profiles still reach as many cells: else the probes go
        # beyond the rule's cost, and the budget says so.
        if len({model_cell(configs[i]) for i in less}) >= \
                len({model_cell(configs[i]) for i in thin}):
            thin, thin_share, reserved = less, thin_share * (1 - PROBE_RESERVE), True
    reach_thin = min(many, len({model_cell(configs[i]) for i in thin}))
    if reach == len(cells) or reach_thin <= reach:
        pool = fits if len(fits) >= count else list(range(len(configs)))
        return "rule", pool, count, share, notes
    notes.append(
        f"thin profiles: {many} configurations at ≤ {thin_share:.1%} of an epoch each (the "
        f"rule's cost, {count} at {share:.0%}, spread over more"
        + (f", less {PROBE_RESERVE:.0%} of it for compute probes of {len(probed)} batch "
           "size(s) no profile can reach" if reserved else "")
        + f"), {THIN_STEADY_STEPS}+ steady minibatches per half, so that {reach_thin} of the "
        f"grid's {len(cells)} model cells are profiled instead of {reach}")
    return "thin", thin, min(many, len(thin)), thin_share, notes


def short_epoch_line(configs: list[Knobs], items: int, share: float) -> str | None:
    """One line where even the thinnest profile is over `share` of some configurations' epochs.

    The thinnest profile is the loader's ramp (a minibatch per worker) and `THIN_STEADY_STEPS`
    steady minibatches a half, within `MINIBATCH_SHARE` of the share of the epoch's
    minibatches (`profile_fits`). None where every configuration has room for one.
    """
    short = [k for k in configs if not profile_fits(k, items, share, THIN_STEADY_STEPS)]
    if not short:
        return None
    need = sorted({warmup_steps(k.workers) + 2 * THIN_STEADY_STEPS for k in short})
    per = sorted({math.ceil(items / k.batch) for k in short})
    batches = sorted({k.batch for k in short})
    room = sorted({math.floor(MINIBATCH_SHARE * share * math.ceil(items / k.batch))
                   for k in short})

    def span(values: list[int]) -> str:
        return f"{values[0]}" if values[0] == values[-1] else f"{values[0]}–{values[-1]}"

    return (f"the profile rule (≤ {share:.0%} of an epoch) cannot hold for {len(short)} of "
            f"{len(configs)} configurations: {items} items make {span(per)} minibatches an "
            f"epoch at batch {','.join(str(b) for b in batches)}, and the thinnest profile (a "
            f"minibatch per loader worker and {THIN_STEADY_STEPS} steady minibatches a half) "
            f"needs {span(need)} where the rule leaves {span(room)} (60% of its share; start-up "
            "and tail take the rest); their cells are measured otherwise (thin profiles of "
            "other configurations, compute probes, whole epochs) or extrapolated, as the notes "
            "say")


def estimated_share(knobs: Knobs, passes: list[dict[str, Any]], config: TrainConfig,
                    items: int, comps: Components | None = None) -> float | None:
    """A profile's share of its epoch, estimated from the profiles measured so far.

    The simple model (`components.fit_components`) predicts the profile as a short epoch (one
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


def _components(passes: list[dict[str, Any]], probes: list[dict[str, Any]] | None = None,
                ) -> Components | None:
    """The simple model fitted on `passes`; None without passes it can be fitted on.

    `probes`: compute probes, fitted on as the predictor fits them.
    """
    if not passes:
        return None
    try:
        return fit_components(passes, len(os.sched_getaffinity(0)), probes)
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
        if data["label"] in index and not data["kind"].startswith(("probe", "drift")):
            data["config"] = index[data["label"]]
            passes.append(data)
        elif data["kind"] == "compute":  # its knobs have no workers: not a grid's label
            passes.append(data)
    return passes


def _reference(store: Store | None, run_id: int) -> list[dict[str, Any]]:
    if store is None:
        raise UsageError("--reference needs the results database: drop --no-store")
    store.run(run_id)  # one line if the run is not there
    passes = [p for p in records.load_passes(store, run_id)
              if not p["kind"].startswith(("probe", "drift")) and p["kind"] != "compute"]
    if not passes:
        raise UsageError(f"--reference {run_id} holds no training passes: give the id of a "
                         "train-profile or train-predict run (see `infermux results list`)")
    # Each configuration of the reference run is its own group: keep their numbers apart.
    for data in passes:
        data["config"] = 10_000 + data["config"]
    return passes


def validation_order(configs: list[Knobs], profiled: list[int], seed: int) -> list[int]:
    """Every held-out configuration in a seeded random order, stratified over the model cells.

    The cells (cores, precision, with or without workers, batch) come in a random order and
    each cell's configurations shuffled; the order takes one of each cell in turn. Nothing
    predicted is looked at, so a validated subset (a prefix of the order) is not chosen by the
    errors it scores.
    """
    rng = random.Random(seed)
    cells: dict[Any, list[int]] = defaultdict(list)
    for i, k in enumerate(configs):
        if i not in profiled:
            cells[model_cell(k)].append(i)
    keys = sorted(cells, key=str)
    rng.shuffle(keys)
    for key in keys:
        rng.shuffle(cells[key])
    order: list[int] = []
    while any(cells[key] for key in keys):
        order += [cells[key].pop(0) for key in keys if cells[key]]
    return order


def cell_first(configs: list[Knobs], order: list[int], passed: int) -> list[int]:
    """`order` with the configurations of `passed`'s model cell moved to its front.

    The cell is (cores, precision, with or without workers, batch); the configurations moved
    keep their places among themselves, the others theirs.
    """
    cell = model_cell(configs[passed])
    same = [j for j in order if model_cell(configs[j]) == cell]
    return same + [j for j in order if j not in same]


def _coverage_order(configs: list[Knobs], held: list[int], count: int) -> list[int]:
    """The held-out configurations in the order a covering design of `count` adds them."""
    return [held[i] for i in covering_order([configs[i] for i in held], count)]


def run_train_predict(config: TrainConfig, *, store: Store | None = None,
                      progress: ProgressFn | None = None, command: str = "",
                      profile_configs: int | None = None, from_run: int | None = None,
                      reference_run: int | None = None, method: str = "auto",
                      validate: int | None = 0,
                      validate_budget_s: float | None = None,
                      whole_epoch_s: float = WHOLE_EPOCH_S,
                      deadline_s: float | None = None,
                      compute_probes: bool = True) -> PredictReport:
    """Profile a subset, predict all, validate held-out configurations (module docstring).

    `validate`: 0 = no validation, None = every held-out configuration, N = that many (drawn
    at random, `validation_order`); `validate_budget_s`: only as many as fit in this many
    seconds; `whole_epoch_s`: a cell no profile within the rule reaches gets whole epochs
    measured where one takes at most this long (0: never). `deadline_s`: the whole call's
    time; whole epochs and validated configurations start only where they are expected to end
    within it (the set-up and the profiles are bounded by `TrainConfig.budget_s` instead).
    `compute_probes`: measure the compute of each batch size no profile reached
    (`_compute_probes`); off, those batch sizes' compute comes from the other sizes' lines.
    """
    if deadline_s is not None and deadline_s <= 0:
        raise UsageError(f"--deadline {deadline_s} s must be positive, e.g. --deadline 5m")
    if whole_epoch_s < 0:
        raise UsageError(f"--whole-epochs-below {whole_epoch_s} s must be 0 (never) or more")
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
                          started=started, whole_epoch_s=whole_epoch_s,
                          until=None if deadline_s is None else started + deadline_s,
                          compute_probes=compute_probes)
        return report
    finally:
        report.status = rec.status
        report.elapsed_s = time.perf_counter() - started
        setup.close()


def _predict_body(setup: TrainSetup, report: PredictReport, rec: Recording, *,
                  store: Store | None, progress: ProgressFn | None, share: int,
                  from_run: int | None, reference: list[dict[str, Any]] | None, method: str,
                  validate: int | None, validate_budget_s: float | None, started: float,
                  whole_epoch_s: float = WHOLE_EPOCH_S, until: float | None = None,
                  compute_probes: bool = True) -> None:
    """Profile (or read stored profiles), predict, validate, store: `run_train_predict`'s work.

    `until`: the `time.perf_counter()` by which the call is to end (`deadline_s`).
    """
    config, configs = setup.config, report.configs
    start_sampler(setup)
    t0 = time.perf_counter()
    tmpfs = {s: fs_type(path) == "tmpfs" for s, (path, _) in setup.datasets.items()}
    all_cores = len(os.sched_getaffinity(0))
    if from_run is not None:
        if store is None:
            raise UsageError("--from needs the results database: drop --no-store")
        passes = _stored_passes(store, from_run, configs)
        if not passes:
            raise UsageError(f"--from {from_run}: none of its configurations is in this grid; "
                             "give the same --batch/--workers/... as that run")
        report.profiled = sorted({p["config"] for p in passes if p["kind"] != "compute"})
    else:
        mode, pool, count, each, notes = _profile_plan(configs, setup.dataset_items,
                                                       config.profile_share, share)
        report.profile_mode = mode
        report.notes += notes
        plan = setup if each == config.profile_share else replace(
            setup, config=replace(config, profile_share=each))
        report.passes, report.profiled = _profile_within_share(
            plan, configs, pool, count, progress=progress, notes=report.notes)
        passes = [p.as_data() for p in report.passes if p.status == "ok"]
        if whole_epoch_s > 0:
            passes = _whole_epochs(setup, report, passes, whole_epoch_s, progress, until)
        if compute_probes:
            _compute_probes(setup, report, passes, progress)
        report.short_epochs = short_epoch_line(configs, setup.dataset_items,
                                               config.profile_share)
        if report.short_epochs:
            # Said once for the run, not as each short profile's advice.
            report.notes.insert(0, report.short_epochs)
            for p in report.passes:
                p.flags = [f.removesuffix(SHORT_PROFILE_ADVICE) for f in p.flags]
    probes = [p.as_data() for p in report.passes if p.kind == "compute" and p.status == "ok"]
    probes += [p for p in passes if p["kind"] == "compute"]  # a stored run's (`from_run`)
    passes = [p for p in passes if p["kind"] != "compute"]
    report.profile_s = time.perf_counter() - t0
    if progress is not None:
        progress("fitting the predictor", 0.5)
    report.predictions, report.info = predict_all(
        configs, passes, items=setup.dataset_items, all_cores=all_cores,
        tmpfs=tmpfs, method=method, reference=reference, probes=probes)
    if setup.settled:
        report.info["settle"] = dict(setup.settled)
    _say_whether_within_rule(report, config.profile_share)
    t1 = time.perf_counter()
    if until is not None:
        left = max(0.0, until - t1)
        validate_budget_s = left if validate_budget_s is None else min(validate_budget_s, left)
    if validate != 0:
        _validate(setup, report, validate, validate_budget_s, progress=progress,
                  probes=from_run is None)
    report.validate_s = time.perf_counter() - t1
    if report.validation:
        report.attribution = attribute(report, all_cores)
    if store is not None and setup.run_id is not None:
        records.add_predictions(store, setup.run_id,
                                [r for p in report.predictions for r in p.rows()])
    rec.summary = {
        "configs": len(configs), "profiled": len(report.profiled),
        "model": report.info.get("chosen"), "scores": report.scores(),
        "budget": {k: v for k, v in report.budget(config.profile_share).items()
                   if k != "per_config"}, "drift": report.drift,
        "profile_mode": report.profile_mode,
        "machine_speed": {"readings": report.machine_speed,
                          "drift": speed_drift(report.machine_speed)},
        "missed": {e: report.attribution[e]["verdict"] for e in ("first", "later")
                   if e in report.attribution},
        "elapsed_s": time.perf_counter() - started}


def _compute_probes(setup: TrainSetup, report: PredictReport, passes: list[dict[str, Any]],
                    progress: ProgressFn | None) -> None:
    """A compute probe (`profile.measure_compute`) of each batch size no profile reached.

    Per (cores, precision), every batch size of the grid without a profiled or whole pass gets
    `profile.COMPUTE_PROBE_STEPS` minibatches without loader workers (kind `compute`, in
    `report.passes`): the compute term at that batch is measured instead of drawn from a line
    through the other batch sizes (on a GPU, a line from batch 32 predicted batch 128's
    minibatch far too long). They count in the profile budget (`PredictReport.budget`).
    Where a counter measures power, each also reads its batch's power
    (`profile.PROBE_POWER_S`), in minibatches out of what the rule's cost leaves after the
    profiles (`_power_room`), so the rule held without them still holds with them.
    """
    configs = report.configs
    reached = {(tuple(p["knobs"]["cores"] or ()), p["knobs"]["precision"], p["knobs"]["batch"])
               for p in passes if p.get("status", "ok") == "ok"}
    done: set[tuple[Any, ...]] = set()
    measured, skipped = [], []
    # A power counter measured the profiles (NVML, RAPL): the probes read it too.
    counter = any(p.get("energy_j") and not str(p.get("energy_source", "none")).startswith(
        ("modelled", "none")) for p in passes)
    cells = {(tuple(k.cores or ()), k.precision, k.batch) for k in configs} - reached
    # The power reads come out of what the rule's cost in all leaves after the profiles
    # (`power_room`), shared among the probes still to run and counted in time: a probe's
    # minibatch is no longer than an epoch's at its batch, so its time in its own minibatches
    # over the epoch's count is at least its share of the epoch. A fifth of it is kept as a
    # margin: the budget counts each profile over its epoch as finally predicted, which the
    # probes themselves move (a GPU run's total came to 1.03 of the rule's without it).
    room = PROBE_ROOM_USED * _power_room(setup, report, passes) if counter else 0.0
    left = len(cells)
    for i, knobs in enumerate(configs):
        key = (tuple(knobs.cores or ()), knobs.precision, knobs.batch)
        if key in reached or key in done:
            continue
        done.add(key)
        # At most the profile share of the epoch's minibatches: a batch size with a handful of
        # minibatches an epoch (a probe of three was half of a 400-image epoch on the CPU)
        # stays extrapolated, or is measured whole.
        per_epoch = math.ceil(setup.dataset_items / knobs.batch)
        most = math.floor(setup.config.profile_share * per_epoch)
        steps = min(COMPUTE_PROBE_STEPS, most)
        mine = room / max(1, left)
        left -= 1
        most = max(steps, min(most, math.floor(mine * per_epoch)))
        if steps < 1:
            skipped.append(f"b{knobs.batch} {knobs.precision}")
            continue
        if progress is not None:
            progress(f"compute probe b{knobs.batch} {knobs.precision}", 0.5)
        # Where a counter measures power, the probe reads it at its batch over up to
        # `PROBE_POWER_S`, within its share of the epoch's minibatches counted in time (its
        # start and first batch's loading included).
        rec = measure_compute(setup, knobs, i, steps, power_s=PROBE_POWER_S if counter else 0.0,
                              max_steps=most, max_steps_time=mine * per_epoch if counter else None)
        if counter and rec.result is not None and len(rec.result.steps) > 1:
            # What it cost, not what it was given, in its own minibatches (each no longer than
            # an epoch's at its batch): a probe over its share leaves the others less.
            step_s = sum(s.wall_ns for s in rec.result.steps[1:]) / 1e9 / (
                len(rec.result.steps) - 1)
            if step_s > 0:
                room = max(0.0, room - rec.result.wall_ns / 1e9 / step_s / per_epoch)
        report.passes.append(rec)
        if rec.status == "ok" and rec.result is not None:
            power = rec.extra.get("power_w")
            measured.append(f"b{knobs.batch} {knobs.precision} "
                            f"({rec.result.wall_ns / 1e9:.2f} s"
                            + (f", {power:.0f} W over {rec.extra['power_s']:.2f} s"
                               if power and counter else "") + ")")
    if measured:
        report.notes.append(
            f"compute probes ({COMPUTE_PROBE_STEPS} minibatches each"
            + (f", and more for a power read of up to {PROBE_POWER_S:g} s within the share of "
               "the epoch" if counter else "")
            + f"; no loader workers) of the batch sizes no profile reached: "
            f"{', '.join(measured)}")
    if skipped:
        report.notes.append(
            f"no compute probe of {', '.join(skipped)}: one minibatch is over "
            f"{setup.config.profile_share:.0%} of such an epoch (more data, or whole epochs, "
            "would measure it)")


def _power_room(setup: TrainSetup, report: PredictReport, passes: list[dict[str, Any]]
                ) -> float:
    """Epochs the rule's cost in all leaves after the profiles (≥ 0), for the probes' power.

    The rule's cost is a third of the grid at the profile share each; each profile's (and
    whole epoch's) wall time counts over its configuration's shorter epoch as the simple model
    predicts it from the profiles so far (as `PredictReport.budget` counts it from the final
    predictions).
    """
    share = setup.config.profile_share
    allowed = share * math.ceil(len(report.configs) / 3)
    comps = _components([p for p in passes if p.get("kind") != "compute"])
    if comps is None:
        return allowed
    spent = 0.0
    for i in report.profiled:
        wall = sum(p.get("wall_ns", 0) for p in passes if p.get("config") == i
                   and p.get("kind") in ("profile", "whole")) / 1e9
        epoch = min(comps.predict(report.configs[i], n, setup.dataset_items)["epoch_s"]
                    for n in ("cold", "warm"))
        spent += wall / epoch if epoch > 0 else share
    return max(0.0, allowed - spent)


def _whole_epochs(setup: TrainSetup, report: PredictReport, passes: list[dict[str, Any]],
                  whole_epoch_s: float, progress: ProgressFn | None,
                  until: float | None = None) -> list[dict[str, Any]]:
    """Whole epochs of one configuration of each cell no profile reached, where they are short.

    A cell whose configurations' epochs are too short for a profile within the rule (a ramp and
    three steady minibatches a half in the share) is otherwise predicted from other cells; where
    its epoch is predicted (from the profiles so far) to take at most `whole_epoch_s`, its first
    and later epoch are measured whole (kind `whole`, fitted on as profiles are) instead. The
    rule does not hold for them, and the budget check says so. Before `until` (a
    `time.perf_counter()`), only epochs predicted to end by then.
    """
    configs = report.configs
    comps = _components(passes)
    if comps is None:
        return passes
    measured: list[str] = []
    for i, knobs in enumerate(configs):
        profiled = [configs[j] for j in report.profiled]
        if i in report.profiled or covered(knobs, profiled):
            continue
        # Only cells the rule cannot reach: one left out for the count alone is predicted.
        if any(profile_fits(k, setup.dataset_items, setup.config.profile_share,
                            THIN_STEADY_STEPS)
               for k in configs if model_cell(k) == model_cell(knobs)):
            continue
        epoch_s = max(comps.predict(knobs, p, setup.dataset_items)["epoch_s"]
                      for p in ("cold", "warm"))
        if epoch_s > whole_epoch_s:
            continue
        if until is not None and time.perf_counter() + 2 * epoch_s > until:
            report.notes.append(f"no whole epochs of {knobs.label}: they would not end "
                                "within the deadline")
            continue
        recs, _ = measure_configs(setup, [knobs], kind="whole", indices=[i],
                                  progress=(lambda label, _: progress(label, 0.5))
                                  if progress is not None else None)
        report.passes += recs
        if all(r.status == "ok" for r in recs):
            report.profiled = sorted([*report.profiled, i])
            passes += [r.as_data() for r in recs]
            measured.append(f"{knobs.label} (~{epoch_s:.1f} s an epoch)")
    if measured:
        report.profile_mode += "+whole"
        report.notes.append(
            "whole epochs measured instead of profiles, beyond the rule (their cells have too "
            f"few minibatches for a profile within it, and an epoch costs under "
            f"{whole_epoch_s:.0f} s): {', '.join(measured)}")
    return passes


def _say_whether_within_rule(report: PredictReport, share: float) -> None:
    """A plain verdict: were the predictions made within the rule, and which were not."""
    extra = report.info.get("extrapolation") or {}
    outside = extra.get("configurations") or []
    budget = report.budget(share)
    held = budget["ok"]
    if outside:
        report.info["verdict"] = (
            f"no prediction within the rule for {len(outside)} of {len(report.configs)} "
            f"configurations: no profile reached their model cell (their epochs are too short "
            f"for a profile of ≤ {share:.0%} of them, or the profiles ran out), so they are "
            f"extrapolated from other cells, with a ±{extra['bound_pct']:.0f}% bound "
            f"({extra['source']}): {', '.join(outside)}"
            + ("" if held or budget["ok_in_total"] else
               f"; and the profiles themselves went beyond it (largest "
               f"{100 * (budget['max_share'] or 0):.0f}% of its epoch)")
            + ". For predictions within it, use more data (--images), a larger "
            "--profile-share, or --whole-epochs-below to measure their short epochs")
    elif not held and budget["ok_in_total"]:
        report.info["verdict"] = (
            f"every prediction within the rule's cost ({budget['rule']}: "
            f"{budget['total_epochs_allowed']:.2f} epochs in all), spread over "
            f"{budget['profiled']} thinner profiles instead of {budget['profiled_allowed']} "
            f"({budget['total_epochs']:.2f} epochs, largest "
            f"{100 * (budget['max_share'] or 0):.1f}% of its epoch)")
    elif not held:
        report.info["verdict"] = (
            f"predictions made beyond the rule ({budget['rule']}): profiled "
            f"{budget['profiled']} of {budget['configurations']} configurations, largest "
            f"profile {100 * (budget['max_share'] or 0):.0f}% of its epoch "
            f"({report.profile_mode} plan)")
    else:
        report.info["verdict"] = f"every prediction within the rule ({budget['rule']})"
    report.info["within_rule"] = held and not outside
    # The thin plan profiles more configurations than a third for the rule's cost.
    report.info["within_rule_cost"] = bool(budget["ok_in_total"]) and not outside


def _reference_config(report: PredictReport) -> int | None:
    """The profiled configuration re-measured for drift: the first with both passes profiled."""
    for i in report.profiled:
        ok = [p for p in report.passes if p.config == i and p.kind == "profile"
              and p.status == "ok" and p.result]
        if len(ok) == 2:
            return i
    return None


def drift_basis(report: PredictReport, i: int, ref: int | None) -> dict[str, Any] | None:
    """What the drift beside validated configuration `i` is measured on (None: nothing).

    Its own figure where it has one: the compute probe of its (cores, precision, batch)
    (`kind` `compute`: re-measured as a compute probe of the same minibatches, compared on the
    compute beside the fetch), else a profiled configuration of its (cores, precision, batch),
    the nearest in workers (`profile`: re-profiled, compared on the steady minibatch); only
    where it has neither, the run's reference configuration `ref` (`reference`). A GPU's
    batch-32 step (launch and host bound) and its batch-128 one (compute bound) do not move
    together, so the batch of the validated epochs is what is re-measured.
    """
    k = report.configs[i]
    key = (k.cores, k.precision, k.batch)
    probes = [p for p in report.passes if p.kind == "compute" and p.status == "ok"
              and p.result is not None
              and (p.knobs.cores, p.knobs.precision, p.knobs.batch) == key]
    if probes:
        # Measured as the probe was (its configuration's index seeds the same batch of files).
        return {"kind": "compute", "config": probes[0].config, "label": f"compute probe b{k.batch} "
                f"{k.precision}", "key": ("compute", key),
                "before": [probes[0].as_data()],
                "steps": len(probes[0].as_data()["steps"])}
    same = []
    for j in report.profiled:
        recs = [p for p in report.passes if p.config == j and p.kind == "profile"
                and p.status == "ok" and p.result is not None]
        c = report.configs[j]
        if len(recs) == 2 and (c.cores, c.precision, c.batch) == key:
            same.append((abs(c.workers - k.workers), (c.workers > 0) != (k.workers > 0), j,
                         recs))
    if same:
        *_, j, recs = min(same, key=lambda t: (t[1], t[0], t[2]))
        return {"kind": "profile", "config": j, "label": f"profile of "
                f"{report.configs[j].label} (its batch)", "key": ("profile", j),
                "before": [r.as_data() for r in recs]}
    if ref is None:
        return None
    return {"kind": "reference", "config": ref, "label": f"reference "
            f"{report.configs[ref].label} (no figure at its batch)", "key": ("profile", ref),
            "before": [p.as_data() for p in report.passes if p.config == ref
                       and p.kind == "profile" and p.status == "ok"]}


def _validate(setup: TrainSetup, report: PredictReport, validate: int | None,
              budget_s: float | None, *, progress: ProgressFn | None, probes: bool) -> None:
    """Train held-out configurations for two epochs each, a drift probe before and after each.

    The configurations come in `validation_order` (seeded, stratified over the model cells; no
    prediction looked at), `validate` of them (None: all), and with `budget_s` as many as fit
    at the mean cost so far: the next one starts only where it would end within the budget, and
    none is skipped for a later, cheaper one. With `probes`, what each was predicted from at
    its own batch (`drift_basis`: its batch's compute probe, else a profile of its batch, else
    the reference configuration) is measured again before its epochs and after them (kind
    `drift:N` or `probe:N`, never fitted on; a probe after one configuration serves the next
    where both have the same basis): the machine's speed at that batch beside the epochs, over
    its speed at profile time, is the epochs' `drift` (the geometric mean of the two), and
    `drift_probe` names the probe. A configuration's cost, before it starts, is its two
    predicted epochs scaled by what the configurations validated so far cost over theirs (at
    first, plus its probes at their profile-time cost): with a budget, the first one too must
    fit, with its probes, or nothing is measured.
    """
    configs = report.configs
    report.validation_seed = setup.config.seed
    order = validation_order(configs, report.profiled, setup.config.seed)
    report.held_out = len(order)
    count = len(order) if validate is None else min(validate, len(order))
    order = order[:count]
    ref = _reference_config(report) if probes else None
    bases = {i: drift_basis(report, i, ref) if probes else None for i in order}
    series: list[dict[str, Any]] = []
    last: tuple[Any, int] | None = None  # (basis key, index in series) of the last probe

    def probe(i: int, n: int, when: str) -> int | None:
        """Measure validated configuration `i`'s basis again; its index in `series`."""
        nonlocal last
        basis = bases.get(i)
        if basis is None:
            last = None  # epochs without a probe come between: none is shared across them
            return None
        if when == "before" and last is not None and last[0] == basis["key"]:
            series[last[1]]["for"].append(configs[i].label)
            return last[1]
        j = basis["config"]
        measure = "compute" if basis["kind"] == "compute" else "wall"
        # Stored with the probe: which validated configuration it was taken beside, and what
        # it re-measures (`_stored_drift` reads a stored run's drift from them).
        extra = {"drift_for": configs[i].label, "drift_of": basis["label"],
                 "drift_basis": basis["kind"], "drift_measure": measure, "drift_round": when}
        if basis["kind"] == "compute":
            recs = [measure_compute(setup, configs[j], j, basis["steps"], kind=f"drift:{n}",
                                    extra=extra)]
        else:
            # The profile's own minibatches again (a thin or shortened profile had fewer than
            # the run's share gives): its cold and warm halves come out as they were.
            steps = sum(len(b.get("steps") or []) for b in basis["before"])
            again = replace(setup, config=replace(setup.config, profile_steps=steps,
                                                  profile_share=1.0))
            recs, _ = measure_configs(again, [configs[j]], kind=f"probe:{n}", indices=[j],
                                      extra=extra)
        report.drift_passes += recs
        after = [r.as_data() for r in recs if r.status == "ok" and r.result]
        got = (drift_of(basis["label"], basis["before"], after, measure)
               if len(after) == len(basis["before"]) else None)
        series.append({"basis": basis, "drift": got, "for": [configs[i].label], "when": when})
        last = (basis["key"], len(series) - 1)
        return last[1]

    started = time.perf_counter()
    costs: list[float] = []
    predicted: list[float] = []
    done: list[int] = []
    around: dict[int, list[int]] = {}

    def probe_s(i: int) -> float:
        """A probe of `i`'s basis costs about what its figure did at profile time."""
        basis = bases.get(i)
        return sum(p.get("wall_ns", 0) for p in basis["before"]) / 1e9 if basis else 0.0

    def expected_s(i: int) -> float:
        """What validating configuration `i` is expected to cost, its probes included."""
        own = sum(e["predicted_s"] or 0.0 for e in report.predictions[i].epochs.values())
        if costs and sum(predicted) > 0:
            return own * sum(costs) / sum(predicted)
        return own + 2 * probe_s(i)

    if budget_s is not None and order and expected_s(order[0]) > budget_s:
        order = []  # not even the first fits: no probe for it either
    unit = setup.config.unit
    if order:  # the machine's own speed before the first validated epoch, then after each
        report.machine_speed.append(read_speed(unit, "the profiles"))
    for n, i in enumerate(order):
        spent = time.perf_counter() - started
        if budget_s is not None and spent + expected_s(i) > budget_s:
            break
        t = time.perf_counter()
        if progress is not None:
            progress(f"epoch {configs[i].label}", 0.5 + 0.5 * n / max(1, count))
        before = probe(i, 2 * n, "before")
        recs, _ = measure_configs(setup, [configs[i]], kind="epoch", indices=[i])
        report.validation += recs
        after = probe(i, 2 * n + 1, "after")
        report.machine_speed.append(read_speed(unit, configs[i].label))
        around[i] = [x for x in (before, after) if x is not None]
        costs.append(time.perf_counter() - t)
        predicted.append(sum(e["predicted_s"] or 0.0
                             for e in report.predictions[i].epochs.values()))
        done.append(i)
        for r in recs:
            if r.status == "ok" and r.result is not None:
                report.predictions[i].measured[
                    "first" if r.pass_name == "cold" else "later"] = {
                    "s": r.result.wall_ns / 1e9, "energy_j": r.energy_j}
    if len(done) < report.held_out:
        report.notes.append(
            f"validated {len(done)} of {report.held_out} held-out configuration(s), drawn at "
            f"random (seed {setup.config.seed}) one model cell at a time"
            + (f", as many as fit in the {budget_s:.0f} s validation budget"
               if budget_s is not None and len(done) < count else ""))
    if not series:
        return
    # On a GPU a compute probe's drift is the device's: it moves an epoch through its compute
    # term only (`drift.compute_drift_scale`). A CPU's compute probe times the same cores its
    # loader and training process use, so there the whole epoch moves with it.
    comps = None
    if setup.config.unit.startswith("cuda"):
        ok = [r.as_data() for r in report.passes if r.status == "ok" and r.result is not None]
        comps = _components([d for d in ok if d["kind"] in ("profile", "whole")],
                            [d for d in ok if d["kind"] == "compute"])
    for i in done:
        got = epoch_drift([series[x]["drift"] for x in around.get(i, []) if series[x]["drift"]])
        if got is None:
            continue
        basis = bases[i]
        for fig in report.predictions[i].measured.values():
            fig.update(got, drift_probe=basis["label"] if basis else None)
        if setup.config.unit.startswith("cuda") and basis:
            _gpu_drift(comps, configs, i, report.predictions[i].measured, setup.dataset_items,
                       basis["kind"], basis["config"])
    report.drift = _drift_summary(
        _basis_label([bases[i] for i in done]), [g["drift"] for g in series],
        [report.predictions[i].measured for i in done])
    report.drift["by_config"] = [
        {"label": configs[i].label, "probe": (bases[i] or {}).get("label"),
         "basis": (bases[i] or {}).get("kind"),
         "probes": [series[x]["drift"]["ratio"] if series[x]["drift"] else None
                    for x in around.get(i, [])],
         **{k: report.predictions[i].measured.get("later", {}).get(k)
            for k in ("drift", "drift_se", "drift_resolved")}} for i in done]
    kinds = [(bases[i] or {}).get("kind") for i in done]
    report.drift["bases"] = {k: kinds.count(k) for k in ("compute", "profile", "reference")
                             if k in kinds}
    resolved = report.drift["resolved_range"]
    if resolved and max(abs(r - 1) for r in resolved) > DRIFT_NOTE:
        report.notes.append(
            f"the machine drifted: the drift probes beside the validation ({report.drift['label']})"
            f" ran {min(resolved):.2f}–{max(resolved):.2f}× as long per minibatch as at profile "
            "time, beyond their own noise; the time scores are given as measured and corrected "
            "for it")
    elif report.drift["range"] and max(abs(r - 1) for r in report.drift["range"]) > DRIFT_NOTE:
        report.notes.append(
            f"the drift probes beside the validation ({report.drift['label']}) read "
            f"{report.drift['range'][0]:.2f}–{report.drift['range'][1]:.2f}× their profile-time "
            "figure per minibatch, within the noise of their few minibatches"
            + (f" (±{100 * DRIFT_Z * report.drift['noise_se_log']:.0f}%)"
               if report.drift["noise_se_log"] is not None else " (not measurable)")
            + ": not corrected for")


def _basis_label(bases: list[dict[str, Any] | None]) -> str:
    """The drift probes of a run in a few words: one basis, or how many of each kind."""
    labels = list(dict.fromkeys(b["label"] for b in bases if b))
    if len(labels) == 1:
        return labels[0]
    kinds = [b["kind"] for b in bases if b]
    words = {"compute": "compute probe of its batch", "profile": "profile of its batch",
             "reference": "the reference (no figure at its batch)"}
    return "each validated configuration's own batch: " + ", ".join(
        f"{kinds.count(k)} × {w}" for k, w in words.items() if k in kinds)


#: A drift of more than this, resolved from its noise (`drift.epoch_drift`), is reported: the
#: machine itself changed speed, and the measured epochs carry that.
DRIFT_NOTE = 0.1


def _drift_summary(label: str, series: list[dict[str, Any] | None],
                   measured: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The run's drift: each probe's ratio and noise, and the ranges of both.

    The ranges: of the probes' ratios, and of the drifts applied to validated epochs (resolved
    from their noise, else 1); `noise_se_log`, the probes' median standard error (log).
    """
    good = [g for g in series if g and g.get("ratio")]
    noise = [g["se_log"] for g in good if g.get("se_log") is not None]
    epochs = [m for ms in measured for m in ms.values() if m.get("drift")]
    applied = [applied_drift(m) or 1.0 for m in epochs]
    resolved = [m["drift"] for m in epochs if m.get("drift_resolved")]
    first = good[0] if good else None
    return {
        "label": label, "before_ms": first["before_ms"] if first else None,
        "probes": [g["ratio"] if g else None for g in series],
        "probes_se_log": [g["se_log"] if g else None for g in series],
        "probe_steady_minibatches": first["after_steps"] if first else None,
        "profile_steady_minibatches": first["before_steps"] if first else None,
        "after_ms": good[-1]["after_ms"] if good else None,
        "ratio": good[-1]["ratio"] if good else None,
        "range": ([min(g["ratio"] for g in good), max(g["ratio"] for g in good)]
                  if good else None),
        "noise_se_log": statistics.median(noise) if noise else None,
        "applied_range": [min(applied), max(applied)] if applied else None,
        "resolved_range": [min(resolved), max(resolved)] if resolved else None,
        "resolved_epochs": len(resolved), "epochs": len(epochs),
        "corrected": "each validated epoch's prediction × its drift where the drift stands "
                     f"{DRIFT_Z:g} standard errors out of its noise (else × 1; on a GPU a "
                     "compute probe's drift through the epoch's compute term only), in the "
                     "scores' *_drift_corrected_pct (time only: energy is not corrected)"}


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
    information, the scores (as `PredictReport.scores`) and which term missed
    (`attribution.attribute_passes`).
    """
    run = store.run(run_id)
    config = run["config"]
    if "grid" not in config:
        raise UsageError(f"run {run_id} is not a training run (kind {run.get('kind')!r})")
    configs = _grid_configs(config["grid"])
    index = {k.label: i for i, k in enumerate(configs)}
    passes = records.load_passes(store, run_id)
    profile = [p for p in passes if p["kind"] in ("profile", "whole")
               and p.get("status", "ok") == "ok"]
    probes = [p for p in passes if p["kind"] == "compute" and p.get("status", "ok") == "ok"]
    epochs = [p for p in passes if p["kind"] == "epoch" and p.get("status", "ok") == "ok"]
    for p in profile + epochs:
        p["config"] = index[p["label"]]
    reference = _reference(store, reference_run) if reference_run is not None else None
    cpu = (run.get("environment") or {}).get("cpu") or {}
    all_cores = int(cpu.get("usable_cores") or cpu.get("logical_cores") or os.cpu_count() or 1)
    tmpfs = {s: s == "tmpfs" for s in config["grid"]["storage"]}
    predictions, info = predict_all(configs, profile, items=config["dataset_items"],
                                    all_cores=all_cores, tmpfs=tmpfs, method=method,
                                    reference=reference, probes=probes)
    drift = _stored_drift(passes, profile, epochs)
    for p in epochs:
        predictions[p["config"]].measured["first" if p["pass"] == "cold" else "later"] = {
            "s": p["wall_ns"] / 1e9, "energy_j": p.get("energy_j"),
            **((drift or {}).get("by_config", {}).get(p["config"]) or {})}
    if str(config.get("unit", "")).startswith("cuda") and drift:
        # As when the run was made: a compute probe's drift moves the compute term alone.
        comps = _components(profile, probes)
        for i, got in drift.get("by_config", {}).items():
            probe = str(got.get("drift_probe", ""))
            ref = _reference_of(probe, index)
            kind = ("compute" if probe.startswith("compute probe")
                    else "reference" if ref is not None else "")
            _gpu_drift(comps, configs, i, predictions[i].measured, config["dataset_items"],
                       kind, ref)
        applied = [applied_drift(m) or 1.0 for p in predictions for m in p.measured.values()
                   if m.get("drift")]
        if applied:
            drift["applied_range"] = [min(applied), max(applied)]
    report = PredictReport(run_id, config.get("model", {}), configs,
                           sorted({p["config"] for p in profile}), predictions, info, [], [],
                           config["dataset_items"],
                           held_out=len(configs) - len({p["config"] for p in profile}),
                           validation_seed=int(config.get("seed", 0) or 0))
    shares = {}
    for i in report.profiled:
        spent = sum(p["wall_ns"] for p in profile if p["config"] == i) / 1e9
        epoch = min(e["predicted_s"] or math.inf for e in predictions[i].epochs.values())
        shares[configs[i].label] = spent / epoch
    return {"run_id": run_id, "configs": [k.label for k in configs], "profile_shares": shares,
            "profiled": [configs[i].label for i in report.profiled], "model_info": info,
            "scores": report.scores(),
            "attribution": attribute_passes(profile + probes, epochs, predictions,
                                            config["dataset_items"], all_cores),
            "drift": {k: v for k, v in drift.items() if k != "by_config"} if drift else None,
            "predictions": [r for p in predictions for r in p.rows()]}


def _gpu_drift(comps: Components | None, configs: list[Knobs], i: int,
               measured: dict[str, dict[str, Any]], items: int, kind: str,
               basis_config: int | None) -> None:
    """On a GPU, what configuration `i`'s drift (read on a basis of `kind`) moves its epochs by.

    A compute probe's drift moves them through the compute term only (`_device_drift`); the
    reference's drift at another batch is reported, not applied (`_not_across_batches`); any
    other drift moves the whole epoch. For a run as it is made and a stored run read again.
    """
    if kind == "compute" and comps is not None:
        _device_drift(comps, configs[i], measured, items)
    elif (kind == "reference" and basis_config is not None
          and configs[basis_config].batch != configs[i].batch):
        _not_across_batches(measured)


def _reference_of(probe: str, index: dict[str, int]) -> int | None:
    """The configuration a stored drift probe's label names as the run's reference, if any.

    `drift_basis` labels it `reference LABEL (no figure at its batch)`; `index`: label → config.
    """
    if not probe.startswith("reference "):
        return None
    return index.get(probe.removeprefix("reference ").rsplit(" (", 1)[0])


def _not_across_batches(measured: dict[str, dict[str, Any]]) -> None:
    """A GPU configuration's drift read on the reference at another batch: not applied.

    It is reported, and its epochs get `drift_epoch` 1. A GPU's small-batch step (launch and
    host bound) and its large one (device bound) do not move together: on H200 hosts the
    batch-32 reference's drift did not describe batch-128 epochs (a correlation of -0.49 with
    their errors), and scaling them by it turned 4.5 / 3.9% into 17.1 / 27.5%
    (docs/architecture-train.md).
    """
    for fig in measured.values():
        if fig.get("drift"):
            fig["drift_epoch"] = 1.0


def _device_drift(comps: Components, knobs: Knobs, measured: dict[str, dict[str, Any]],
                  items: int) -> None:
    """A GPU configuration's drift from its compute probe: what it moves each epoch by.

    `measured`: the configuration's validated epochs (`first`, `later`), each with its `drift`;
    each gets `drift_epoch`, the factor its prediction moves by when the compute term alone
    moves by that drift (`drift.compute_drift_scale`).
    """
    for epoch, fig in measured.items():
        if fig.get("drift"):
            model = comps.predict(knobs, "cold" if epoch == "first" else "warm", items)
            fig["drift_epoch"] = compute_drift_scale(model, fig["drift"], knobs.workers)


def _stored_drift(passes: list[dict[str, Any]], profile: list[dict[str, Any]],
                  epochs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A stored run's drift: its probes against its reference's profile, per validated epoch.

    Probes `probe:N` were measured before the first validated configuration and after each
    (`_validate`); a run stored before them has one `probe`, after the validation, whose ratio
    is every epoch's.
    """
    probes = [p for p in passes if p["kind"].startswith(("probe", "drift"))
              and p.get("status", "ok") == "ok"]
    if not probes:
        return None
    if any(p.get("drift_for") for p in probes):
        return _stored_own_drift(passes, epochs)
    label = probes[0]["label"]
    before = [p for p in profile if p["label"] == label]
    rounds: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in probes:
        rounds[p["kind"]].append(p)
    keys = sorted(rounds, key=lambda k: int(k.split(":")[1]) if ":" in k else 10**9)
    series = [drift_of(label, before, rounds[key]) for key in keys]
    validated = list(dict.fromkeys(p["config"] for p in epochs))
    by_config: dict[int, dict[str, Any]] = {}
    for n, cfg in enumerate(validated):
        got = epoch_drift([g for g in (series[n:n + 2] if len(series) > 1 else series) if g])
        if got is not None:
            by_config[cfg] = got
    # Both epochs of a validated configuration take the probes around it.
    out = _drift_summary(label, series,
                         [{"first": v, "later": v} for v in by_config.values()])
    out["by_config"] = by_config
    return out


def _stored_own_drift(passes: list[dict[str, Any]], epochs: list[dict[str, Any]]
                      ) -> dict[str, Any]:
    """A stored run's drift where each validated configuration had its own probes.

    Each probe (kind `drift:N` or `probe:N`) names the configuration it was taken beside
    (`drift_for`), before or after its epochs, and what it re-measured (`drift_of`,
    `drift_measure`); a probe after one configuration that served the next as its probe before
    is the one just before that configuration's first epoch, of the same `drift_of`.
    """
    groups: dict[str, list[int]] = defaultdict(list)
    for n, p in enumerate(passes):
        if p["kind"].startswith(("probe", "drift")) and p.get("status", "ok") == "ok":
            groups[p["kind"]].append(n)
    first_epoch: dict[str, int] = {}
    for n, p in enumerate(passes):
        if p["kind"] == "epoch":
            first_epoch.setdefault(p["label"], n)

    def ratio(kind: str) -> dict[str, Any] | None:
        got = [passes[n] for n in groups[kind]]
        probe = got[0]
        base_kind = "compute" if probe.get("drift_measure") == "compute" else "profile"
        before = [p for p in passes if p["kind"] == base_kind and p["label"] == probe["label"]
                  and p.get("status", "ok") == "ok"]
        if len(before) != len(got):
            return None
        return drift_of(probe.get("drift_of") or probe["label"], before, got,
                        probe.get("drift_measure", "wall"))

    series = {kind: ratio(kind) for kind in groups}
    by_config: dict[int, dict[str, Any]] = {}
    rows = []
    for label, at in first_epoch.items():
        mine = [k for k, ns in groups.items() if passes[ns[0]].get("drift_for") == label]
        after = [k for k in mine if passes[groups[k][0]].get("drift_round") == "after"]
        before = [k for k in mine if passes[groups[k][0]].get("drift_round") == "before"]
        if not before and after:
            # Shared with the configuration before: the last probe ahead of its epochs.
            of = passes[groups[after[0]][0]].get("drift_of")
            ahead = [k for k, ns in groups.items()
                     if ns[-1] < at and passes[ns[0]].get("drift_of") == of]
            before = ahead[-1:]
        got = epoch_drift([g for g in (series.get(k) for k in before + after) if g])
        if got is None:
            continue
        config = next(p["config"] for p in epochs if p["label"] == label)
        of = passes[groups[(after or before)[0]][0]].get("drift_of")
        by_config[config] = got | {"drift_probe": of}
        rows.append({"label": label, "probe": of, **got})
    labels = list(dict.fromkeys(g["label"] for g in series.values() if g))
    out = _drift_summary(labels[0] if len(labels) == 1 else "; ".join(labels),
                         list(series.values()),
                         [{"first": v, "later": v} for v in by_config.values()])
    out["by_config"] = by_config
    out["per_config"] = rows
    return out

