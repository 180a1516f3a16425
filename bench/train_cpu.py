"""The CPU training figure: predicted vs measured epoch time and energy of a small CNN.

Profiles a third of a 24-configuration grid (workers 0-2 × batch × tmpfs/disk × 1/2 cores) for a
few minibatches each, predicts the first and later epoch of every configuration, then trains
every held-out configuration for two full epochs and reports the MAPE. Everything is stored in
the results database (run kind `train`); `--json` writes the whole report.

    python bench/train_cpu.py --images 2000 --size 32 --json train-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from infermux.models import ModelSpec
from infermux.store import Store
from infermux.train import DataSpec, Grid, TrainConfig, run_train_predict
from infermux.units.base import parse_core_set

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", default="16,64")
    parser.add_argument("--model", default=f"{HERE / 'train_models.py'}:small_cnn")
    parser.add_argument("--disk-dir", default=None, help="folder for --storage disk")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--profile-share", type=float, default=0.1)
    parser.add_argument("--cores", default="0;0-1",
                        help="core sets of the grid, ';'-separated, e.g. 0;0-1")
    parser.add_argument("--db", default="train-cpu.db")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    config = TrainConfig(
        ModelSpec(args.model, input_shape=(3, args.size, args.size)),
        Grid(batch=[int(b) for b in args.batch.split(",")], workers=[0, 1, 2],
             storage=["tmpfs", "disk"],
             cores=[parse_core_set(c) for c in args.cores.split(";")]),
        data=DataSpec(count=args.images, size=args.size), disk_dir=args.disk_dir,
        profile_steps=args.profile_steps, profile_share=args.profile_share)
    started = time.time()
    with Store(args.db) as store:
        report = run_train_predict(
            config, store=store, validate=None, command=" ".join(sys.argv),
            progress=lambda label, f: print(f"[{time.time() - started:6.0f}s] {label}",
                                            flush=True))
    data = report.to_dict()
    print(json.dumps({k: data[k] for k in ("run_id", "profiled", "profiled_minibatches",
                                           "model_info", "scores", "profile_s", "validate_s")},
                     indent=1, default=str))
    for row in data["predictions"]:
        print(f"{row['label']:<28} {row['epoch']:<6} {row['method']:<8} "
              f"{row['predicted_s']:8.2f} s  measured {row['measured_s'] or float('nan'):8.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))


if __name__ == "__main__":
    main()
