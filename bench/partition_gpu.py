"""Pipeline partitioning with GPU units: GPU + CPU, and two GPUs when the machine has them.

Same comparison as `bench/partition_cpu.py` (method in `bench/partition_common.py`): the DP's kept
pipeline (predicted vs measured, stage balance) against the best single unit and data-parallel
instances, one per unit. Sized to finish in about four minutes on a 16-core H200 host:

    PYTHONPATH=src python3 bench/partition_gpu.py --json /tmp/partition_gpu.json

`--smoke` runs the same logic on two CPU cores with a small input, so it can be checked on a
machine without a GPU before it is run on one.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from infermux._parse import parse_batches, parse_shape
from infermux.units.cpu import read_cpu_info
from partition_common import compare, markdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--mode", default="fp16", help="GPU numeric mode (fp32, tf32, fp16, bf16)")
    parser.add_argument("--cpu", default="cpu", help="the CPU unit paired with the GPU")
    parser.add_argument("--batch", default="8,64", help="batch sizes for GPU + CPU")
    parser.add_argument("--batch-2gpu", default="64", help="batch sizes for two GPUs")
    parser.add_argument("--input-shape", default=None)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--measure-top", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="run the logic on two CPU cores")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    shape = parse_shape(args.input_shape) if args.input_shape else None
    runs: list[tuple[str, str, list[int]]] = []
    if args.smoke:
        args.model, shape = "mobilenet_v3_small", shape or (3, 64, 64)
        args.duration, args.warmup = 0.3, 0.1
        runs.append(("smoke: two CPU cores", "cpu:0,cpu:1", [2]))
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA GPU here: run with --smoke to check the logic on the CPU")
        runs.append(("GPU + CPU", f"cuda:0/{args.mode},{args.cpu}", parse_batches(args.batch)))
        if torch.cuda.device_count() >= 2:
            runs.append(("two GPUs", f"cuda:0/{args.mode},cuda:1/{args.mode}",
                         parse_batches(args.batch_2gpu)))
    results: dict[str, list] = {}
    for title, units, batches in runs:
        print(f"== {title}: {units}, batch {batches}", flush=True)
        results[title] = compare(args.model, units, batches, input_shape=shape,
                                 measure_top=args.measure_top, duration_s=args.duration,
                                 warmup_s=args.warmup, rounds=args.rounds)
    cpu = read_cpu_info()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"\n{cpu['model']}, {len(cpu['usable_cores'])} usable cores; GPUs: {gpus or 'none'}; "
          f"torch {torch.__version__}; {platform.platform()}")
    print("command: python3 " + " ".join(sys.argv))
    for title, rows in results.items():
        print(f"\n### {title}\n{markdown(rows)}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
