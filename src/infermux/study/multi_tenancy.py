"""`study multi-tenancy`: several models at once, sequential against concurrent against placed.

The execution modes of the AI multi-tenancy study, each a plan run through the runtime:
- **sequential**: each model alone on every selected unit, one after another; the figure is
  what the machine gives when it time-shares them with equal items of each model,
  k ÷ Σ (1 ÷ items/s of model i alone);
- **CME** (concurrent model executions): every model at once on one unit (a GPU or DLA: CPU
  workers get disjoint core sets, so on CPU units CME is skipped and says why);
- **static placement**: every model at once, model i on unit i (round robin);
- **DMP** (dynamic model placement): every model at once, workers moving between models as
  their queues grow (`placement: dynamic`).
At each batch size (the batching gain), under offline load, then the peak server rate within a
p99 bound at the largest batch. A mode's gain over sequential execution offline is Σ x_i' ÷ x_i
(x_i' its items/s of model i, x_i model i's alone): offline load does not hold the models to
equal items, so the mode's work is set against the time the models alone would need for it.
Server arrivals are split evenly between the models, so there the peaks compare directly with
k ÷ Σ (1 ÷ peak of model i alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from infermux.runtime.plan import QUEUE_DELAY_MS
from infermux.study.base import Point, StudyConfig, max_duration_s

__all__ = ["build_points", "headline"]

_CPU_CME = ("CPU workers get disjoint core sets, so several models cannot run at once on one "
            "CPU unit; CME applies to GPU and DLA units (static placement and DMP share the CPU "
            "by core sets)")


def _is_cpu(unit: str) -> bool:
    return unit == "cpu" or unit.startswith("cpu:")


def _plan(name: str, entries: list[dict[str, Any]], config: StudyConfig, *, b: int,
          scenario: str, dynamic: bool = False) -> dict[str, Any]:
    load: dict[str, Any] = {"scenario": scenario, "min_duration_s": config.duration_s,
                            "min_queries": max(config.min_queries, 2 * b * len(entries)),
                            "max_duration_s": max_duration_s(config)}
    if scenario == "server":
        # A peak search bisects the rate: a low-rate trial needs time for its queries.
        load.update(find_peak=True, p99_bound_ms=config.p99_ms, samples_per_query=1,
                    min_queries=config.min_queries,
                    max_duration_s=max_duration_s(config))
    return {"name": name, "models": entries, "dispatcher": {"max_queue_delay_ms": QUEUE_DELAY_MS},
            "placement": "dynamic" if dynamic else "static", "load": load}


def build_points(config: StudyConfig, units: Sequence[str], engines: dict[str, str],
                 models: list[dict[str, Any]]) -> list[Point]:
    """Offline points at every batch (each model alone, CME, static, DMP), then server peaks."""
    names = [m["name"] for m in models]
    points: list[Point] = []

    def entry(m: dict[str, Any], on: Sequence[str], b: int) -> dict[str, Any]:
        return {**m, "replicas": [{"unit": u, "engine": engines[u], "batch": b,
                                   "batch_buckets": "pow2"} for u in on]}

    def add(mode: str, variant: str, params: dict[str, Any], plan: dict[str, Any] | None,
            why: str | None = None) -> None:
        point = Point(variant, {"mode": mode, "models": names, **params}, plan)
        if plan is None:
            point.status, point.error = "skipped", why
        points.append(point)

    cme_units = [u for u in units if not _is_cpu(u)][:2]
    spread = len(units) >= 2

    def modes(b: int, scenario: str) -> None:
        tag = "" if scenario == "offline" else " (server)"
        for m in models:
            add("alone", f"{m['name']} alone{tag}", {"batch": b, "scenario": scenario,
                                                     "units": list(units), "model": m["name"]},
                _plan(f"alone-{m['name']}", [entry(m, units, b)], config, b=b,
                      scenario=scenario))
        if cme_units:
            for u in cme_units:
                add("cme", f"CME on {u}{tag}", {"batch": b, "scenario": scenario, "units": [u]},
                    _plan("cme", [entry(m, [u], b) for m in models], config, b=b,
                          scenario=scenario))
        else:
            add("cme", f"CME{tag}", {"batch": b, "scenario": scenario, "units": list(units)},
                None, _CPU_CME)
        if spread:
            placed = [entry(m, [units[i % len(units)]], b) for i, m in enumerate(models)]
            add("static", f"static placement{tag}", {"batch": b, "scenario": scenario,
                                                     "units": list(units)},
                _plan("static", placed, config, b=b, scenario=scenario))
            add("dmp", f"DMP (dynamic placement){tag}", {"batch": b, "scenario": scenario,
                                                         "units": list(units)},
                _plan("dmp", placed, config, b=b, scenario=scenario, dynamic=True))

    for b in config.batches:
        modes(b, "offline")
    modes(max(config.batches), "server")
    return points


def _sequential(alone: dict[str, float | None]) -> float | None:
    """Time-shared throughput of the models alone: k ÷ Σ 1/x (equal items of each model)."""
    values = list(alone.values())
    if not values or any(not v for v in values):
        return None
    return len(values) / sum(1.0 / v for v in values if v)


def _same_work_gain(point: dict[str, Any], alone: dict[str, float | None]) -> float | None:
    """How much faster the mode did its work than the models alone, one after another.

    Offline load does not hold the models to equal items (a fast model completes more), so
    the work done, x_i' items/s of each model, is set against the time the models alone
    would need for it: Σ x_i' / x_i (1 = no better than sequential execution).
    """
    per_model = (point.get("figures") or {}).get("per_model") or {}
    gain = 0.0
    for model, done in per_model.items():
        solo = alone.get(model)
        if not solo:
            return None
        gain += (done or 0.0) / solo
    return gain if per_model else None


def headline(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Rows of execution modes × batch sizes (offline), the server peaks, and the gains."""
    batches = sorted({p["params"]["batch"] for p in points
                      if p["params"].get("scenario") == "offline"})
    offline = [p for p in points if p["params"].get("scenario") == "offline"]
    server = [p for p in points if p["params"].get("scenario") == "server"]

    def value(p: dict[str, Any], key: str) -> float | None:
        return (p.get("figures") or {}).get(key) if p["status"] == "ok" else None

    rows: dict[str, dict[str, Any]] = {}
    sequential: dict[int, float | None] = {}
    for b in batches:
        at = [p for p in offline if p["params"]["batch"] == b]
        alone = {p["params"]["model"]: value(p, "items_per_s") for p in at
                 if p["params"]["mode"] == "alone"}
        sequential[b] = _sequential(alone)
        seq = rows.setdefault("sequential", {"mode": "sequential", "cells": {},
                                             "variant": "sequential (models alone, equal items)"})
        seq["cells"][str(b)] = {"items_per_s": sequential[b], "status": "ok" if sequential[b]
                                else "missing", "from": "models alone, time-shared"}
        for p in at:
            if p["params"]["mode"] == "alone":
                continue
            row = rows.setdefault(p["variant"], {"mode": p["params"]["mode"], "cells": {},
                                                 "variant": p["variant"]})
            v = value(p, "items_per_s")
            row["cells"][str(b)] = {
                "items_per_s": v, "status": p["status"], "error": p.get("error"),
                "p99_ms": value(p, "p99_ms"), "run": p.get("sub_run_id"),
                "per_model": (p.get("figures") or {}).get("per_model"),
                "gain_over_sequential": _same_work_gain(p, alone) if v else None}
    low, high = (batches[0], batches[-1]) if batches else (None, None)
    for row in rows.values():
        a = row["cells"].get(str(low), {}).get("items_per_s")
        z = row["cells"].get(str(high), {}).get("items_per_s")
        row["batching_gain"] = z / a if a and z and high != low else None
    alone_peaks = {p["params"]["model"]: value(p, "peak_qps") for p in server
                   if p["params"]["mode"] == "alone"}
    seq_peak = _sequential(alone_peaks)
    peaks = [{"mode": "sequential", "variant": "sequential", "peak_qps": seq_peak,
              "status": "ok" if seq_peak else "missing", "gain_over_sequential": 1.0
              if seq_peak else None}]
    for p in server:
        if p["params"]["mode"] == "alone":
            continue
        v = value(p, "peak_qps")
        peaks.append({"mode": p["params"]["mode"], "variant": p["variant"].replace(
            " (server)", ""), "peak_qps": v, "status": p["status"], "run": p.get("sub_run_id"),
            "reason": (p.get("figures") or {}).get("peak_reason") or p.get("error"),
            "gain_over_sequential": v / seq_peak if v and seq_peak else None})
    best = None
    for name, row in rows.items():
        for b, cell in row["cells"].items():
            if name != "sequential" and cell.get("gain_over_sequential") and (
                    best is None or cell["gain_over_sequential"] > best["gain"]):
                best = {"variant": name, "batch": int(b), "gain": cell["gain_over_sequential"],
                        "items_per_s": cell["items_per_s"]}
    findings = []
    if best:
        findings.append(f"{best['variant']} at batch {best['batch']}: {best['gain']:.2f}× the "
                        "sequential execution of the same models")
    for name, row in rows.items():
        if row.get("batching_gain"):
            findings.append(f"batching {low}→{high}: {row['batching_gain']:.2f}× for {name}")
    return {"batches": batches, "rows": list(rows.values()), "server": peaks,
            "server_batch": max((p["params"]["batch"] for p in server), default=None),
            "best": best, "findings": findings,
            "p99_bound_ms": next((p["figures"].get("p99_bound_ms") for p in server
                                  if p.get("figures")), None)}
