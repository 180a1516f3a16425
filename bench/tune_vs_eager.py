r"""The tuned plan against plain PyTorch eager at its best batch, side by side in one run.

1. Baseline: PyTorch eager (the torch engine with CUDA graphs off) over a batch ladder on the
   baseline unit; its best batch is the baseline. On a GPU a second baseline runs eager at the
   tuned plan's precision, so the gain from precision and the gain from the plan are told apart.
2. `run_tune` with the given budget (everything it measures goes to a fresh store).
3. The tuned plan and the baselines' best batches through the runtime (`run_plan`, offline),
   alternating for `--rounds` rounds of `--duration`: the headline ratio (median of per-round
   ratios) compares them as `infermux run` runs them.

    python bench/tune_vs_eager.py --model mobilenet_v3_small --units cpu --budget 3m
    python bench/tune_vs_eager.py --model resnet50 --units 'cuda:0/*' --baseline-unit cuda:0/fp32 \
        --budget 5m --duration 10s
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from infermux._parse import parse_batches, parse_duration_s
from infermux.bench import BenchConfig, run_bench
from infermux.models import ModelSpec
from infermux.store import Store
from infermux.tune import TrialSettings, TuneRequest, run_tune
from tune_common import eager_plan, side_by_side


def eager_best(model: str, unit: str, batches: list[int], seconds: float) -> dict[str, Any]:
    report = run_bench(BenchConfig(
        model=ModelSpec(model), units=unit, batches=batches, engine="torch",
        options={"cuda_graph": False} if unit.startswith("cuda") else {},
        min_duration_s=seconds, min_queries=64, warmup_s=0.5, telemetry_interval_s=None,
        check_agreement=False))
    rows = [m.point().to_dict() for m in report.measurements if m.status == "ok"]
    best = max(rows, key=lambda r: r["items_per_s"])
    return {"unit": unit, "batch": best["batch"], "engine_items_per_s":
            best["items_per_s"],
            "ladder": {r["batch"]: round(r["items_per_s"], 1) for r in rows}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mobilenet_v3_small")
    ap.add_argument("--units", default="cpu")
    ap.add_argument("--baseline-unit", default=None, help="default: the first unit of --units")
    ap.add_argument("--budget", default="3m")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--duration", default="4s", help="each side-by-side run")
    ap.add_argument("--trial-duration", default="1s")
    ap.add_argument("--engines", default="auto")
    ap.add_argument("--compile", default="default,reduce-overhead",
                    help="torch.compile modes the tune tries on GPUs (comma list, or none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()
    batches = parse_batches(args.batches)
    seconds = parse_duration_s(args.duration)
    base_unit = args.baseline_unit or args.units.split(",")[0]
    started = time.monotonic()
    eager = eager_best(args.model, base_unit, batches, 1.0)
    print(f"eager ladder on {base_unit}: {eager['ladder']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp, Store(Path(tmp) / "tune.db") as store:
        tune_started = time.monotonic()
        report = run_tune(TuneRequest(
            models=[ModelSpec(args.model)], units=args.units, engines=args.engines,
            budget_s=parse_duration_s(args.budget), batches=batches,
            compile_modes=tuple(m for m in args.compile.split(",") if m and m != "none"),
            trial=TrialSettings(min_duration_s=parse_duration_s(args.trial_duration))),
            store=store, out_path=Path(tmp) / "tuned.yaml")
        tune_s = time.monotonic() - tune_started
        plan_text = (Path(tmp) / "tuned.yaml").read_text()
    assert report.plan is not None and report.result.best is not None
    best = report.result.best
    print(plan_text, flush=True)
    same_precision = None
    chosen_unit = best.candidate.configs[0].unit
    if chosen_unit != base_unit and chosen_unit.startswith("cuda"):
        same_precision = eager_best(args.model, chosen_unit, batches, 1.0)
    plans = {"eager": eager_plan(args.model, base_unit, eager["batch"])}
    if same_precision is not None:
        plans["eager_same_precision"] = eager_plan(args.model, chosen_unit,
                                                   same_precision["batch"])
    plans["tuned"] = report.plan
    compared = side_by_side(plans, seconds, args.rounds)
    median = {k: v["median_items_per_s"] for k, v in compared.items()}
    result = {
        "command": " ".join(sys.argv), "model": args.model, "units": args.units,
        "budget": args.budget, "eager": eager, "eager_same_precision": same_precision,
        "tuned_plan": best.candidate.label(), "tuned_items_per_s_in_search": best.items_per_s,
        "side_by_side": compared,
        "speedup_vs_eager": compared["tuned"]["ratio_to_eager"],
        "speedup_vs_eager_same_precision": (
            statistics.median(t / e for t, e in zip(
                compared["tuned"]["rounds"], compared["eager_same_precision"]["rounds"],
                strict=True)) if same_precision is not None else None),
        "tuning_s": tune_s, "measured": report.result.measured,
        "space_plans": report.result.space["plans"],
        "solo_configs": report.result.space["solo_configs"],
        "phases": report.result.phases, "total_s": time.monotonic() - started,
        "solo_best": {u: t.items_per_s for u, t in report.result.solo_best.items()},
        "contention": report.result.contention,
    }
    print(f"\n| plan ({args.rounds} alternating rounds of {args.duration}) | items/s, median "
          "| × eager |")
    print("|---|---:|---:|")
    print(f"| eager {base_unit} b{eager['batch']} | {median['eager']:,.1f} | 1.00 |")
    if same_precision is not None:
        print(f"| eager {chosen_unit} b{same_precision['batch']} | "
              f"{median['eager_same_precision']:,.1f} | "
              f"{compared['eager_same_precision']['ratio_to_eager']:.2f} |")
    print(f"| tuned: {best.candidate.label()} | {median['tuned']:,.1f} | "
          f"{result['speedup_vs_eager']:.2f} |")
    if same_precision is not None:
        print(f"tuned / eager on {chosen_unit}: {result['speedup_vs_eager_same_precision']:.2f}")
    print(f"tuning took {tune_s:.0f}s, {report.result.measured} candidates measured of "
          f"{result['space_plans']} plans ({result['solo_configs']} single-unit configs)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
