"""A plan written by the partitioner, run by the runtime: offline and server, beside its measurement.

1. `run_partition` (profile every piece on every (unit, engine), exact DP, measure the top
   candidates through `run_plan`, keep the best) writes its plan as a runtime Plan.
2. `run_plan` runs that file offline, alternating with the executor alone on the same pipeline
   (`runtime.stages.Pipeline.measure`: endless input, no dispatcher or load generator) for
   `--rounds` rounds, so the two figures are side by side under the same conditions; the
   headline is the median of per-round ratios (what the runtime costs a pipeline).
3. `run_plan` runs it under the server scenario at `--server-fraction` of the offline rate, and
   with `--find-peak` when `--p99` is given.

    PYTHONPATH=src python3 bench/partition_plan_run.py --model mobilenet_v3_small \
        --units cpu:0,cpu:1 --engines torch,onnxruntime,openvino --batch 8
    PYTHONPATH=src python3 bench/partition_plan_run.py --model resnet50 \
        --units cuda:0/fp16,cpu --batch 64 --p99 100
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from infermux._parse import parse_shape
from infermux.models import ModelSpec
from infermux.models.graph import capture_graph
from infermux.partition import save_pipeline
from infermux.partition.search import PartitionConfig, run_partition
from infermux.runtime import load_plan, run_plan
from infermux.runtime.plan import parse_plan
from infermux.runtime.stages import Pipeline
from infermux.units import discover, select_units


def _with_load(plan: Any, **load: Any) -> Any:
    data = plan.to_dict()
    data["load"].update(load)
    return parse_plan(data, source="bench plan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--units", default="cpu:0,cpu:1")
    parser.add_argument("--engines", default="torch")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input-shape", default=None)
    parser.add_argument("--max-pieces", type=int, default=8)
    parser.add_argument("--measure-top", type=int, default=2)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server-fraction", type=float, default=0.7)
    parser.add_argument("--p99", type=float, default=None, help="find-peak bound, ms")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    spec = ModelSpec(args.model, None, parse_shape(args.input_shape) if args.input_shape else None)
    config = PartitionConfig(model=spec, units=args.units, batch=args.batch,
                             top_k=args.measure_top, max_pieces=args.max_pieces,
                             measure_s=args.duration, warmup_s=1.0,
                             engines=tuple(e.strip() for e in args.engines.split(",")))
    report = run_partition(config)
    if report.best is None:
        raise SystemExit("no candidate could be measured")
    out = Path(tempfile.mkdtemp()) / "plan.yaml"
    save_pipeline(report.best, out)
    plan = load_plan(out)  # what `infermux run plan.yaml` reads
    entry = plan.models[0]
    print(f"kept: {entry.describe_stages()}; partitioner measured "
          f"{report.best.measured_items_per_s:,.1f} items/s", flush=True)
    found = discover(with_runtimes=False)
    units = {u.id: u for u in select_units([u for s in entry.stages or [] for u in s.units], found)}
    model, graph = report.model, capture_graph(report.model.module, report.model.input_shape)
    rounds: list[dict[str, float]] = []
    offline = _with_load(plan, scenario="offline", min_duration_s=args.duration, min_queries=64)
    for r in range(args.rounds):
        with Pipeline(entry, model, graph, units) as pipe:
            direct = pipe.measure(args.duration, 1.0).items_per_s
        ran = run_plan(offline).final
        rounds.append({"partitioner": direct, "runtime": (ran.items_per_s if ran else None) or 0.0,
                       "runtime_p99_ms": (ran.latency.p99_ms if ran and ran.latency else 0.0)})
        print(f"round {r + 1}: partitioner {direct:,.1f}, runtime {rounds[-1]['runtime']:,.1f} "
              "items/s", flush=True)
    ratio = statistics.median(x["runtime"] / x["partitioner"] for x in rounds if x["partitioner"])
    rate = args.server_fraction * statistics.median(x["runtime"] for x in rounds)
    server = run_plan(_with_load(plan, scenario="server", rate_qps=rate, min_duration_s=args.duration,
                                 min_queries=128, p99_bound_ms=args.p99)).final
    if server is None:
        raise SystemExit("the server run gave no trial")
    server_p99 = server.latency.p99_ms if server.latency else None
    print(f"server at {rate:,.1f} qps: {server.items_per_s or 0:,.1f} items/s, "
          f"p99 {server_p99} ms, valid {server.valid}")
    peak = None
    if args.p99 is not None:
        found_peak = run_plan(_with_load(plan, scenario="server", find_peak=True, p99_bound_ms=args.p99,
                                         min_duration_s=max(2.0, args.duration / 2),
                                         min_queries=256))
        peak = found_peak.peak
        print(f"find-peak within p99 ≤ {args.p99:g} ms: {peak}")
    result = {
        "machine": platform.node(), "processor": platform.processor(), "args": vars(args),
        "plan": entry.describe_stages(), "plan_yaml": out.read_text(),
        "partition_measured_items_per_s": report.best.measured_items_per_s,
        "predicted_items_per_s": report.best.predicted_items_per_s,
        "rounds": rounds, "runtime_over_partitioner_median": ratio,
        "server": {"rate_qps": rate, "throughput": server.items_per_s,
                   "latency": server.latency.to_dict() if server.latency else {},
                   "valid": server.valid, "pipelines": server.pipelines},
        "peak": peak, "elapsed_s": time.perf_counter() - started,
    }
    print(f"runtime / partitioner (median of {args.rounds} rounds): {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
