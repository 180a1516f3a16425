"""Server peak / offline under the two batching rules, alternated on one built plan.

The plan is built once (one process, one compile); then, round after round, each rule runs
the offline trial and `--find-peak` (bisection, then the edge repeated) on the same workers:
`queue_delay` (wait `max_queue_delay_ms` for a fuller batch, the rule before deadline
batching) and `deadline` (partial batches wait while the oldest query can still finish within
the bound). Taking turns puts both rules on the same host noise. Every trial keeps its latency
phases (queueing, batching wait, launch, run, host overhead, hand-over; runtime.metrics) and
the load generator's issue lag, so a slow query's time is accounted for.

    # the ResNet50 fp16 server plan on one GPU (H100: about 5 minutes)
    python bench/server_batching.py --model resnet50 --unit cuda:0/fp16 --batch 64 \
        --instances 2 --compile default --p99 15 --duration 3 --rounds 2 --json batching.json
    # mobilenet_v3_small on a 2-core CPU, p99 50 ms (the host to itself: about 4 minutes)
    python bench/server_batching.py --model mobilenet_v3_small --unit cpu --batch 4 \
        --instances 2 --compile none --p99 50 --duration 3 --queries 512 --rounds 2 \
        --max-s 200 --json batching_cpu.json

Each trial prints a line as it ends (stderr), and each row the host's 1-minute load before and
after it: on a shared CPU host the other processes' load decides the batch's own time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from infermux.load import find_peak
from infermux.runtime import parse_plan
from infermux.runtime.peak import run_trial
from infermux.runtime.session import start_runtime

RULES = ("queue_delay", "deadline")


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    options = {"compile": args.compile} if args.compile != "none" else {}
    return {
        "name": f"b{args.batch}x{args.instances}",
        "models": [{"name": "m", "model": args.model, "replicas": [
            {"unit": args.unit, "engine": "torch", "instances": args.instances,
             "batch": args.batch, "batch_buckets": "pow2", "options": options}]}],
        "dispatcher": {"max_queue_delay_ms": args.delay_ms},
        "load": {"scenario": "server", "p99_bound_ms": args.p99, "min_duration_s": args.duration,
                 "min_queries": args.queries},
    }


def _brief(record: dict[str, Any]) -> dict[str, Any]:
    """A trial's figures that say where the time went."""
    models = record.get("models") or {}
    model = next(iter(models.values()), {})
    return {
        "scenario": record.get("scenario"), "rate_qps": record.get("rate_qps"),
        "valid": record.get("valid"), "items_per_s": record.get("items_per_s"),
        "p99_ms": (record.get("latency") or {}).get("p99_ms"),
        "issue_lag": record.get("issue_lag"),
        "load_generator_lag": record.get("load_generator_lag"),
        "phases": model.get("phases"), "mean_batch": model.get("mean_batch"),
        "batch_histogram": model.get("batch_histogram"),
        "worker_batch_latency": {name: w.get("batch_latency")
                                 for name, w in (record.get("workers") or {}).items()},
    }


def _say(brief: dict[str, Any]) -> None:
    """One line per trial as it ends: a slow host shows its progress, and a stall where it is."""
    rate = brief["rate_qps"]
    lag = (brief.get("issue_lag") or {}).get("p99_ms")
    p99 = brief.get("p99_ms")
    print(f"  {brief['scenario']:>7} {'' if rate is None else f'{rate:9.1f} qps':>13}  "
          f"{brief.get('items_per_s') or 0:8.1f} items/s  p99 "
          f"{'-' if p99 is None else f'{p99:.1f}'} ms  valid {brief['valid']}  issue lag p99 "
          f"{'-' if lag is None else f'{lag:.1f}'} ms  mean batch {brief.get('mean_batch')}",
          file=sys.stderr, flush=True)


def _one(rt: Any, rule: str, settings: dict[str, Any], shares: dict[str, float],
         bound: float) -> dict[str, Any]:
    rt.set_batching(rule)
    records: list[dict[str, Any]] = []
    offline = run_trial(rt, {**settings, "scenario": "offline"}, shares).record
    records.append(_brief(offline))
    _say(records[-1])
    upper = offline.get("items_per_s") or 0.0

    def server(rate: float) -> Any:
        run = run_trial(rt, {**settings, "scenario": "server", "rate_qps": rate}, shares)
        result, record = run.result, run.record
        records.append(_brief(record))
        _say(records[-1])
        return result

    peak = find_peak(server, upper_qps=upper, bound_ms=bound, confirm=True).record()
    at_peak = [r for r in records[1:] if r["rate_qps"] == peak["peak_qps"] and r["valid"]]
    return {"rule": rule, "offline_items_per_s": upper, "peak_qps": peak["peak_qps"],
            "ratio": peak["peak_fraction_of_offline"], "edge_confirmed": peak["edge_confirmed"],
            "p99_spread_ms": peak["p99_spread_ms"], "notes": peak["notes"],
            "reason": peak["reason"], "at_peak": at_peak[-1] if at_peak else None,
            "trials": records}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--unit", default="cuda:0/fp16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--compile", default="default", help="torch.compile mode, or none")
    parser.add_argument("--delay-ms", type=float, default=2.0,
                        help="max_queue_delay_ms (the queue_delay rule's wait)")
    parser.add_argument("--p99", type=float, default=15.0, help="the bound, ms")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per trial")
    parser.add_argument("--queries", type=int, default=1024, help="min_queries per trial")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-s", type=float, default=300.0,
                        help="start no round after this many seconds")
    parser.add_argument("--json", dest="json_path", required=True)
    args = parser.parse_args()
    started = time.perf_counter()
    plan = parse_plan(_plan(args), source="bench plan")
    rt = start_runtime(plan)
    out: dict[str, Any] = {"plan": plan.to_dict(), "build_s": time.perf_counter() - started,
                           "rounds": []}
    settings = plan.load.model_dump(mode="json")
    shares = {m.name: m.share for m in plan.models}
    try:
        for i in range(args.rounds):
            # The order flips each round, so neither rule always runs first.
            order = RULES if i % 2 == 0 else tuple(reversed(RULES))
            for rule in order:
                if time.perf_counter() - started > args.max_s:
                    break
                before = os.getloadavg()
                row = _one(rt, rule, settings, shares, args.p99)
                row["round"] = i
                # A shared host's load decides a CPU plan's figures: kept beside each row.
                row["loadavg_1m"] = [before[0], os.getloadavg()[0]]
                out["rounds"].append(row)
                # Without a peak, the lowest rate tried says where even a light load's time went.
                servers = [t for t in row["trials"] if t["scenario"] == "server"]
                shown = row["at_peak"] or (min(servers, key=lambda t: t["rate_qps"] or 0)
                                           if servers else {})
                ph = shown.get("phases") or {}
                p99s = {k: round(v["p99_ms"], 2) for k, v in ph.items() if v.get("p99_ms")}
                ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
                print(f"round {i} {rule:>11}: offline {row['offline_items_per_s']:9.1f}  peak "
                      f"{row['peak_qps'] or 0:9.1f}  ratio {ratio}  edge confirmed "
                      f"{row['edge_confirmed']}  load {row['loadavg_1m'][0]:.1f}"
                      f"/{row['loadavg_1m'][1]:.1f}  phases p99 at "
                      f"{'peak' if row['at_peak'] else 'lowest rate'} {p99s}", flush=True)
                Path(args.json_path).write_text(json.dumps(out, indent=1))
    finally:
        rt.stop(drain=False)
    out["seconds"] = time.perf_counter() - started
    Path(args.json_path).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
