"""Predicting a configuration's epoch time and energy from short profiles of a few configurations.

An epoch is modelled as **start-up + ramp + steady minibatches + tail**:

- start-up `S`: building the loader's iterator (starting its worker processes);
- ramp: the first `r` minibatches (r = loader workers, at least 1), whose first fetch is the time
  to the first minibatch `F` (one worker making a whole batch: B × the loader's time per item,
  plus the workers' own start) and whose others arrive from the workers' head start;
- steady: the other N − r minibatches at the steady minibatch time `T` (the mean of a profile's
  minibatches after the ramp; it holds the fetch/compute overlap the loader achieved), the last,
  partial one in proportion to its items;
- tail: the last fetch that finds the epoch over, and stopping the workers.

The first epoch reads data from its medium (a profile's **cold** part, after the data set's pages
were dropped from the page cache), later epochs from the page cache (its **warm** part).

Three layers, each used where the one before misses:

1. **Profile** (a configuration that was profiled): its own start-up, ramp, steady time and
   tail. A profile is one pass over a random subset twice over: the first half cold, the second
   (the same files again) warm, so the loader starts once and the later epoch's start-up is the
   first's less the files' read time. Energy = the part's mean power × the predicted time. Error
   bars: the steady time's 95% interval (from the spread of its minibatches, in blocks of `r` so
   the workers' rhythm is averaged) × the minibatches it multiplies, and the start-up's share.
2. **Simple** (any configuration, from components of the profiled ones): compute per minibatch
   C(B) = a + b·B per (cores, precision) (from passes without workers where workers would
   share the cores), the training's CPU seconds κ(B) likewise (fitted with a CPU cost per
   worker started, which no steady minibatch has); the loader's CPU time ℓ, wall time λ and
   read time ρ per item per (storage, part, with or without workers), from the steady
   minibatches; the main process's cost of receiving a batch from a worker q per item. The
   steady minibatch is
   - no workers: T = B·(ℓ + ρ) + C(B) (loading and training take turns);
   - w workers: T = max(C(B) + q·B, κ_L·B·(ℓ + ρ)/w, (κ(B) + B·ℓ)/n): the compute, the
     loader (w workers in parallel, each cycle κ_L times its items' decoding and reading:
     collating and handing the batch over; κ_L from the loader-bound profiles, or the
     reference network's) or the n cores (training and decoding share them), whichever is
     the bottleneck.
   Start-up and tail are lines in the workers (a + b·w: a process per worker to start and
   stop), the time to the first minibatch is B·λ + the workers' start (from the profiled
   configurations with the nearest workers), the rest of the ramp is in steady minibatches.
   Energy, where a counter measured it, is E = P0·t + N·(a_p + b_p·B): a static power over
   the wall time (the device waiting on start-up or its loader still draws it) and a dynamic
   energy per minibatch per precision, or per item (a_p = 0), whichever predicts the profiled
   passes better left one out (`components._fit_energy`); else
   power is a line in the busy share, or the mean power of the profiled passes most like the
   configuration. A profiled configuration whose steady part was served from the loader's
   queue (fewer than two rounds of w × prefetch batches) takes the loader's rate where it is
   slower (`_queue_correction`).
3. **Learned** (scikit-learn): the simple model's log error, learned across the profiled
   configurations from the knobs and the simple model's bottleneck ratios (a random forest or a
   ridge regression, whichever has the lower leave-one-out error), for time and for power. A
   model fitted on a reference network's profiles **transfers** to a new network: the new
   network's components feed the same features and its few profiles recalibrate the reference's
   correction (after PowerTrain, which transfers a reference workload's learned time and power
   model to a new one from a few dozen profiled modes); the recalibration's slope is held in
   [0, 1], so a reference's correction is shrunk, never amplified.

Which of simple and learned is used for the unprofiled configurations is decided by their
leave-one-configuration-out error over the profiled ones (the learned model must beat the simple
one by a fifth); bounds of those predictions are the 95% band of that error.

The layers live in their own modules: a pass's steady state and the profile estimate in
`steady`, the simple model in `components`, the learned one in `learned`, the choice of
configurations to profile in `covering`; this module predicts every configuration with them.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infermux.errors import UsageError
from infermux.train.components import Components, fit_components, fit_kappa, served_step
from infermux.train.covering import covered, model_cell
from infermux.train.knobs import Knobs
from infermux.train.learned import (
    LearnedModel,
    features,
    fit_learned,
    held_out_rows,
    recalibrate,
    training_rows,
)
from infermux.train.steady import (
    EPOCH_OF,
    PASSES,
    by_config,
    epoch_body,
    profile_estimate,
    steady,
    warmup_steps,
)

__all__ = ["Prediction", "mape", "predict_all"]


#: The learned model replaces the simple one only if its leave-one-out error is this much smaller.
LEARNED_MARGIN = 0.8
#: ... and (with `auto`) only from this many profiled configurations: a correction of a dozen
#: features learned from fewer won its leave-one-out comparison by chance on the stored runs.
LEARNED_MIN_CONFIGS = 10
#: ... and a reference network's correction (transfer) only where the new network has this many
#: profiled configurations: over two or three, its leave-one-out comparison with the simple
#: model rests on two or three held-out rows. On three fresh runs of four unseen networks (an
#: H200, an H100, the 2-core CPU) the transfer was kept four times, each with two or three
#: profiled configurations; replayed, the two it moves (a ViT on each GPU) came out better with
#: the simple model (time MAPE 6.5 / 5.5% → 1.9 / 5.3%, 18.7 / 26.0% → 9.4 / 16.0%;
#: docs/architecture-train.md).
TRANSFER_MIN_CONFIGS = 4


@dataclass
class Prediction:
    """One configuration's predicted first and later epoch, and what was measured."""

    config: int
    knobs: Knobs
    profiled: bool
    method: str
    epochs: dict[str, dict[str, float | None]]  # first/later → predicted_s, low_s, high_s, ...
    measured: dict[str, dict[str, float | None]] = field(default_factory=dict)
    #: Predicted from profiles of other model cells (`covered`), with the wider bound.
    extrapolated: bool = False
    #: Where the energy prediction's power came from (`Components.energy_at`): a compute
    #: probe at its batch, the energy line (at its batch or extrapolated), a profile's power.
    power_source: str | None = None

    def rows(self) -> list[dict[str, Any]]:
        """One row per epoch kind, for the store and JSON."""
        out = []
        for epoch, fig in self.epochs.items():
            meas = self.measured.get(epoch, {})
            out.append({"config": self.config, "label": self.knobs.label, "epoch": epoch,
                        "method": self.method, "profiled": self.profiled,
                        "extrapolated": self.extrapolated, **fig,
                        "measured_s": meas.get("s"), "measured_energy_j": meas.get("energy_j"),
                        # The machine's speed when the epoch was measured over its speed
                        # when profiled (a reference re-measured beside it); None unmeasured.
                        "drift": meas.get("drift"),
                        # Its standard error (log) and whether it stood out of it (`drift`).
                        "drift_se": meas.get("drift_se"),
                        "drift_resolved": meas.get("drift_resolved"),
                        # Which probe measured that drift (`run._validate`).
                        "drift_probe": meas.get("drift_probe"),
                        "power_source": self.power_source,
                        "knobs": self.knobs.to_dict()})
        return out


