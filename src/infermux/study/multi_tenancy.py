"""`study multi-tenancy`: several models at once, sequential against concurrent against placed.

The execution modes of the AI multi-tenancy study, each a plan run through the runtime:
- **sequential**: each model alone on every selected unit (on a CPU, one worker per core
  set: the whole CPU), one after another; the figure is
  what the machine gives when it time-shares them with equal items of each model,
  k ÷ Σ (1 ÷ items/s of model i alone);
- **CME** (concurrent model executions): every model at once on one unit. On a GPU or DLA
  the models share its engines; on the CPU every model gets every core set, as when it runs
  alone, so their workers share the cores (the plan's `sharing: cores` opt-in, which only
  studies set) and their contention is measured as the paper did;
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
from infermux.study.layout import UnitChoice

__all__ = ["build_points", "claims", "headline"]


def _is_cpu(unit: str) -> bool:
    return unit == "cpu" or unit.startswith("cpu:")


def _plan(name: str, entries: list[dict[str, Any]], config: StudyConfig, *, b: int,
          scenario: str, dynamic: bool = False, sharing: bool = False) -> dict[str, Any]:
    load: dict[str, Any] = {"scenario": scenario, "min_duration_s": config.duration_s,
                            "min_queries": max(config.min_queries, 2 * b * len(entries)),
                            "max_duration_s": max_duration_s(config)}
    if scenario == "server":
        # A peak search bisects the rate: a low-rate trial needs time for its queries.
        load.update(find_peak=True, p99_bound_ms=config.p99_ms, samples_per_query=1,
                    min_queries=config.min_queries,
                    max_duration_s=max_duration_s(config))
    plan = {"name": name, "models": entries, "dispatcher": {"max_queue_delay_ms": QUEUE_DELAY_MS},
            "placement": "dynamic" if dynamic else "static", "load": load}
    if sharing:
        plan["sharing"] = "cores"
    return plan


def _cme_units(choice: UnitChoice) -> tuple[list[list[str]], bool]:
    """Where each CME point runs, and whether its models share CPU cores.

    On up to two GPU or DLA units, one point each. Else on the CPU: every model gets every
    CPU unit of the study (the whole CPU, as when it runs alone), so the models' workers
    share the cores.
    """
    others = [u.id for u in choice.units if not _is_cpu(u.id)][:2]
    if others:
        return [[u] for u in others], False
    return [[u.id for u in choice.units]], True


def build_points(config: StudyConfig, choice: UnitChoice, engines: dict[str, str],
                 models: list[dict[str, Any]]) -> list[Point]:
    """Offline points at every batch (each model alone, CME, static, DMP), then server peaks."""
    names = [m["name"] for m in models]
    units = choice.ids
    points: list[Point] = []
    alone_on = list(units)
    cme_on, shared = _cme_units(choice)
    cpu_engine = next((e for u, e in engines.items() if _is_cpu(u)), "torch")

    def engine(u: str) -> str:
        return engines.get(u) or cpu_engine

    def entry(m: dict[str, Any], on: Sequence[str], b: int, scenario: str) -> dict[str, Any]:
        # Offline batches fill, so one runner per worker (each built runner is warmed up: on a
        # busy CPU that is much of a point's cost); server arrivals leave partial batches.
        buckets = "pow2" if scenario == "server" else "none"
        return {**m, "replicas": [{"unit": u, "engine": engine(u), "batch": b,
                                   "batch_buckets": buckets} for u in on]}

    def add(mode: str, variant: str, params: dict[str, Any], plan: dict[str, Any] | None,
            why: str | None = None) -> None:
        twin = None
        if params["scenario"] == "server":
            twin = next((i for i, p in enumerate(points) if p.params["mode"] == mode
                         and p.params.get("model") == params.get("model")
                         and p.params["units"] == params["units"]
                         and p.params["scenario"] == "offline"
                         and p.params["batch"] == params["batch"]), None)
        point = Point(variant, {"mode": mode, "models": names, **params}, plan, twin=twin)
        if plan is None:
            point.status, point.error = "skipped", why
        points.append(point)

    def modes(b: int, scenario: str) -> None:
        tag = "" if scenario == "offline" else " (server)"
        for m in models:
            add("alone", f"{m['name']} alone{tag}", {"batch": b, "scenario": scenario,
                                                     "units": alone_on, "model": m["name"]},
                _plan(f"alone-{m['name']}", [entry(m, alone_on, b, scenario)], config, b=b,
                      scenario=scenario))
        for on in cme_on:
            label = "CME (shared cores)" if shared else f"CME on {on[0]}"
            add("cme", f"{label}{tag}", {"batch": b, "scenario": scenario, "units": on,
                                         "sharing": "cores" if shared else "none"},
                _plan("cme", [entry(m, on, b, scenario) for m in models], config, b=b,
                      scenario=scenario, sharing=shared))
        params = {"batch": b, "scenario": scenario, "units": list(units)}
        if len(units) >= 2:
            placed = [entry(m, [units[i % len(units)]], b, scenario)
                      for i, m in enumerate(models)]
            add("static", f"static placement{tag}", dict(params),
                _plan("static", placed, config, b=b, scenario=scenario))
            add("dmp", f"DMP (dynamic placement){tag}", dict(params),
                _plan("dmp", placed, config, b=b, scenario=scenario, dynamic=True))
        else:
            why = (f"one unit ({units[0]}): placing models on units needs two or more; "
                   "pass --units with two, e.g. cpu:0,cpu:1")
            add("static", f"static placement{tag}", dict(params), None, why)
            add("dmp", f"DMP (dynamic placement){tag}", dict(params), None, why)

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
    head = {"batches": batches, "rows": list(rows.values()), "server": peaks,
            "server_batch": max((p["params"]["batch"] for p in server), default=None),
            "best": best, "findings": findings,
            "p99_bound_ms": next((p["figures"].get("p99_bound_ms") for p in server
                                  if p.get("figures")), None)}
    head["claims"] = claims(head, points)
    return head


def _verdict(claim: str, paper: str, verdict: str, here: str) -> dict[str, str]:
    return {"claim": claim, "paper": paper, "verdict": verdict, "here": here}


def _best_gain(head: dict[str, Any], mode: str) -> tuple[float, str] | None:
    """The highest gain over sequential execution of `mode`, offline or under server load."""
    found: list[tuple[float, str]] = []
    for row in head["rows"]:
        if row["mode"] != mode:
            continue
        for b, cell in row["cells"].items():
            if cell.get("gain_over_sequential"):
                found.append((cell["gain_over_sequential"], f"{row['variant']} at batch {b}, "
                                                            "offline"))
    for s in head["server"]:
        if s["mode"] == mode and s.get("gain_over_sequential"):
            found.append((s["gain_over_sequential"], f"{s['variant']} under server load"))
    return max(found) if found else None


def _why_missing(points: Sequence[dict[str, Any]], mode: str) -> str:
    reasons = sorted({str(p.get("error") or p["status"]) for p in points
                      if p["params"].get("mode") == mode and p["status"] != "ok"})
    return "; ".join(reasons)[:240] or "no point of this mode was measured"


def claims(head: dict[str, Any], points: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """The paper's claims beside this machine's figures: held, did not hold, not measurable."""
    out = []
    seq = next((r for r in head["rows"] if r["mode"] == "sequential"), None)
    gain = (seq or {}).get("batching_gain")
    batches = head["batches"]
    paper = "batching gives more than 2.4× throughput on a GPU board"
    if len(batches) < 2:
        out.append(_verdict("batching", paper, "not measurable here",
                            f"one batch size ({batches}): pass two, e.g. --batch 1,8"))
    elif not gain:
        out.append(_verdict("batching", paper, "not measurable here",
                            "sequential execution has no figure at both batch sizes: "
                            + _why_missing(points, "alone")))
    else:
        out.append(_verdict("batching", paper, "held" if gain > 2.4 else "did not hold",
                            f"batch {batches[0]}→{batches[-1]}: {gain:.2f}× for sequential "
                            "execution"))
    units = sorted({u for p in points for u in p["params"].get("units") or []})
    for mode, name in (("cme", "CME"), ("dmp", "DMP")):
        paper = f"{name} gives up to 3× the sequential execution's throughput on GPU boards"
        best = _best_gain(head, mode)
        if best is None:
            out.append(_verdict(name, paper, "not measurable here", _why_missing(points, mode)))
            continue
        g, where = best
        out.append(_verdict(name, paper, "held" if g > 1.05 else "did not hold",
                            f"best {g:.2f}× the sequential execution ({where})"
                            + ("" if g > 1.05 else ": the models contend for the same "
                               "resources")))
    if not any(u.startswith("edgetpu") for u in units):  # else the lines above cover them
        out.append(_verdict("Edge TPUs", "CME and DMP give up to 10× on Edge TPUs",
                            "not measurable here",
                            "no Edge TPU among the units (" + ", ".join(units) + ")"))
    out.append(_verdict("clusters", "clusters of accelerators add throughput on top",
                        "not measurable here", "one machine: a cluster of machines is "
                        "`infermux cluster`'s to measure"))
    return out
