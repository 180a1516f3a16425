"""What the training figures share: the table of predicted vs measured, the budget check, JSON.

Used by `bench/train_cpu.py` and `bench/train_gpu.py`; not a figure of its own.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

from infermux.train.knobs import Knobs
from infermux.train.predict import fit_components, steady
from infermux.train.run import PredictReport

#: A validated epoch whose prediction missed by more than this is broken down by `miss_terms`.
MISS = 0.10


def machine() -> dict[str, Any]:
    """The machine a figure was measured on, and how busy it was."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(), "loadavg": _loadavg(), "python": platform.python_version()}


def _loadavg() -> list[float] | None:
    try:
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def rows(report: PredictReport) -> list[dict[str, Any]]:
    """Every configuration's epochs: predicted (with bounds) vs measured, and the error."""
    out = []
    for row in report.to_dict()["predictions"]:
        measured, predicted = row["measured_s"], row["predicted_s"]
        energy_m, energy_p = row["measured_energy_j"], row["predicted_energy_j"]
        out.append({
            "label": row["label"], "epoch": row["epoch"], "method": row["method"],
            "profiled": row["profiled"], "predicted_s": predicted, "low_s": row["low_s"],
            "high_s": row["high_s"], "measured_s": measured,
            "error_pct": 100 * (predicted - measured) / measured if measured else None,
            "predicted_energy_j": energy_p, "measured_energy_j": energy_m,
            "energy_error_pct": (100 * (energy_p - energy_m) / energy_m
                                 if energy_m and energy_p is not None else None),
        })
    return out


def summary(report: PredictReport, started: float, args: dict[str, Any]) -> dict[str, Any]:
    """The figure as JSON: scores, the budget check, every row, the raw report."""
    data = report.to_dict()
    return {
        "args": args, "machine": machine(), "elapsed_s": time.time() - started,
        "scores": data["scores"], "budget": data["budget"], "model_info": data["model_info"],
        "profiled": data["profiled"], "profile_s": data["profile_s"],
        "validate_s": data["validate_s"], "drift": data["drift"], "notes": data["notes"],
        "profile_mode": data["profile_mode"], "verdict": data["model_info"].get("verdict"),
        "rows": rows(report),
        "misses": miss_terms(report, len(os.sched_getaffinity(0))),
        "report": data,
    }


def print_figure(name: str, fig: dict[str, Any]) -> None:
    """The rows, the MAPE and the budget verdict, for a terminal."""
    print(f"\n{name}: {'configuration':<34} {'epoch':<6} {'method':<8} {'predicted':>10} "
          f"{'measured':>9} {'error':>7}")
    for r in fig["rows"]:
        measured = f"{r['measured_s']:8.2f}s" if r["measured_s"] else "        -"
        error = f"{r['error_pct']:+6.1f}%" if r["error_pct"] is not None else "      -"
        print(f"{'':<{len(name) + 1}} {r['label']:<34} {r['epoch']:<6} {r['method']:<8} "
              f"{r['predicted_s']:9.2f}s {measured} {error}")
    s, b = fig["scores"], fig["budget"]

    def pct(v: float | None) -> str:
        return f"{v:.1f}%" if v is not None else "-"

    print(f"{name}: MAPE time first/later {pct(s['first_time_mape_pct'])} / "
          f"{pct(s['later_time_mape_pct'])}, energy first/later "
          f"{pct(s['first_energy_mape_pct'])} / {pct(s['later_energy_mape_pct'])} over "
          f"{s['configurations']} held-out configurations; within bounds "
          f"{s['first_within_bounds']} / {s['later_within_bounds']}")
    share = b["max_share"]
    print(f"{name}: budget ({b['rule']}): {b['profiled']} of {b['configurations']} profiled "
          f"(allowed {b['profiled_allowed']}), largest share of an epoch "
          f"{pct(100 * share if share is not None else None)}, profiles {b['profile_s']:.1f} s "
          f"in all: {'OK' if b['ok'] else 'EXCEEDED'}")
    d = fig.get("drift")
    if d and d.get("range"):
        print(f"{name}: drift: {d['label']} re-profiled beside the validation: "
              f"{d['range'][0]:.2f}-{d['range'][1]:.2f}x its profiled time per minibatch; "
              f"MAPE time corrected for it {pct(s.get('first_time_mape_drift_corrected_pct'))}"
              f" / {pct(s.get('later_time_mape_drift_corrected_pct'))}")
    print(f"{name}: validated {s['configurations']} of {s.get('held_out')} held-out "
          f"(random, per model cell); {s.get('extrapolated', 0)} of them extrapolated; plan "
          f"{fig.get('profile_mode')}")
    if fig.get("verdict"):
        print(f"{name}: {fig['verdict']}")
    for m in fig.get("misses", []):
        print(f"{name}:   missed {m['label']} {m['epoch']} {m['error_pct']:+.0f}%: "
              f"{m['term']} ({', '.join(f'{k} {v:+.2f}s' for k, v in m['parts_s'].items())})")
    for row in b["per_config"]:
        if row["flags"]:
            print(f"{name}:   {row['label']}: {row['flags'][0]}")


def miss_terms(report: PredictReport, all_cores: int) -> list[dict[str, Any]]:
    """Each validated epoch that missed by more than `MISS`: which term of the model missed.

    Measured, not guessed: the simple model (fitted on the run's profiles) gives the epoch's
    start-up (start-up, ramp, tail) and its steady minibatch, cut into compute and the wait
    for the loader; the validated epoch gives the same parts from its own minibatches. The
    term whose difference × minibatches is largest is named: `start-up`, `compute`, `loader`
    (the fetch stall), or `contention` where the model's bottleneck was the cores.
    """
    passes = [p.as_data() for p in report.passes if p.status == "ok" and p.kind != "epoch"
              and not p.kind.startswith("probe")]
    if not passes:
        return []
    comps = fit_components(passes, all_cores)
    out = []
    for rec in report.validation:
        if rec.status != "ok" or rec.result is None:
            continue
        pred = report.predictions[rec.config]
        epoch = "first" if rec.pass_name == "cold" else "later"
        predicted = pred.epochs[epoch]["predicted_s"]
        measured = rec.result.wall_ns / 1e9
        if not predicted or abs(predicted / measured - 1) <= MISS:
            continue
        data = rec.as_data()
        fig = steady(data)
        if fig is None:
            continue
        knobs = Knobs.from_dict(data["knobs"])
        model = comps.predict(knobs, rec.pass_name, report.dataset_items)
        body = fig["steady_steps"]
        measured_start = measured - body * fig["T"]
        predicted_compute = model["term_compute"]
        predicted_wait = max(0.0, model["T"] - predicted_compute)
        parts = {
            "start-up": measured_start - model["start_s"],
            "compute": body * (fig["compute"] - predicted_compute),
            "loader": body * (fig["fetch"] - predicted_wait),
        }
        named = max(parts, key=lambda k: abs(parts[k]))
        bottleneck = max(("compute", "loader", "cores"), key=lambda k: model[f"term_{k}"])
        if named != "start-up" and bottleneck == "cores":
            named = "contention"
        out.append({"label": rec.knobs.label, "epoch": epoch, "error_pct":
                    100 * (predicted / measured - 1), "predicted_s": predicted,
                    "measured_s": measured, "method": pred.method,
                    "extrapolated": pred.extrapolated, "term": named,
                    "model_bottleneck": bottleneck,
                    "parts_s": {k: round(v, 4) for k, v in parts.items()},
                    "drift": pred.measured.get(epoch, {}).get("drift")})
    return out
