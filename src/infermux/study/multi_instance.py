"""`study multi-instance`: unit combinations × batch sizes × instances, measured together.

The grid of the Jetson AGX Orin study: each unit alone, every pair, and all of them, at each
batch size and instance count, each combination run through the runtime (units that run
together contend, so their solo figures do not add up). The headline is the paper's table:
throughput and p99 per combination and batch, the best single unit against the best
combination, and each combination's contention (measured ÷ the sum of its units alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations
from typing import Any

from infermux.runtime.plan import QUEUE_DELAY_MS
from infermux.study.base import Point, StudyConfig, max_duration_s
from infermux.study.layout import UnitChoice

__all__ = ["build_points", "claims", "combo_label", "headline"]


def combo_label(units: Sequence[str]) -> str:
    """`cuda:0/fp32 + cuda:0/fp16`."""
    return " + ".join(units)


def _combos(units: Sequence[str]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = [(u,) for u in units]
    out += list(combinations(units, 2))
    if len(units) > 2:
        out.append(tuple(units))
    return out


def build_points(config: StudyConfig, choice: UnitChoice, engines: dict[str, str],
                 model: dict[str, Any]) -> list[Point]:
    """Every (instances, batch, combination) point, in the order they are measured.

    Instances outermost: the grid at the fewest instances is the paper's table (the central
    comparison the budget is planned for) and comes first; within it, each batch's solo units
    before their combinations.
    """
    units = choice.ids
    points: list[Point] = []
    for k in config.instances:
        for b in config.batches:
            for combo in _combos(units):
                replicas = [{"unit": u, "engine": engines[u], "instances": k, "batch": b,
                             "batch_buckets": "none"} for u in combo]
                plan = {"name": f"multi-instance-{len(points)}",
                        "models": [{**model, "replicas": replicas}],
                        "dispatcher": {"max_queue_delay_ms": QUEUE_DELAY_MS},
                        "load": {"scenario": "offline", "min_duration_s": config.duration_s,
                                 "min_queries": max(config.min_queries, 2 * b * k * len(combo)),
                                 "max_duration_s": max_duration_s(config)}}
                points.append(Point(combo_label(combo), {"units": list(combo), "batch": b,
                                                         "instances": k,
                                                         "engines": [engines[u] for u in combo]},
                                    plan, central=k == min(config.instances)))
    return points


def headline(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The paper-shaped tables from stored points (`Point.record()` dicts).

    `rows`: one per (instances, combination) with items/s and p99 per batch; `contention`:
    each combination's measured ÷ summed-solo figure and each unit's inside ÷ alone; `best`:
    the best single unit and the best combination; `findings`: one line per batch size saying
    which configuration won, and where all units together lost to contention.
    """
    solo: dict[tuple[str, int, int], dict[str, Any]] = {}
    by_key: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    batches = sorted({p["params"]["batch"] for p in points})
    for p in points:
        prm = p["params"]
        units = tuple(prm["units"])
        by_key.setdefault((combo_label(units), prm["instances"]), {})[prm["batch"]] = p
        if len(units) == 1 and p["status"] == "ok":
            solo[(units[0], prm["batch"], prm["instances"])] = p
    rows = []
    for (label, k), per_batch in by_key.items():
        cells = {}
        for b in batches:
            cell = per_batch.get(b)
            if cell is None:
                continue
            f = cell.get("figures") or {}
            cells[str(b)] = {"status": cell["status"], "items_per_s": f.get("items_per_s"),
                             "p99_ms": f.get("p99_ms"), "error": cell.get("error"),
                             "run": cell.get("sub_run_id")}
        rows.append({"combination": label, "units": label.count("+") + 1, "instances": k,
                     "cells": cells})
    contention = []
    for p in points:
        prm = p["params"]
        if len(prm["units"]) < 2 or p["status"] != "ok":
            continue
        f = p["figures"]
        found = [solo.get((u, prm["batch"], prm["instances"])) for u in prm["units"]]
        alone = [a for a in found if a is not None]
        if len(alone) < len(found):
            continue
        summed = sum(a["figures"]["items_per_s"] or 0.0 for a in alone)
        per_unit = {u: ((f.get("per_unit") or {}).get(u), a["figures"]["items_per_s"])
                    for u, a in zip(prm["units"], alone, strict=True)}
        contention.append({
            "combination": p["variant"], "batch": prm["batch"], "instances": prm["instances"],
            "measured_items_per_s": f.get("items_per_s"), "summed_solo_items_per_s": summed,
            "factor": (f.get("items_per_s") or 0.0) / summed if summed else None,
            "per_unit": {u: {"inside": i, "alone": a, "factor": i / a if i is not None and a
                             else None} for u, (i, a) in per_unit.items()},
        })
    ok = [p for p in points if p["status"] == "ok" and (p.get("figures") or {}).get("items_per_s")]
    singles = [p for p in ok if len(p["params"]["units"]) == 1]
    combos = [p for p in ok if len(p["params"]["units"]) > 1]

    def brief(p: dict[str, Any] | None) -> dict[str, Any] | None:
        if p is None:
            return None
        return {"combination": p["variant"], "batch": p["params"]["batch"],
                "instances": p["params"]["instances"], "items_per_s": p["figures"]["items_per_s"],
                "p99_ms": p["figures"].get("p99_ms"), "run": p.get("sub_run_id")}

    best_single = max(singles, key=lambda p: p["figures"]["items_per_s"], default=None)
    best_combo = max(combos, key=lambda p: p["figures"]["items_per_s"], default=None)
    findings = []
    for b in batches:
        here = [q for q in ok if q["params"]["batch"] == b]
        if not here:
            continue
        win = max(here, key=lambda q: q["figures"]["items_per_s"])
        findings.append(f"batch {b}: {win['variant']} ×{win['params']['instances']} is best, "
                        f"{win['figures']['items_per_s']:,.1f} items/s")
        widest = max(len(q["params"]["units"]) for q in here)
        if widest > 2:
            full = [q for q in here if len(q["params"]["units"]) == widest]
            rest = [q for q in here if len(q["params"]["units"]) < widest]
            if full and rest:
                f_best = max(full, key=lambda p: p["figures"]["items_per_s"])
                r_best = max(rest, key=lambda p: p["figures"]["items_per_s"])
                if f_best["figures"]["items_per_s"] < r_best["figures"]["items_per_s"]:
                    findings.append(
                        f"batch {b}: all {widest} units together ({f_best['figures']['items_per_s']:,.1f}"
                        f" items/s) lose to {r_best['variant']} "
                        f"({r_best['figures']['items_per_s']:,.1f}): contention")
    head = {"batches": batches, "rows": rows, "contention": contention,
            "best_single": brief(best_single), "best_combination": brief(best_combo),
            "combination_over_single": (best_combo["figures"]["items_per_s"]
                                        / best_single["figures"]["items_per_s"])
            if best_combo and best_single else None,
            "findings": findings}
    head["claims"] = claims(points)
    return head


