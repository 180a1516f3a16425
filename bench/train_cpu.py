"""The CPU training figure: predicted vs measured epoch time and energy of a small CNN, one call.

A grid of 24 configurations (loader workers 0,1,2 × batch 16,64 × tmpfs/disk × 1 and 2 cores)
of the small CNN of `bench/train_models.py` on 20,000 synthetic JPEGs of 32×32. A third of the
grid is profiled (≤ 10% of an epoch each), every configuration's first and later epoch is
predicted, and every held-out configuration is trained for two full epochs to score the
prediction (MAPE). Energy is modelled where no RAPL counter is readable (CPU seconds × watts
per busy core, labelled as such). Everything goes to the results database (run kind `train`);
`--json` writes every configuration's predicted vs measured, the MAPE and the profile budget.

    python bench/train_cpu.py --json train-cpu.json                 # the figure (~7 min quiet)
    python bench/train_cpu.py --cores 4,5 --json train-cpu.json     # on cores 4 and 5 of a host
    python bench/train_cpu.py --quick                               # a smoke check (~40 s)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from infermux.models import ModelSpec
from infermux.store import Store
from infermux.train import DataSpec, Grid, TrainConfig, run_train_predict
from train_common import print_figure, summary

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", default="16,64")
    parser.add_argument("--workers", default="0,1,2")
    parser.add_argument("--model", default=f"{HERE / 'train_models.py'}:small_cnn")
    parser.add_argument("--cores", default=None,
                        help="the two cores to use, e.g. 4,5: the grid trains on the first "
                             "alone and on both (default: the first two this process may use)")
    parser.add_argument("--disk-dir", default=None, help="folder for --storage disk")
    parser.add_argument("--profile-share", type=float, default=0.1)
    parser.add_argument("--validate-budget-s", type=float, default=480.0,
                        help="validate only as many held-out configurations as their predicted "
                             "epochs fit in (default 480 s, so the command ends within ~10 min; "
                             "0: all)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke check: 6,000 images, 4 configurations, one core")
    parser.add_argument("--db", default="train-cpu.db")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    usable = sorted(os.sched_getaffinity(0))
    cores = tuple(int(c) for c in args.cores.split(",")) if args.cores else tuple(usable[:2])
    core_sets: list[tuple[int, ...] | None] = [cores[:1], cores[:2]] if len(cores) > 1 \
        else [cores]
    grid = Grid(batch=[int(b) for b in args.batch.split(",")],
                workers=[int(w) for w in args.workers.split(",")],
                storage=["tmpfs", "disk"], cores=core_sets)
    images = args.images
    if args.quick:
        images = 6000
        grid = Grid(batch=[32], workers=[0, 2], storage=["tmpfs", "disk"], cores=[cores[:1]])
    config = TrainConfig(
        ModelSpec(args.model, input_shape=(3, args.size, args.size)), grid,
        data=DataSpec(count=images, size=args.size), disk_dir=args.disk_dir,
        profile_steps=400, profile_share=args.profile_share)
    started = time.time()
    with Store(args.db) as store:
        report = run_train_predict(
            config, store=store, validate=None,
            validate_budget_s=args.validate_budget_s or None,
            command=" ".join(sys.argv),
            progress=lambda label, f: print(f"[{time.time() - started:6.0f}s] {label}",
                                            flush=True))
    fig = summary(report, started, vars(args) | {"images": images, "cores": list(cores)})
    print_figure("cpu", fig)
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1, default=str))
        print(f"wrote {args.json} ({fig['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
