"""DistilBERT on the CPU: plain PyTorch eager against ONNX Runtime and OpenVINO, in one run.

Side by side in one process, at each batch size and sequence length: the torch engine (eager,
the baseline), ONNX Runtime and OpenVINO on the same network (`hf:distilbert`: the package's
config defaults with random weights, nothing downloaded), each through `run_bench` — the path
`infermux bench` takes: warm-up excluded, minimum duration and query count, int64 ids and masks
copied in every batch, outputs checked against the fp32 PyTorch reference (int8 within the
int8 tolerance). Each variant is labelled with its engine, unit (precision) and options:

- ONNX Runtime fp32 as exported, and with its transformer fusions (`transformer_fusion`:
  fused Attention, embedding and skip LayerNorms, BiasGelu);
- ONNX Runtime int8 on the `cpu/int8` unit: dynamic quantization (int8 MatMul weights per
  channel, activations quantized per batch), plain and fused;
- OpenVINO fp32, compiled at the batch's static shape, with its throughput hint (2 streams on
  2 cores) and its latency hint (one stream over both cores).

The best figure per batch, and the best fp32 one, are divided by eager's.

    python bench/transformers_cpu.py out.json                       # 2 cores: about 5 minutes
    python bench/transformers_cpu.py out.json --batches 1,8 --seq 128 --duration 3

Engines that are not installed are skipped with a note.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from typing import Any

from infermux.bench import BenchConfig, run_bench
from infermux.models import ModelSpec

#: (engine, unit, options) measured; the first is the baseline (plain eager, torch's defaults).
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "torch eager": ("torch", "cpu", {}),
    "onnxruntime": ("onnxruntime", "cpu", {}),
    "onnxruntime fused": ("onnxruntime", "cpu", {"transformer_fusion": True}),
    "onnxruntime int8 dynamic": ("onnxruntime", "cpu/int8", {}),
    "onnxruntime int8 dynamic fused": ("onnxruntime", "cpu/int8", {"transformer_fusion": True}),
    "openvino throughput": ("openvino", "cpu", {}),
    "openvino latency": ("openvino", "cpu", {"hint": "latency"}),
}
_MODULES = {"torch": "torch", "onnxruntime": "onnxruntime", "openvino": "openvino"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--model", default="hf:distilbert")
    parser.add_argument("--cores", default="", help="a core set (e.g. 0-1) for every unit")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds a point")
    parser.add_argument("--min-queries", type=int, default=16)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    started = time.perf_counter()
    # The other processes' load decides how far these figures are from a quiet machine's.
    load_at_start = os.getloadavg()
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for name in args.variants.split(","):
        engine, unit, options = VARIANTS[name]
        if args.cores:
            base, _, mode = unit.partition("/")
            unit = f"{base}:{args.cores}" + (f"/{mode}" if mode else "")
        if importlib.util.find_spec(_MODULES[engine]) is None:
            notes.append(f"{name}: {engine} is not installed")
            continue
        config = BenchConfig(ModelSpec(args.model), units=unit, batches=batches,
                             engine=engine, min_duration_s=args.duration,
                             min_queries=args.min_queries, warmup_s=1.0, options=options,
                             seq_buckets=[args.seq], telemetry_interval_s=None,
                             max_duration_s=max(30.0, 3 * args.duration))
        t0 = time.perf_counter()
        report = run_bench(config)
        for point in report.to_dict()["results"]:
            row = {"variant": name, "engine": engine, "unit": unit,
                   "precision": (point["options"] or {}).get("precision"), "options": options,
                   "fused_operators": (point["options"] or {}).get("fused_operators"),
                   "quantize_method": (point["options"] or {}).get("quantize_method"),
                   "batch": point["batch"], "seq": point["seq_len"], "status": point["status"],
                   "items_per_s": point["items_per_s"] if point["status"] == "ok" else None,
                   "tokens_per_s": point["tokens_per_s"], "p99_ms": point.get("p99_ms"),
                   "build_s": point["build_s"], "valid": point["valid"],
                   "agreement": (point.get("agreement") or {}).get("status"),
                   "error": point["error"]}
            rows.append(row)
            print(f"{name:31s} b{row['batch']:<3d} seq{row['seq']} {row['status']:5s} "
                  f"{row['items_per_s'] or 0:9.1f} items/s p99 {row['p99_ms'] or 0:8.1f} ms "
                  f"build {row['build_s']:5.1f} s agree {row['agreement']} "
                  f"{row['error'] or ''}", flush=True)
        notes.append(f"{name}: {time.perf_counter() - t0:.0f} s")
    table = []
    for batch in batches:
        here = [r for r in rows if r["batch"] == batch and r["items_per_s"]]
        eager = next((r["items_per_s"] for r in here if r["variant"] == "torch eager"), None)
        best = max(here, key=lambda r: r["items_per_s"], default=None)
        fp32 = max((r for r in here if not r["unit"].endswith("/int8")),
                   key=lambda r: r["items_per_s"], default=None)
        table.append({"batch": batch, "seq": args.seq, "eager_items_per_s": eager,
                      "best": best["variant"] if best else None,
                      "best_items_per_s": best["items_per_s"] if best else None,
                      "best_vs_eager": (best["items_per_s"] / eager
                                        if best and eager else None),
                      "best_fp32": fp32["variant"] if fp32 else None,
                      "best_fp32_vs_eager": (fp32["items_per_s"] / eager
                                             if fp32 and eager else None),
                      "per_variant_vs_eager": {r["variant"]: (r["items_per_s"] / eager
                                                              if eager else None)
                                               for r in here}})
    out = {"command": "python " + " ".join(sys.argv), "host": platform.node(),
           "cpu_count": os.cpu_count(), "load_avg_at_start": load_at_start,
           "load_avg_at_end": os.getloadavg(),
           "wall_s": time.perf_counter() - started, "table": table, "rows": rows,
           "notes": notes}
    print(json.dumps({"table": table, "load_avg_at_end": out["load_avg_at_end"]}, indent=1))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