def mape(pairs: list[tuple[float | None, float | None]]) -> float | None:
    """Mean absolute percentage error of (predicted, measured) pairs, %."""
    good = [(p, m) for p, m in pairs if p is not None and m]
    if not good:
        return None
    return 100.0 * statistics.fmean(abs(p - m) / m for p, m in good)


def _band(value: float | None, log_err: float) -> tuple[float | None, float | None]:
    if value is None:
        return None, None
    factor = math.exp(1.96 * log_err)
    return value / factor, value * factor


def predict_all(configs: list[Knobs], passes: list[dict[str, Any]], *, items: int,
                all_cores: int, tmpfs: dict[str, bool], method: str = "auto",
                reference: list[dict[str, Any]] | None = None,
                probes: list[dict[str, Any]] | None = None) -> tuple[list[Prediction],
                                                                      dict[str, Any]]:
    """Predict every configuration's epochs from the profiled passes; (predictions, model info).

    `method`: `auto` (learned where its leave-one-out error beats the simple model's), `simple`
    or `learned`. `reference`: passes of another network; the learned model is fitted on them
    and recalibrated on `passes` (transfer). `probes`: compute probes of batch sizes no
    profile reached (`fit_components`).
    """
    by = by_config(passes)
    probes = [p for p in probes or () if p.get("status", "ok") == "ok" and p.get("steps")]
    comps = fit_components(passes, all_cores, probes)
    info: dict[str, Any] = {"profiled": sorted(by), "method": method}
    if reference and fit_kappa(passes, all_cores) is None:
        # No loader-bound profile of this network: the loader's cycle is the machine's and the
        # data set's, not the network's, so the reference network's passes give it.
        comps.kappa = fit_kappa(reference, all_cores) or 1.0
        info["kappa_from"] = "reference"
    info["kappa"] = comps.kappa
    if comps.energy is not None:
        info["energy_model"] = {k: v for k, v in comps.energy.items() if k != "dynamic_any"}
    # Leave-one-configuration-out error of the simple model (log scale).
    xs, yt, yp, groups = training_rows(passes, all_cores, tmpfs)
    profiled_configs = len(np.unique(groups))
    simple_loo = float(np.mean(np.abs(yt))) if len(yt) else math.inf
    info["simple_loo_mape_pct"] = 100 * (math.exp(simple_loo) - 1) if len(yt) else None
    learned: LearnedModel | None = None
    # Every leave-one-out error below leaves the configuration out of every fitted part: the
    # simple model's components, the correction's training rows, the transfer's line.
    without = held_out_rows(passes, all_cores, tmpfs)
    if method != "simple" and reference:
        ref_x, ryt, ryp, rgroups = training_rows(reference, all_cores, tmpfs)
        if len(ryt) >= 3:
            learned = fit_learned(ref_x, ryt, ryp, rgroups,
                                  held_out_rows(reference, all_cores, tmpfs))
            learned = recalibrate(learned, xs, yt, yp, groups, without)
            info["transfer"] = {"reference_rows": len(ryt), "kind": learned.kind,
                                **learned.recalibration}
    elif method != "simple" and profiled_configs >= (3 if method == "learned"
                                                     else LEARNED_MIN_CONFIGS):
        learned = fit_learned(xs, yt, yp, groups, without)
    if reference and learned is not None:
        # The transferred correction is kept only where it beats the simple model on the new
        # network's own profiles, each scored by a line fitted without it.
        transfer_err = learned.recalibration.get("error", math.inf)
        in_sample = learned.recalibration.get("in_sample_error", math.inf)
        info["transfer"]["error_pct"] = 100 * (math.exp(transfer_err) - 1) \
            if math.isfinite(transfer_err) else None
        info["transfer"]["in_sample_error_pct"] = 100 * (math.exp(in_sample) - 1) \
            if math.isfinite(in_sample) else None
        learned.loo_time = transfer_err
    too_few_to_compare = bool(reference) and profiled_configs < TRANSFER_MIN_CONFIGS
    use_learned = learned is not None and (
        method == "learned"
        or (learned.loo_time < LEARNED_MARGIN * simple_loo and not too_few_to_compare))
    if learned is not None and too_few_to_compare and method != "learned":
        info["transfer"]["not_used"] = (f"{profiled_configs} profiled configuration(s) to "
                                        f"compare on, fewer than the {TRANSFER_MIN_CONFIGS} a "
                                        "comparison needs")
    if learned is not None:
        info["learned"] = {"kind": learned.kind, "rows": learned.rows,
                           "loo_mape_pct": 100 * (math.exp(learned.loo_time) - 1)
                           if math.isfinite(learned.loo_time) else None}
    info["loo"] = "leave-one-configuration-out"
    err = learned.loo_time if use_learned and learned is not None else simple_loo
    err = err if math.isfinite(err) else 0.25
    info["chosen"] = ("transfer" if reference else "learned") if use_learned else "simple"
    profiled_knobs = [configs[i] for i in by if 0 <= i < len(configs)]
    cell_err, cells = _cell_out_error(passes, all_cores)
    # A configuration of a cell no profile reached is predicted from other cells' lines: its
    # bound is that error as measured (each profiled cell predicted from the others), and at
    # least twice the interpolating one, or assumed where fewer than two cells were profiled.
    err_x = max(EXTRAPOLATION_WIDEN * err, cell_err or 0.0, EXTRAPOLATION_MIN_ERR)
    probed = [Knobs.from_dict(p["knobs"]) for p in probes]
    extrapolated = [k.label for i, k in enumerate(configs)
                    if i not in by and not covered(k, profiled_knobs, probed)]
    if probes:
        info["compute_probes"] = sorted({f"b{k.batch} {k.precision}" for k in probed})
    info["extrapolation"] = {
        "configurations": extrapolated, "cells_profiled": cells,
        "cells": len({model_cell(k) for k in configs}),
        "bound_pct": 100 * (math.exp(1.96 * err_x) - 1),
        "source": (f"leave-one-cell-out over {cells} profiled cells" if cell_err is not None
                   else f"assumed ({cells} cell profiled: nothing to measure it on)")}
    predictions = []
    for i, knobs in enumerate(configs):
        own = by.get(i)
        estimate = profile_estimate(own) if own else None
        if estimate is not None:
            epochs = {e: {"predicted_s": estimate[f"{e}_s"], "low_s": estimate[f"{e}_low_s"],
                          "high_s": estimate[f"{e}_high_s"],
                          "predicted_energy_j": estimate.get(f"{e}_energy_j"),
                          "energy_low_j": estimate.get(f"{e}_energy_low_j"),
                          "energy_high_j": estimate.get(f"{e}_energy_high_j")}
                      for e in ("first", "later")}
            _queue_correction(epochs, own or [], comps, items)
            source = (f"its profile's mean power ({estimate.get('energy_source')})"
                      if estimate.get("first_energy_j") is not None else None)
            if comps.energy is not None:
                source = (f"energy line ({comps.energy['line']}) over every profiled pass, "
                          "its own among them")
                # Energy from the static + dynamic line fitted over every profiled pass: a
                # pass's own mean power over a second or less is mostly the counter's noise.
                steps = epoch_body(items, knobs.batch, 0)
                for fig in epochs.values():
                    t = fig["predicted_s"] or 0.0
                    energy = comps.energy_for(knobs, t, steps)
                    rel = math.hypot(((fig["high_s"] or t) - t) / t if t else 0.0,
                                     1.96 * comps.energy["log_error"])
                    fig.update(predicted_energy_j=energy,
                               energy_low_j=(energy or 0.0) * max(0.0, 1 - rel),
                               energy_high_j=(energy or 0.0) * (1 + rel))
            predictions.append(Prediction(i, knobs, True, "profile", epochs,
                                          power_source=source))
            continue
        epochs = {}
        outside = knobs.label in extrapolated
        sources = []
        for pass_name in PASSES:
            simple = comps.predict(knobs, pass_name, items)
            t, power = simple["epoch_s"], simple["power"]
            sources.append(simple["power_source"])
            if use_learned and learned is not None:
                lt, lp = learned.correction(features(knobs, pass_name, simple,
                                                      tmpfs.get(knobs.storage, False)))
                # The correction is learned on the steady minibatch: start-up is measured.
                t = simple["start_s"] + (t - simple["start_s"]) * math.exp(lt)
                power = power * math.exp(lp) if power is not None else None
            energy = power * t if power is not None else None
            e = err_x if outside else err
            low, high = _band(t, e)
            e_low, e_high = _band(energy, math.hypot(e, comps.energy["log_error"])
                                  if comps.energy is not None else e)
            epochs[EPOCH_OF[pass_name]] = {"predicted_s": t, "low_s": low, "high_s": high,
                                           "predicted_energy_j": energy, "energy_low_j": e_low,
                                           "energy_high_j": e_high}
        predictions.append(Prediction(i, knobs, False, info["chosen"], epochs,
                                      extrapolated=outside,
                                      power_source="; ".join(dict.fromkeys(sources))
                                      + (", × the learned correction" if use_learned else "")))
    # Per configuration, where its energy prediction's power came from.
    info["power_sources"] = {p.knobs.label: p.power_source for p in predictions}
    return predictions, info


