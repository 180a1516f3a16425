"""Pipeline partitioning on CPU core sets: predicted vs measured, against single unit and replicas.

Two core-set units (`cpu:0`, `cpu:1` by default), one model, a few batch sizes, all in one run:
the DP's kept pipeline (predicted vs measured throughput, stage balance), the best single unit,
and data-parallel replicas (two independent instances, one per core). Method in
`bench/partition_common.py`.

    PYTHONPATH=src python bench/partition_cpu.py --model mobilenet_v3_small --batch 1,8,32
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from infermux._parse import parse_batches, parse_shape
from infermux.units.cpu import read_cpu_info
from partition_common import compare, markdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--units", default="cpu:0,cpu:1")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--input-shape", default=None)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measure-top", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write every row to this file")
    args = parser.parse_args()
    shape = parse_shape(args.input_shape) if args.input_shape else None
    rows = compare(args.model, args.units, parse_batches(args.batch), input_shape=shape,
                   measure_top=args.measure_top, duration_s=args.duration,
                   warmup_s=args.warmup, rounds=args.rounds)
    cpu = read_cpu_info()
    print(f"\n{cpu['model']}, {len(cpu['usable_cores'])} usable cores, {platform.platform()}")
    print("command: python " + " ".join(sys.argv))
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()
