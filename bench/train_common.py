"""What the training figures share: the table of predicted vs measured, the budget check, JSON.

Used by `bench/train_cpu.py` and `bench/train_gpu.py`; not a figure of its own.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

from infermux.train.attribution import attribute
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
        "compute_probes": data["budget"].get("compute_probes", []),
        "settle": data["model_info"].get("settle"),
        # Which probe measured each validated configuration's drift, and where each
        # configuration's energy prediction took its power from.
        "drift_by_config": (data["drift"] or {}).get("by_config", []),
        "power_sources": data["model_info"].get("power_sources", {}),
        "short_epochs": data["budget"].get("short_epochs"),
        "drift_probes_counted": data["budget"].get("drift_probes_counted"),
        # The machine's own speed by fixed reference work beside the validation.
        "machine_drift": data["machine_speed"]["drift"],
        "rows": rows(report),
        "misses": miss_terms(report, len(os.sched_getaffinity(0))),
        "missed": {e: data["attribution"][e] for e in ("first", "later")
                   if e in data["attribution"]},
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
    probes = fig.get("compute_probes") or []
    if probes:
        print(f"{name}: compute probes (counted in the budget): " + ", ".join(
            f"{p['label']} {p['probe_s']:.2f} s ({pct(100 * p['share'] if p['share'] else None)}"
            " of its epoch)" for p in probes))
    d = fig.get("drift")
    if d and d.get("range"):
        print(f"{name}: drift probes beside the validation ({d['label']}): "
              f"{d['range'][0]:.2f}-{d['range'][1]:.2f}x its profiled time per minibatch "
              f"(noise ±{200 * (d.get('noise_se_log') or 0):.0f}%; corrected in "
              f"{d.get('resolved_epochs', '?')} of {d.get('epochs', '?')} validated epochs, "
              "where out of it); "
              f"MAPE time corrected for it {pct(s.get('first_time_mape_drift_corrected_pct'))}"
              f" / {pct(s.get('later_time_mape_drift_corrected_pct'))}")
    print(f"{name}: validated {s['configurations']} of {s.get('held_out')} held-out "
          f"(random, per model cell); {s.get('extrapolated', 0)} of them extrapolated; plan "
          f"{fig.get('profile_mode')}")
    if fig.get("verdict"):
        print(f"{name}: {fig['verdict']}")
    for epoch, att in (fig.get("missed") or {}).items():
        print(f"{name}: {epoch} epochs: {att['verdict']} (terms, mean |part| of the measured "
              f"epoch: {', '.join(f'{k} {v:.1f}%' for k, v in att['terms_abs_pct'].items())})")
    for m in fig.get("misses", []):
        print(f"{name}:   missed {m['label']} {m['epoch']} {m['error_pct']:+.0f}%: "
              f"{m['term']} ({', '.join(f'{k} {v:+.2f}s' for k, v in m['parts_s'].items())})")
    if b.get("short_epochs"):
        # Said once for the run, not per configuration.
        print(f"{name}: {b['short_epochs']}")
    else:
        for row in b["per_config"]:
            if row["flags"]:
                print(f"{name}:   {row['label']}: {row['flags'][0]}")
    if b.get("drift_probes_counted"):
        print(f"{name}: {b['drift_probes_counted']}")
    for row in fig.get("drift_by_config") or []:
        drift = f"{row['drift']:.2f}x" if row.get("drift") else "-"
        print(f"{name}:   drift of {row['label']}: {drift} by {row['probe']}"
              + ("" if row.get("drift_resolved") else " (within its noise: not corrected)"))
    measured = {r["label"] for r in fig["rows"] if r["measured_s"] and not r["profiled"]}
    for label, source in (fig.get("power_sources") or {}).items():
        if label in measured:
            print(f"{name}:   power of {label}: {source}")


def miss_terms(report: PredictReport, all_cores: int) -> list[dict[str, Any]]:
    """Each validated epoch that missed by more than `MISS`: which term of the model missed.

    From train-predict's own attribution (`infermux.train.attribution`: each term's predicted
    value against the validated epoch's own minibatches, measured, not guessed); `all_cores`
    is kept for the callers and unused where the report carries its attribution.
    """
    rows = (report.attribution or attribute(report, all_cores)).get("epochs", [])
    return [r for r in rows if abs(r["error_pct"]) > 100 * MISS]