#: An extrapolated prediction's bound is at least this many times the interpolating one's ...
EXTRAPOLATION_WIDEN = 2.0
#: ... and at least this log error (±25% before the 95% band's 1.96).
EXTRAPOLATION_MIN_ERR = math.log(1.25)


def _cell_out_error(passes: list[dict[str, Any]], all_cores: int) -> tuple[float | None, int]:
    """(error of a prediction outside every profiled cell, number of profiled cells).

    The error is the mean |log error| of each profiled cell's steady minibatch predicted by the
    simple model fitted without any configuration of that cell; None with fewer than two cells.
    """
    cells: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for data in passes:
        if data.get("status", "ok") == "ok":
            cells[model_cell(Knobs.from_dict(data["knobs"]))].append(data)
    if len(cells) < 2:
        return None, len(cells)
    errors = []
    for cell, own in cells.items():
        others = [p for c, ps in cells.items() if c != cell for p in ps]
        try:
            comps = fit_components(others, all_cores)
        except UsageError:
            continue
        for data in own:
            fig = steady(data)
            if fig is None:
                continue
            t = comps.figures(Knobs.from_dict(data["knobs"]), data["pass"])["T"]
            if t > 0:
                errors.append(abs(math.log(served_step(data, fig, comps.kappa) / t)))
    return (statistics.fmean(errors) if errors else None), len(cells)


def _queue_correction(epochs: dict[str, dict[str, float | None]], own: list[dict[str, Any]],
                      comps: Components, items: int) -> None:
    """A profile too short to reach its loader's steady rate: the loader's rate instead.

    The workers' queue holds `w × prefetch` batches made during the ramp; a profile whose
    steady part is shorter than two such rounds is served from it, faster than the loader
    makes batches. Where the loader's rate (κ·B·(ℓ + ρ)/w, the pass's own ℓ and ρ) is slower
    than the minibatches measured, the epoch's steady minibatches take the loader's rate.
    """
    for data in own:
        fig = steady(data)
        if fig is None:
            continue
        k = data["knobs"]
        w = k["workers"]
        loader = served_step(data, fig, comps.kappa)
        if loader <= fig["T"]:
            continue
        epoch = epochs[EPOCH_OF[data["pass"]]]
        extra = epoch_body(items, k["batch"], warmup_steps(w)) * (loader - fig["T"])
        for key in ("predicted_s", "low_s", "high_s"):
            if epoch[key] is not None:
                epoch[key] = (epoch[key] or 0.0) + extra
