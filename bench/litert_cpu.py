"""LiteRT fp32/int8 beside PyTorch, ONNX Runtime and OpenVINO on the CPU, side by side in one run.

Every engine runs the same network (mobilenet_v3_small by default, seeded random weights saved to
a file so each engine, and LiteRT's conversion cache, sees the same weights) through infermux's
bench (`run_bench`, the path `infermux bench` takes) on the whole-CPU unit, at each batch size.
Rounds interleave the engines, so a load change on the machine hits all of them alike; the
figure per engine is the median over rounds, and the ratio is against PyTorch eager (the plain
baseline) measured in the same round.

    python bench/litert_cpu.py                               # 2 cores: about 6 minutes
    python bench/litert_cpu.py --batch 1,8 --duration 5 --rounds 3 --json out.json

The tuner's choice among the same engines (the factory below keeps the weights fixed, so
LiteRT's conversions are cached between the tuner's processes):

    infermux tune -m bench/litert_cpu.py:seeded_mobilenet_v3_small --units cpu --engine auto \
        --batch 1,8 --max-instances 1 --no-fine-tune --no-pipelines --budget 6m

LiteRT int8 is static post-training quantization calibrated on seeded noise: the timing is real,
the accuracy of a randomly initialised network is not a question here. Conversions are cached
(`$INFERMUX_CACHE_DIR/litert`), so a second run skips them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torchvision

from infermux.bench import BenchConfig, run_bench
from infermux.models import ModelSpec
from infermux.units import discover

#: (label, engine, options) measured in each round; the first is the baseline.
VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    ("torch eager fp32", "torch", {}),
    ("onnxruntime fp32", "onnxruntime", {}),
    ("openvino (cpu unit)", "openvino", {}),
    ("litert fp32 (XNNPACK)", "litert", {}),
    ("litert int8 (XNNPACK)", "litert", {"precision": "int8"}),
]
_MODULES = {"onnxruntime": "onnxruntime", "openvino": "openvino", "litert": "ai_edge_litert"}


def seeded_mobilenet_v3_small() -> torch.nn.Module:
    """mobilenet_v3_small with seeded random weights: the same network in every process.

    A factory for `infermux tune -m bench/litert_cpu.py:seeded_mobilenet_v3_small`, so the
    tuner's processes hit LiteRT's conversion cache instead of converting a new network.
    """
    torch.manual_seed(0)
    return torchvision.models.mobilenet_v3_small(weights=None)


def _weights(model: str, folder: Path) -> str:
    torch.manual_seed(0)
    net = torchvision.models.get_model(model, weights=None)
    path = folder / f"{model}-seed0.pt"
    torch.save(net.state_dict(), path)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per point")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--units", default="cpu")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    variants = [v for v in VARIANTS
                if v[1] not in _MODULES or importlib.util.find_spec(_MODULES[v[1]]) is not None]
    skipped = sorted({v[1] for v in VARIANTS} - {v[1] for v in variants})
    found = discover(with_runtimes=False)
    cpu = found.cpu
    tmp = Path(tempfile.mkdtemp(prefix="litert-bench-"))
    weights = _weights(args.model, tmp)
    results: dict[tuple[str, int], list[float]] = {}
    agreement: dict[tuple[str, int], str] = {}
    for round_ in range(args.rounds):
        for label, engine, options in variants:
            config = BenchConfig(model=ModelSpec(args.model, weights=weights), units=args.units,
                                 batches=batches, engine=engine, options=options,
                                 min_duration_s=args.duration, min_queries=64, warmup_s=1.0,
                                 telemetry_interval_s=None, check_agreement=round_ == 0)
            report = run_bench(config)
            for point in report.measurements:
                if point.status != "ok" or point.throughput is None:
                    print(f"{label} batch {point.batch}: {point.status}", file=sys.stderr)
                    continue
                results.setdefault((label, point.batch), []).append(point.throughput)
                if round_ == 0:
                    a = point.agreement or {}
                    agreement[(label, point.batch)] = (
                        f"{a.get('status', '–')}" + (f" ({a['rel_err']:.0e})"
                                                      if a.get("rel_err") is not None else ""))
            print(f"round {round_ + 1}/{args.rounds}: {label} done", file=sys.stderr)
    rows = []
    for batch in batches:
        base = results.get((variants[0][0], batch))
        for label, _, _ in variants:
            runs = results.get((label, batch))
            if not runs:
                continue
            median = statistics.median(runs)
            ratio = [r / b for r, b in zip(runs, base or [], strict=False)]
            rows.append({"batch": batch, "engine": label, "items_per_s": median,
                         "runs": runs, "vs_torch": statistics.median(ratio) if ratio else None,
                         "agreement": agreement.get((label, batch), "–")})
    print(f"\n{args.model} on {cpu['model']} ({len(cpu['usable_cores'])} cores), "
          f"python {platform.python_version()}, torch {torch.__version__}")
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    if skipped:
        print(f"not installed, skipped: {', '.join(skipped)}")
    print(f"\n| batch | engine | items/s (median of {args.rounds}) | vs torch eager | agreement |")
    print("|---:|---|---:|---:|---|")
    for r in rows:
        vs = f"{r['vs_torch']:.2f}×" if r["vs_torch"] else "–"
        print(f"| {r['batch']} | {r['engine']} | {r['items_per_s']:.1f} | {vs} | {r['agreement']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "cpu": cpu, "rows": rows,
                                               "pid": os.getpid()}, indent=2))


if __name__ == "__main__":
    main()
