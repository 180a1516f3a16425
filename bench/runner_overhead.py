"""Does the torch runner add overhead? Runner vs a plain PyTorch loop, side by side, one process.

For each (unit, batch): a plain loop written here by hand (pinned host input, non-blocking copy
in, eager forward, copy out, synchronize — the same data placement and per-batch protocol as the
runner), then the runner with CUDA graphs off (eager, must be ≥ 0.97× the plain loop), then the
runner with its defaults (CUDA graph per batch size). Eager batch-1 throughput is bound by the
host's kernel-launch rate, which drifts by tens of percent over seconds on a shared host, so the
three run in short interleaved slices and each ratio is the median of the per-round ratios.

    python3 bench/runner_overhead.py --units cuda:0/fp32,cuda:0/fp16 --batch 1,8,32,64,128,256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from infermux.bench import measure
from infermux.engines import create_engine
from infermux.models import load_model
from infermux.units import discover, select_units

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
          "bf16": torch.bfloat16}


def plain_loop(module, unit, batch, shape, channels_last, seconds):
    """The baseline: what a person writes by hand to time a model on a GPU, per batch synced."""
    device = torch.device(unit.device if unit.kind == "cuda" else "cpu")
    dtype = DTYPES[unit.mode]
    torch.backends.cuda.matmul.allow_tf32 = unit.mode == "tf32"
    torch.backends.cudnn.allow_tf32 = unit.mode == "tf32"
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x_host = torch.randn((batch, *shape)).to(dtype)
    if device.type == "cuda":
        x_host = x_host.pin_memory()
    x_dev = torch.empty(x_host.shape, dtype=dtype, device=device, memory_format=fmt)
    with torch.inference_mode():
        for _ in range(5):
            x_dev.copy_(x_host, non_blocking=True)
            y = module(x_dev).cpu()
        if device.type == "cuda":
            torch.cuda.synchronize()
        lat = []
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            t0 = time.perf_counter_ns()
            x_dev.copy_(x_host, non_blocking=True)
            y = module(x_dev)
            y = y.to("cpu", non_blocking=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            lat.append(time.perf_counter_ns() - t0)
        window = time.perf_counter() - start
    return len(lat) * batch / window, statistics.median(lat) / 1e6


def runner_rate(engine, model, unit, batch, options, seconds):
    runner = engine.build(model, unit, batch, options)
    samples, window = measure([runner], min_duration_s=seconds, min_queries=1, warmup_s=0.1,
                              deadline_s=seconds * 3)
    rate = len(samples) * batch / window
    p50 = statistics.median(s.latency_ns for s in samples) / 1e6
    return rate, p50, runner.options


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--units", default="cuda:0/fp32,cuda:0/fp16")
    parser.add_argument("--batch", default="1,8,32,64,128,256")
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    units = select_units(args.units, discover(with_runtimes=False))
    model = load_model(args.model)
    rows = []
    for unit in units:
        engine = create_engine("torch")
        for batch in [int(b) for b in args.batch.split(",")]:
            plain, eager, graph = [], [], []
            eager_opts = {"cuda_graph": False} if unit.kind == "cuda" else {}
            for _ in range(args.rounds):
                eager.append(runner_rate(engine, model, unit, batch, eager_opts, args.seconds))
                module = engine._modules[next(k for k in engine._modules if k[1] == unit.id)]
                cl = eager[-1][2]["channels_last"]
                plain.append(plain_loop(module, unit, batch, model.input_shape, cl, args.seconds))
                if unit.kind == "cuda":
                    graph.append(runner_rate(engine, model, unit, batch, {}, args.seconds))
            eager_ratios = [e[0] / p[0] for e, p in zip(eager, plain, strict=True)]
            graph_ratios = [g[0] / p[0] for g, p in zip(graph, plain, strict=True)]
            row = {
                "unit": unit.id, "batch": batch, "rounds": args.rounds,
                "plain_items_per_s": statistics.median(r[0] for r in plain),
                "runner_eager_items_per_s": statistics.median(r[0] for r in eager),
                "plain_p50_ms": statistics.median(r[1] for r in plain),
                "runner_eager_p50_ms": statistics.median(r[1] for r in eager),
            }
            row["eager_ratio"] = statistics.median(eager_ratios)
            if graph:
                row["runner_graph_items_per_s"] = statistics.median(r[0] for r in graph)
                row["runner_graph_p50_ms"] = statistics.median(r[1] for r in graph)
                row["graph_ratio"] = statistics.median(graph_ratios)
            rows.append(row)
            print(json.dumps(row), flush=True)
            engine.release()
    print()
    print("| unit | batch | plain loop items/s | runner eager | ratio | runner + CUDA graph | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['unit']} | {r['batch']} | {r['plain_items_per_s']:,.0f} | "
              f"{r['runner_eager_items_per_s']:,.0f} | {r['eager_ratio']:.3f} | "
              f"{r.get('runner_graph_items_per_s', float('nan')):,.0f} | "
              f"{r.get('graph_ratio', float('nan')):.2f} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "runner_overhead.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