def _best_at(points: Sequence[dict[str, Any]], b: int, *, size: int | None = None,
             wider: bool = False) -> dict[str, Any] | None:
    """The fastest measured point at batch `b` (`size` units; or more than one: `wider`)."""
    here = [p for p in points if p["status"] == "ok" and p["params"]["batch"] == b
            and (p.get("figures") or {}).get("items_per_s")
            and (size is None or len(p["params"]["units"]) == size)
            and (not wider or len(p["params"]["units"]) > 1)]
    return max(here, key=lambda p: p["figures"]["items_per_s"], default=None)


def _show(p: dict[str, Any]) -> str:
    return (f"{p['variant']} ×{p['params']['instances']} "
            f"{p['figures']['items_per_s']:,.1f} items/s")


def claims(points: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """The paper's claims beside this machine's figures: held, did not hold, not measurable."""
    out: list[dict[str, str]] = []
    batches = sorted({p["params"]["batch"] for p in points})
    widest = max((len(p["params"]["units"]) for p in points), default=0)

    def pair(claim: str, paper: str, b: int | None) -> None:
        if b is None or widest < 2:
            out.append({"claim": claim, "paper": paper, "verdict": "not measurable here",
                        "here": "one unit: a combination needs two or more (--units)"})
            return
        single, combo = _best_at(points, b, size=1), _best_at(points, b, wider=True)
        if single is None or combo is None:
            out.append({"claim": claim, "paper": paper, "verdict": "not measurable here",
                        "here": f"batch {b}: no measured " + ("single unit" if single is None
                                                             else "combination")})
            return
        won = combo["figures"]["items_per_s"] > single["figures"]["items_per_s"]
        out.append({"claim": claim, "paper": paper, "verdict": "held" if won else "did not hold",
                    "here": f"batch {b}: best combination {_show(combo)} "
                            f"{'beats' if won else 'loses to'} best single unit {_show(single)}"})

    pair("large batch", "at large batch, two units together (CUDA cores + Tensor Cores) beat "
         "either alone", batches[-1] if batches else None)
    pair("small batch", "at small batch, two units together (DLA + CUDA cores) help",
         batches[0] if len(batches) > 1 else None)
    paper = "all three units together lose to contention at large batch"
    if widest < 3:
        out.append({"claim": "all units", "paper": paper, "verdict": "not measurable here",
                    "here": f"{widest} unit(s): all-units-together needs three or more"})
    else:
        b = batches[-1]
        full = _best_at(points, b, size=widest)
        rest = max((q for q in (_best_at(points, b, size=n) for n in range(1, widest))
                    if q is not None), key=lambda p: p["figures"]["items_per_s"], default=None)
        if full is None or rest is None:
            out.append({"claim": "all units", "paper": paper, "verdict": "not measurable here",
                        "here": f"batch {b}: all units together or fewer were not measured"})
        else:
            lost = full["figures"]["items_per_s"] < rest["figures"]["items_per_s"]
            out.append({"claim": "all units", "paper": paper,
                        "verdict": "held" if lost else "did not hold",
                        "here": f"batch {b}: all {widest} units {_show(full)} "
                                f"{'lose to' if lost else 'beat'} {_show(rest)}"})
    return out
