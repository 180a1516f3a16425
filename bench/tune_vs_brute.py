r"""The tuner against brute force, on a space small enough to measure whole.

1. Brute force: every config of the space (one model, one unit: engines × option variants ×
   batch ladder × instance counts) measured for real with the tuner's own evaluator and trial
   settings; the best is the optimum.
2. Replay: the tuner searches the same space answering from the brute-force table, each answer
   costing the time its measurement took, for several seeds of its fine-tuning sampler: its
   choice as a fraction of the optimum, and the share of the space it measured. Given the table
   this is deterministic, so it shows the search itself, not the machine's noise.
3. Live: `run_tune` for real with a budget, then its chosen plan and the brute-force optimum
   side by side through the runtime, alternating rounds: the ratio as `infermux run` sees it.

    python bench/tune_vs_brute.py --model mobilenet_v3_small --units cpu \
        --engines torch,onnxruntime,openvino --batches 1,2,4,8,16,32 --max-instances 2
    python3 bench/tune_vs_brute.py --model resnet50 --units cuda:0/fp16 --engines torch \
        --batches 1,2,4,8,16,32,64,128,256 --max-instances 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from infermux._parse import parse_batches, parse_duration_s, parse_shape
from infermux.models import ModelSpec
from infermux.tune import (
    Candidate,
    Config,
    LiveEvaluator,
    Space,
    TableEvaluator,
    Trial,
    TrialSettings,
    Tuner,
    TuneRequest,
    TuneSettings,
    UnitSpace,
    model_name,
    prepare,
    run_tune,
)
from infermux.units import Unit
from tune_common import side_by_side


class Clock:
    """The replay's clock: advanced by each answer's measured cost."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        """Seconds of measuring so far."""
        return self.t

    def advance(self, seconds: float) -> None:
        """Count one answer's cost."""
        self.t += seconds


def brute_force(request: TuneRequest, prepared: tuple[list[Unit], dict[str, Any], Space]
                ) -> tuple[Space, LiveEvaluator, dict[str, Trial], float]:
    units, loaded, space = prepared
    if len(space.units) != 1:
        raise SystemExit(f"brute force needs one unit; {request.units!r} selected "
                         f"{[u.unit.id for u in space.units]}")
    specs = {model_name(m.ref): m for m in request.models}
    evaluator = LiveEvaluator(specs, units, request.trial, telemetry=False, loaded=loaded)
    table: dict[str, Trial] = {}
    started = time.monotonic()
    configs = space.solo_configs()
    try:
        for i, cfg in enumerate(configs, 1):
            trial = evaluator.evaluate(Candidate.of(cfg))
            table[trial.candidate.key()] = trial
            figure = f"{trial.items_per_s:,.1f}" if trial.items_per_s else trial.status
            print(f"  brute {i:3}/{len(configs)} {cfg.label():48} {figure:>12} items/s "
                  f"({trial.method}, {trial.cost_s:.1f}s)", flush=True)
    finally:
        evaluator.close()
    return space, evaluator, table, time.monotonic() - started


def load_table(path: str) -> tuple[Space, dict[str, Trial], float, dict[str, Any]]:
    """A brute-force table saved by `--json`, to replay the search on another machine."""
    data = json.loads(Path(path).read_text())
    units = []
    for u in data["space"]["units"]:
        kind, _, rest = u["unit"].partition(":")
        device, _, mode = (kind + ":" + rest).partition("/")
        units.append(UnitSpace(
            Unit(id=u["unit"], kind=kind, device=device if kind != "cpu" else "cpu",
                 mode=mode or "fp32", name=u["unit"], contention_domain=device),
            u["engines"], u["batches"], u["instances"], u["options"]))
    space = Space(data["space"]["models"], units)
    table: dict[str, Trial] = {}
    for row in data["brute_force"]["table"]:
        configs = [Config.make(c["model"], c["unit"], c["engine"], c["batch"], c["instances"],
                               c["options"]) for c in row["configs"]]
        trial = Trial(Candidate.of(*configs), row["method"], row["status"], row["items_per_s"],
                      row["p99_ms"], row["energy_per_item_j"], row["power_w"],
                      row["memory_bytes"], row["per_unit"], row["cost_s"])
        table[trial.candidate.key()] = trial
    return space, table, data["brute_force"]["seconds"], data


