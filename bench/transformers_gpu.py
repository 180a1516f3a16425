"""BERT-base at sequence 128 in fp16 on one GPU: plain eager PyTorch against the best torch options.

Side by side in one process, at each batch size: the torch engine with no CUDA graph and no
compile (plain eager fp16, the baseline), with one captured CUDA graph per (batch, length)
(the engine's GPU default), and with `torch.compile` (`default` mode, its kernels replayed in the
runner's CUDA graph). Every point is a `run_bench` point: warm-up excluded, device-synchronized,
host→device copies of the int64 ids and masks counted, minimum duration and query count, outputs
checked against the fp32 CPU reference. Needs the `hf` extra (transformers); nothing is
downloaded (the network is BertConfig's defaults with random weights).

    python bench/transformers_gpu.py out.json
    python bench/transformers_gpu.py out.json --model hf:distilbert --batches 1,32 --seq 128
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

from infermux.bench import BenchConfig, run_bench
from infermux.models import ModelSpec

VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {"cuda_graph": False},
    "cuda_graph": {"cuda_graph": True},
    "compile_default": {"compile": "default"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--model", default="hf:bert-base")
    parser.add_argument("--unit", default="cuda:0/fp16")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--min-duration", type=float, default=3.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    started = time.perf_counter()
    runs: dict[str, Any] = {}
    for name in args.variants.split(","):
        config = BenchConfig(ModelSpec(args.model), units=args.unit, batches=batches,
                             engine="torch", min_duration_s=args.min_duration, min_queries=256,
                             warmup_s=1.0, options=VARIANTS[name], seq_buckets=[args.seq],
                             telemetry_interval_s=None)
        t0 = time.perf_counter()
        report = run_bench(config)
        runs[name] = {"wall_s": time.perf_counter() - t0, **report.to_dict()}
        for r in runs[name]["results"]:
            print(f"{name:16s} b{r['batch']:<4d} seq{r['seq_len']} {r['status']:5s} "
                  f"{(r['items_per_s'] or 0):10.1f} items/s {(r['tokens_per_s'] or 0):12.0f} tok/s "
                  f"p99 {r.get('p99_ms') or 0:7.2f} ms build {r['build_s']:6.1f} s "
                  f"agree {(r['agreement'] or {}).get('status')} {r['error'] or ''}", flush=True)
    table = []
    for batch in batches:
        row: dict[str, Any] = {"batch": batch, "seq": args.seq}
        for name, run in runs.items():
            point = next(r for r in run["results"] if r["batch"] == batch)
            row[f"{name}_items_per_s"] = point["items_per_s"] if point["status"] == "ok" else None
            row[f"{name}_valid"] = point["valid"]
        base = row.get("eager_items_per_s")
        for name in runs:
            value = row.get(f"{name}_items_per_s")
            row[f"{name}_vs_eager"] = value / base if value and base else None
        table.append(row)
    best_eager = max((r["eager_items_per_s"] or 0 for r in table), default=0) if "eager" in runs else 0
    best = {name: max((r[f"{name}_items_per_s"] or 0 for r in table), default=0) for name in runs}
    summary = {"best_items_per_s": best,
               "best_vs_best_eager": {n: (v / best_eager if best_eager else None)
                                      for n, v in best.items()}}
    print(json.dumps({"table": table, "summary": summary}, indent=1))
    with open(args.out, "w") as f:
        json.dump({"command": "python bench/transformers_gpu.py " + " ".join(
                       f"{k}={v}" for k, v in vars(args).items()),
                   "host": platform.node(), "wall_s": time.perf_counter() - started,
                   "table": table, "summary": summary, "runs": runs}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
