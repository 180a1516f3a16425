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

The machine may be shared: the variants run in `--rounds` passes, every other pass in reverse
order. Two ratios to eager are reported per variant: its best pass over eager's best pass (the
other processes only ever slow a pass down; the best per batch, and the best fp32 one, are
ranked by it), and the median of each pass's ratio to the eager figure of the same pass; the
load average is recorded with every row.

    python bench/transformers_cpu.py out.json                       # 2 cores: about 5 minutes
    python bench/transformers_cpu.py out.json --batches 1,8 --seq 128 --rounds 3

Engines that are not installed are skipped with a note.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
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
    parser.add_argument("--duration", type=float, default=2.0, help="measured seconds a point")
    parser.add_argument("--min-queries", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2,
                        help="passes over the variants, alternating their order")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants {','.join(unknown)}: use some of {','.join(VARIANTS)}")
    started = time.perf_counter()
    # The other processes' load decides how far these figures are from a quiet machine's.
    load_at_start = os.getloadavg()
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    missing = {n for n in names if importlib.util.find_spec(_MODULES[VARIANTS[n][0]]) is None}
    notes += [f"{n}: {VARIANTS[n][0]} is not installed" for n in sorted(missing)]
    names = [n for n in names if n not in missing]
    for round_no in range(args.rounds):
        # Every other round runs the variants backwards: a load that drifts during a round
        # (the machine is shared) then weighs on every variant alike.
        for name in names if round_no % 2 == 0 else names[::-1]:
            rows += _measure(name, round_no, batches, args)
    table = []
    for batch in batches:
        here = [r for r in rows if r["batch"] == batch and r["items_per_s"]]
        eager_by_round = {r["round"]: r["items_per_s"] for r in here
                          if r["variant"] == "torch eager"}
        per_variant: dict[str, dict[str, Any]] = {}
        for name in names:
            mine = [r for r in here if r["variant"] == name]
            if not mine:
                continue
            ratios = [r["items_per_s"] / eager_by_round[r["round"]] for r in mine
                      if r["round"] in eager_by_round]
            per_variant[name] = {
                "unit": mine[0]["unit"], "precision": mine[0]["precision"],
                "items_per_s": statistics.median(r["items_per_s"] for r in mine),
                "rounds_items_per_s": [r["items_per_s"] for r in mine],
                # Each round's figure over the eager figure of the same round, then the median.
                "vs_eager": statistics.median(ratios) if ratios else None,
                # Other processes only ever slow a run down: each variant's best round over
                # eager's best round is the figure least touched by them.
                "best_round_vs_eager": (max(r["items_per_s"] for r in mine)
                                        / max(eager_by_round.values())
                                        if eager_by_round else None)}
        ranked = sorted(((v["best_round_vs_eager"] or 0.0, n) for n, v in per_variant.items()),
                        reverse=True)
        fp32 = [(x, n) for x, n in ranked if not per_variant[n]["unit"].endswith("/int8")]
        eager = per_variant.get("torch eager", {}).get("items_per_s")
        table.append({"batch": batch, "seq": args.seq, "eager_items_per_s": eager,
                      "best": ranked[0][1] if ranked else None,
                      "best_vs_eager": ranked[0][0] if ranked else None,
                      "best_fp32": fp32[0][1] if fp32 else None,
                      "best_fp32_vs_eager": fp32[0][0] if fp32 else None,
                      "variants": per_variant})
    out = {"command": "python " + " ".join(sys.argv), "host": platform.node(),
           "cpu_count": os.cpu_count(), "load_avg_at_start": load_at_start,
           "load_avg_at_end": os.getloadavg(),
           "wall_s": time.perf_counter() - started, "table": table, "rows": rows,
           "notes": notes}
    for line in table:
        print(f"batch {line['batch']}: eager {line['eager_items_per_s'] or 0:.2f} items/s; "
              f"best {line['best']} {line['best_vs_eager'] or 0:.2f}x; best fp32 "
              f"{line['best_fp32']} {line['best_fp32_vs_eager'] or 0:.2f}x")
        for name, v in line["variants"].items():
            print(f"  {name:31s} {v['items_per_s']:8.2f} items/s  best round "
                  f"{v['best_round_vs_eager'] or 0:5.2f}x  median ratio {v['vs_eager'] or 0:5.2f}x "
                  "rounds " + " ".join(f"{x:.2f}" for x in v["rounds_items_per_s"]))
    print(f"load average {load_at_start} -> {out['load_avg_at_end']}, {out['wall_s']:.0f} s")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)


def _measure(name: str, round_no: int, batches: list[int],
             args: argparse.Namespace) -> list[dict[str, Any]]:
    """One variant at every batch, through `run_bench`: its rows."""
    engine, unit, options = VARIANTS[name]
    if args.cores:
        base, _, mode = unit.partition("/")
        unit = f"{base}:{args.cores}" + (f"/{mode}" if mode else "")
    config = BenchConfig(ModelSpec(args.model), units=unit, batches=batches, engine=engine,
                         min_duration_s=args.duration, min_queries=args.min_queries,
                         warmup_s=1.0, options=options, seq_buckets=[args.seq],
                         telemetry_interval_s=None, max_duration_s=max(30.0, 3 * args.duration))
    rows = []
    for point in run_bench(config).to_dict()["results"]:
        ok = point["status"] == "ok"
        resolved = point["options"] or {}
        row = {"variant": name, "round": round_no, "engine": engine, "unit": unit,
               "precision": resolved.get("precision"), "options": options,
               "fused_operators": resolved.get("fused_operators"),
               "quantize_method": resolved.get("quantize_method"),
               "batch": point["batch"], "seq": point["seq_len"], "status": point["status"],
               "items_per_s": point["items_per_s"] if ok else None,
               "tokens_per_s": point["tokens_per_s"], "p99_ms": point.get("p99_ms"),
               "build_s": point["build_s"], "valid": point["valid"],
               "agreement": (point.get("agreement") or {}).get("status"),
               "rel_err": (point.get("agreement") or {}).get("rel_err"),
               "error": point["error"], "load_avg": os.getloadavg()[0]}
        rows.append(row)
        print(f"r{round_no} {name:31s} b{row['batch']:<3d} seq{row['seq']} {row['status']:5s} "
              f"{row['items_per_s'] or 0:8.2f} items/s p99 {row['p99_ms'] or 0:8.1f} ms "
              f"build {row['build_s']:5.1f} s agree {row['agreement']} "
              f"load {row['load_avg']:.1f} {row['error'] or ''}", flush=True)
    return rows


if __name__ == "__main__":
    main()
