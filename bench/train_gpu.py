"""The GPU training figure: ResNet18/50 on synthetic JPEGs, workers × batch × AMP, NVML energy.

For each network, a grid of 12 configurations (loader workers 2,4,8 × batch 32,64 × fp32/AMP,
pinned memory, data on disk) on 24,000 synthetic JPEGs of 160×160: a third of the grid is
profiled (≤ 10% of an epoch each: one loader over a subset and the subset again, cold then
warm; an epoch of 375-750 minibatches leaves room for 8 workers' ramp and 8 steady minibatches
per half, which batch 128's 188 did not: its short profiles saw the loader's prefetched queue,
not its steady rate), every
configuration's first and later epoch is predicted, and the held-out
configurations are trained for two full epochs each to score the prediction (MAPE of time and
of NVML energy). ResNet50's learned model is transferred from ResNet18's run (`--reference`);
it is kept only where it beats the simple model on ResNet50's own profiles. Everything goes to
`OUT/train-gpu.db` (run kind `train`) and `OUT/train-gpu.json` (every configuration's predicted
vs measured, the MAPE, the profile budget). The validations are planned from the predictions to
fit `--budget-s` (the whole command); those left out are reported. scikit-learn is optional:
without it only the simple model runs.

    python bench/train_gpu.py --out gpu-train             # the figure: ~7 min on a 16-core H100 host
    python bench/train_gpu.py --out gpu-quick --quick     # a smoke check (~1 min)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from infermux.models import ModelSpec
from infermux.store import Store
from infermux.train import DataSpec, Grid, TrainConfig, run_train_predict
from train_common import print_figure, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--models", default="resnet18,resnet50")
    parser.add_argument("--images", type=int, default=24000)
    parser.add_argument("--size", type=int, default=160)
    parser.add_argument("--batch", default="32,64")
    parser.add_argument("--workers", default="2,4,8")
    parser.add_argument("--unit", default="cuda:0")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--profile-share", type=float, default=0.1)
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="the whole command's time: validations are planned to fit it")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke check: 8,000 images of 64×64, batch 64, workers 2,4, fp32 "
                             "and AMP, ResNet18 only")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    method = "auto" if importlib.util.find_spec("sklearn") else "simple"
    models, images, size = args.models.split(","), args.images, args.size
    batch = [int(b) for b in args.batch.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    if args.quick:
        models, images, size, batch, workers = ["resnet18"], 8000, 64, [64], [2, 4]
    started = time.time()
    results: dict[str, dict] = {}
    reference = None
    with Store(out / "train-gpu.db") as store:
        for n, name in enumerate(models):
            left = args.budget_s - (time.time() - started)
            if left < 60:
                print(f"skipping {name}: {left:.0f} s of the {args.budget_s:.0f} s budget left",
                      flush=True)
                continue
            config = TrainConfig(
                ModelSpec(name, input_shape=(3, size, size)),
                Grid(batch=batch, workers=workers, pin_memory=[args.unit.startswith("cuda")],
                     storage=["disk"], precision=["fp32", "amp"]),
                data=DataSpec(count=images, size=size, classes=args.classes),
                unit=args.unit, disk_dir=str(out / "data"), profile_steps=400,
                profile_share=args.profile_share)
            # Validation time: this network's share of what is left, less its profile.
            share = left / (len(models) - n) - 30
            report = run_train_predict(
                config, store=store, validate=None, validate_budget_s=max(30.0, share),
                method=method, reference_run=reference if method != "simple" else None,
                command=" ".join(sys.argv),
                progress=lambda label, f: print(f"[{time.time() - started:5.0f}s] {label}",
                                                flush=True))
            results[name] = summary(report, started, vars(args) | {"images": images,
                                                                     "size": size})
            print_figure(name, results[name])
            if reference is None:
                reference = report.run_id
    (out / "train-gpu.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out / 'train-gpu.json'} in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
