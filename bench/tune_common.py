"""What the tuner's bench scripts share: running plans side by side through the runtime."""

from __future__ import annotations

import statistics
from typing import Any

from infermux.runtime import run_plan
from infermux.runtime.plan import parse_plan


def through_runtime(plan: dict[str, Any], seconds: float) -> float:
    """Items/s of `plan` run offline for `seconds` as `infermux run` runs it."""
    data = {**plan, "load": {**plan["load"], "scenario": "offline", "min_duration_s": seconds,
                             "min_queries": 256, "find_peak": False}}
    data["load"].pop("p99_bound_ms", None)
    report = run_plan(parse_plan(data, source="bench plan"))
    final = report.final
    if final is None or not final.valid or final.items_per_s is None:
        raise SystemExit(f"plan {plan.get('name')!r} gave no valid offline result: "
                         f"{final.validity_notes if final else 'no trial'}")
    return float(final.items_per_s)


def side_by_side(plans: dict[str, dict[str, Any]], seconds: float, rounds: int
                 ) -> dict[str, dict[str, Any]]:
    """Each plan for `seconds` per round, the plans alternating, so drift hits all alike.

    Returns per plan the rounds' figures and their median, and per plan after the first the
    median of its per-round ratio to the first.
    """
    runs: dict[str, list[float]] = {name: [] for name in plans}
    for i in range(rounds):
        order = list(plans) if i % 2 == 0 else list(reversed(plans))
        for name in order:
            runs[name].append(through_runtime(plans[name], seconds))
    first = next(iter(plans))
    out: dict[str, dict[str, Any]] = {}
    for name, figures in runs.items():
        ratios = [x / y for x, y in zip(figures, runs[first], strict=True)]
        out[name] = {"rounds": [round(x, 1) for x in figures],
                     "median_items_per_s": statistics.median(figures),
                     "ratio_to_" + first: statistics.median(ratios)}
    return out


def eager_plan(model: str, unit: str, batch: int) -> dict[str, Any]:
    """Plain PyTorch eager (no CUDA graph, no compile) at one batch size, as a plan."""
    options = {"cuda_graph": False} if unit.startswith("cuda") else {}
    return {"name": "eager", "models": [{"name": "m", "model": model, "replicas": [
        {"unit": unit, "engine": "torch", "batch": batch, "batch_buckets": "none",
         "options": options}]}], "load": {"scenario": "offline"}}
