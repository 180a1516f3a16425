"""Which term of the epoch model missed: start-up, compute, loader or contention, measured.

A validated epoch's error (measured − predicted seconds) is cut into the simple model's terms
(`components.Components`), each term's predicted value set against the same quantity read from
the validated epoch's own minibatches (`steady.steady`):

- `drift`: the machine's own change of speed beside the epoch (the reference configuration
  re-profiled around it, `run._validate`): predicted × (drift − 1). The other terms are then
  set against the prediction scaled by the drift.
- `start-up`: the epoch's time outside its steady minibatches (worker start, the loader's
  ramp, the tail): measured wall − steady minibatches × their mean, against the model's.
- `compute`: the steady minibatches' compute (host→device copy, forward, backward, step),
  measured minibatches × measured compute against predicted minibatches × the model's.
- `loader`: the rest of a steady minibatch (the wait for the loader, the hand-over), the same
  way.
- `correction`: what the method's prediction adds to the simple model's (a learned or
  transferred correction; 0 for the simple model itself).

They add up to the epoch's error. The steady terms are named `contention` instead where the
model's bottleneck for that configuration was its cores (the loader's workers and the training
sharing them): the minibatch was predicted from the cores' CPU time, not from the device or the
loader. Without workers the loader and the compute take turns, and are named apart. Over a
run's validated epochs, the term with the largest mean |part| / measured (the share of the
mean absolute error it can account for) is the one that missed.

Energy: a validated epoch's predicted over measured energy is its time's ratio × its mean
power's ratio; the larger of the two (in |log|) is named, `time` (then the time's term above)
or `power`.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

from infermux.errors import UsageError
from infermux.train.components import Components, fit_components
from infermux.train.drift import applied_drift
from infermux.train.knobs import Knobs
from infermux.train.predict import Prediction
from infermux.train.steady import steady

if TYPE_CHECKING:
    from infermux.train.run import PredictReport

__all__ = [
    "ENERGY_TARGET",
    "TERMS",
    "TIME_TARGET",
    "attribute",
    "attribute_passes",
    "epoch_parts",
    "verdict",
]

#: The issue's targets: a run whose MAPE is over them names the term that missed.
TIME_TARGET = 0.10
ENERGY_TARGET = 0.15
#: The parts an epoch's error is cut into, in the order they are reported.
TERMS = ("drift", "start-up", "compute", "loader", "contention", "correction")


def epoch_parts(comps: Components, data: dict[str, Any], predicted_s: float, items: int,
                drift: float | None = None) -> dict[str, Any] | None:
    """One validated epoch's error cut into the model's terms (module docstring), seconds.

    `data`: the epoch's pass (`PassRecord.as_data()`, with its minibatches); `predicted_s`:
    the method's prediction of it; `drift`: the machine's speed beside it over its speed when
    profiled (None: not measured, no drift part). None where the epoch has no steady
    minibatches to read.
    """
    fig = steady(data)
    if fig is None or not data.get("wall_ns"):
        return None
    knobs = Knobs.from_dict(data["knobs"])
    pass_name = data["pass"]
    model = comps.predict(knobs, pass_name, items)
    measured_s = data["wall_ns"] / 1e9
    scale = drift if drift and drift > 0 else 1.0
    # The model's steady minibatches: its epoch less its start-up, ramp and tail.
    body_p = (model["epoch_s"] - model["start_s"]) / model["T"] if model["T"] > 0 else 0.0
    body_m = fig["steady_steps"]
    compute_p = model["term_compute"]
    wait_p = max(0.0, model["T"] - compute_p)
    wait_m = fig["T"] - fig["compute"]
    simple_s = model["start_s"] + body_p * model["T"]
    parts = {
        "drift": predicted_s * (scale - 1.0),
        "start-up": (measured_s - body_m * fig["T"]) - scale * model["start_s"],
        "compute": body_m * fig["compute"] - scale * body_p * compute_p,
        "loader": body_m * wait_m - scale * body_p * wait_p,
        "correction": scale * (simple_s - predicted_s),
    }
    # Without workers the loader and the compute take turns in one process: nothing contends.
    bottleneck = (max(("compute", "loader", "cores"), key=lambda k: model[f"term_{k}"])
                  if knobs.workers > 0 else None)
    if bottleneck == "cores":
        parts["contention"] = parts.pop("compute") + parts.pop("loader")
    # The sign: positive where the epoch took longer than its term was predicted to.
    named = max(parts, key=lambda k: abs(parts[k]))
    return {
        "measured_s": measured_s, "predicted_s": predicted_s,
        "simple_predicted_s": simple_s, "error_pct": 100 * (predicted_s / measured_s - 1),
        "drift": drift, "model_bottleneck": bottleneck, "term": named,
        "parts_s": {k: round(parts[k], 6) for k in TERMS if k in parts},
        "measured": {"start_s": measured_s - body_m * fig["T"], "steady_minibatches": body_m,
                     "compute_s": fig["compute"], "wait_s": wait_m, "T_s": fig["T"]},
        "predicted": {"start_s": model["start_s"], "steady_minibatches": body_p,
                      "compute_s": compute_p, "wait_s": wait_p, "T_s": model["T"]},
    }


def attribute(report: PredictReport, all_cores: int) -> dict[str, Any]:
    """Every validated epoch's error by term, and for each epoch kind the term that missed.

    Returns `epochs` (one row per validated epoch: label, epoch, the parts, the term named;
    for energy the time and power ratios), and per `first`/`later`: the time MAPE, each term's
    mean |part| / measured and mean signed part / measured (%), the term named and whether
    the target (`TIME_TARGET`) was missed; the same for energy (`ENERGY_TARGET`) with
    `time`/`power`. Without validated epochs or profiles to fit on, `epochs` is empty.
    """
    return attribute_passes(
        [p.as_data() for p in report.passes if p.status == "ok"],
        [p.as_data() for p in report.validation if p.status == "ok" and p.result is not None],
        report.predictions, report.dataset_items, all_cores)


def attribute_passes(passes: list[dict[str, Any]], epochs: list[dict[str, Any]],
                     predictions: list[Prediction], items: int, all_cores: int
                     ) -> dict[str, Any]:
    """`attribute` from passes' data (`PassRecord.as_data`, or `records.load_passes`).

    `passes`: the run's profiles (kinds `profile` and `whole` are fitted on, `compute` probes
    too, others left);
    `epochs`: its validated epochs (kind `epoch`), each with its `config`, an index into
    `predictions` (whose `measured` holds the drift beside it).
    """
    out: dict[str, Any] = {"epochs": [], "time_target_pct": 100 * TIME_TARGET,
                           "energy_target_pct": 100 * ENERGY_TARGET}
    fitted = [p for p in passes if p.get("status", "ok") == "ok"
              and p["kind"] in ("profile", "whole")]
    probes = [p for p in passes if p.get("status", "ok") == "ok" and p["kind"] == "compute"]
    if not fitted:
        return out
    try:
        comps = fit_components(fitted, all_cores, probes)
    except UsageError:
        return out
    for data in epochs:
        if data["kind"] != "epoch" or data.get("status", "ok") != "ok":
            continue
        pred = predictions[data["config"]]
        epoch = "first" if data["pass"] == "cold" else "later"
        predicted = pred.epochs[epoch]["predicted_s"]
        if not predicted:
            continue
        row = epoch_parts(comps, data, predicted, items,
                          applied_drift(pred.measured.get(epoch, {})))
        if row is None:
            continue
        row = {"label": data["label"], "epoch": epoch, "method": pred.method,
               "extrapolated": pred.extrapolated, **row}
        energy_p, energy_m = pred.epochs[epoch].get("predicted_energy_j"), data.get("energy_j")
        if energy_p and energy_m:
            time_ratio = predicted / row["measured_s"]
            power_ratio = (energy_p / energy_m) / time_ratio
            row["energy"] = {
                "error_pct": 100 * (energy_p / energy_m - 1), "time_ratio": time_ratio,
                "power_ratio": power_ratio,
                "predicted_w": energy_p / predicted, "measured_w": energy_m / row["measured_s"],
                "term": "power" if abs(math.log(power_ratio)) > abs(math.log(time_ratio))
                else "time"}
        out["epochs"].append(row)
    for epoch in ("first", "later"):
        rows = [r for r in out["epochs"] if r["epoch"] == epoch]
        if rows:
            out[epoch] = _summary(rows)
    return out


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The epochs' time and energy MAPE, each term's share of it, the term that missed."""
    mape = statistics.fmean(abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows)
    terms = [k for k in TERMS if any(k in r["parts_s"] for r in rows)]
    share = {k: 100 * statistics.fmean(abs(r["parts_s"].get(k, 0.0)) / r["measured_s"]
                                       for r in rows) for k in terms}
    signed = {k: 100 * statistics.fmean(r["parts_s"].get(k, 0.0) / r["measured_s"]
                                        for r in rows) for k in terms}
    named = max(share, key=lambda k: share[k])
    out: dict[str, Any] = {
        "epochs": len(rows), "time_mape_pct": 100 * mape,
        "time_missed": mape > TIME_TARGET, "term": named,
        "terms_abs_pct": {k: round(v, 3) for k, v in share.items()},
        # Positive: the epochs took longer than this term was predicted to.
        "terms_signed_pct": {k: round(v, 3) for k, v in signed.items()}}
    energy = [r["energy"] for r in rows if "energy" in r]
    if energy:
        e_mape = statistics.fmean(abs(e["error_pct"]) for e in energy) / 100
        t_log = statistics.fmean(abs(math.log(e["time_ratio"])) for e in energy)
        p_log = statistics.fmean(abs(math.log(e["power_ratio"])) for e in energy)
        out.update({
            "energy_epochs": len(energy), "energy_mape_pct": 100 * e_mape,
            "energy_missed": e_mape > ENERGY_TARGET,
            "energy_term": "power" if p_log > t_log else "time",
            "energy_time_log_pct": round(100 * t_log, 3),
            "energy_power_log_pct": round(100 * p_log, 3),
            "power_signed_pct": round(100 * statistics.fmean(e["power_ratio"] - 1
                                                             for e in energy), 3)})
    out["verdict"] = verdict(out)
    return out


def verdict(summary: dict[str, Any]) -> str:
    """One line: which target was missed and which term missed it (or that none was)."""
    said = []
    if summary["time_missed"]:
        term = summary["term"]
        sign = summary["terms_signed_pct"][term]
        said.append(f"time MAPE {summary['time_mape_pct']:.1f}% > "
                    f"{100 * TIME_TARGET:.0f}%: the {term} term missed (by "
                    f"{summary['terms_abs_pct'][term]:.1f}% of the measured epoch on average, "
                    f"{'longer' if sign > 0 else 'shorter'} than predicted)")
    if summary.get("energy_missed"):
        term = summary["energy_term"]
        off = summary["power_signed_pct"]
        detail = (f"the power missed (predicted {abs(off):.1f}% "
                  f"{'above' if off > 0 else 'below'} the measured mean power)"
                  if term == "power" else f"the time missed (its {summary['term']} term)")
        said.append(f"energy MAPE {summary['energy_mape_pct']:.1f}% > "
                    f"{100 * ENERGY_TARGET:.0f}%: {detail}")
    return "; ".join(said) if said else "within the targets"