def replay(space: Any, table: dict[str, Trial], seed: int, budget_s: float,
           patience: int | None = None) -> dict[str, Any]:
    clock = Clock()

    def cost(candidate: Candidate, _method: str) -> float:
        known = table.get(candidate.key())
        return known.cost_s if known is not None else 0.0

    evaluator = TableEvaluator(lambda c: table.get(c.key()), cost_s=cost, on_cost=clock.advance)
    settings = TuneSettings(budget_s=budget_s, seed=seed)
    if patience is not None:
        settings = dataclasses.replace(settings, patience=patience)
    result = Tuner(space, evaluator, None, settings, clock=clock).run()
    assert result.best is not None
    return {"seed": seed, "chosen": result.best.candidate.label(),
            "items_per_s": result.best.items_per_s,
            "distinct_measured": len({c.key() for c, _ in evaluator.calls}),
            "tuning_s": clock.t, "phases": result.phases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mobilenet_v3_small")
    ap.add_argument("--input-shape", default=None)
    ap.add_argument("--units", default="cpu")
    ap.add_argument("--engines", default="torch,onnxruntime,openvino")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--max-instances", type=int, default=2)
    ap.add_argument("--trial-duration", default="1s")
    ap.add_argument("--max-plans", type=int, default=120, help="refuse bigger spaces")
    ap.add_argument("--seeds", type=int, default=5, help="replays, one per sampler seed")
    ap.add_argument("--budget", default="3m", help="the live tune's budget")
    ap.add_argument("--duration", default="4s", help="each side-by-side run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write everything here")
    ap.add_argument("--patience", type=int, default=None,
                    help="replays: the fine-tuning's patience (default: the tuner's)")
    ap.add_argument("--replay-from", default=None, metavar="JSON",
                    help="replay the search on a table saved by --json; measure nothing")
    args = ap.parse_args()
    if args.replay_from:
        space, table, brute_s, saved = load_table(args.replay_from)
        print(f"replaying {args.replay_from} (measured by: {saved['command']})")
        print_replays(space, table, brute_s, args.seeds, args.patience)
        return 0
    shape = parse_shape(args.input_shape) if args.input_shape else None
    request = TuneRequest(
        models=[ModelSpec(args.model, None, shape)], units=args.units, engines=args.engines,
        budget_s=parse_duration_s(args.budget), batches=parse_batches(args.batches),
        max_instances=args.max_instances,
        trial=TrialSettings(min_duration_s=parse_duration_s(args.trial_duration)))
    prepared = prepare(request)
    space = prepared[2]
    if space.size() > args.max_plans:
        print(f"the space holds {space.size()} plans, more than --max-plans {args.max_plans}: "
              "narrow --engines, --batches or --max-instances", file=sys.stderr)
        return 2
    print(f"space: {json.dumps(space.describe())}", flush=True)

    space, evaluator, table, brute_s = brute_force(request, prepared)
    optimum, replays = print_replays(space, table, brute_s, args.seeds, args.patience)

    live_started = time.monotonic()
    live = run_tune(request)
    live_s = time.monotonic() - live_started
    assert live.plan is not None and live.result.best is not None
    optimum_plan = evaluator.plan_dict(optimum.candidate, load={"scenario": "offline"})
    compared = side_by_side({"brute-force optimum": optimum_plan, "tuned": live.plan},
                            parse_duration_s(args.duration), args.rounds)
    best_live = live.result.best
    print(f"\ntuner live, budget {args.budget}: {best_live.candidate.label()} "
          f"{best_live.items_per_s:,.1f} items/s ({best_live.method}); {live.result.measured} "
          f"candidates measured ({live.result.measured / len(table):.0%} of the space) "
          f"in {live_s:.0f} s")
    ratio_key = "ratio_to_brute-force optimum"
    print(f"side by side through the runtime ({args.rounds} rounds of {args.duration}): "
          f"optimum {compared['brute-force optimum']['median_items_per_s']:,.1f}, tuned "
          f"{compared['tuned']['median_items_per_s']:,.1f} items/s; tuned / optimum "
          f"{compared['tuned'][ratio_key]:.3f} (per round {compared['tuned']['rounds']} vs "
          f"{compared['brute-force optimum']['rounds']})")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join(sys.argv), "space": space.describe(),
            "brute_force": {"seconds": brute_s, "optimum": optimum.to_dict(),
                            "table": [t.to_dict() for t in table.values()]},
            "replays": replays,
            "live": {"seconds": live_s, **live.result.to_dict()},
            "side_by_side": compared}, indent=1, default=str))
    return 0


def print_replays(space: Space, table: dict[str, Trial], brute_s: float, seeds: int,
                  patience: int | None = None) -> tuple[Trial, list[dict[str, Any]]]:
    """Replay the search for each seed; print the table against brute force."""
    ok = [t for t in table.values() if t.ok]
    optimum = max(ok, key=lambda t: t.items_per_s or 0.0)
    replays = [replay(space, table, seed, 10 * brute_s, patience) for seed in range(seeds)]
    print("\n| search | chosen | items/s (table) | of optimum | measured | of the space "
          "| measuring time |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print(f"| brute force | {optimum.candidate.label()} | {optimum.items_per_s:,.1f} | 1.000 "
          f"| {len(table)} | 100% | {brute_s:.0f} s |")
    for r in replays:
        r["fraction_of_optimum"] = r["items_per_s"] / optimum.items_per_s
        r["fraction_measured"] = r["distinct_measured"] / len(table)
        print(f"| tuner replay, seed {r['seed']} | {r['chosen']} | {r['items_per_s']:,.1f} | "
              f"{r['fraction_of_optimum']:.3f} | {r['distinct_measured']} | "
              f"{r['fraction_measured']:.0%} | {r['tuning_s']:.0f} s |")
    worst = min(r["fraction_of_optimum"] for r in replays)
    most = max(r["fraction_measured"] for r in replays)
    print(f"replays: worst {worst:.3f} of the optimum, at most {most:.0%} of the space measured "
          f"(targets: ≥ 0.95, ≤ 20%)", flush=True)
    return optimum, replays


if __name__ == "__main__":
    sys.exit(main())
