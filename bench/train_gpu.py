"""The GPU training figure: ResNet18/50 on synthetic JPEGs, workers × batch × AMP, NVML energy.

For each network, a third of the grid is profiled (a cold and a warm pass of a few minibatches
each), every configuration's first and later epoch is predicted, and the held-out
configurations are trained for two full epochs. Raw passes (every minibatch's phases, energy
from NVML's counter) and the predictions go to `OUT/train-gpu.json` and the results database
`OUT/train-gpu.db`, so the prediction can be redone anywhere from the stored runs
(`infermux train-predict --from RUN`). ResNet50's learned model is also transferred from
ResNet18's runs (`--reference`). scikit-learn is optional: without it only the simple model runs.

    python bench/train_gpu.py --out gpu-train          # about 5 minutes on an H100
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--models", default="resnet18,resnet50")
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--batch", default="32,128")
    parser.add_argument("--workers", default="2,4,8")
    parser.add_argument("--unit", default="cuda:0")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="stop starting new networks after this many seconds")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    method = "auto" if importlib.util.find_spec("sklearn") else "simple"
    started = time.time()
    results = {}
    reference = None
    with Store(out / "train-gpu.db") as store:
        for name in args.models.split(","):
            if time.time() - started > args.budget_s:
                print(f"skipping {name}: over the {args.budget_s:.0f} s budget", flush=True)
                continue
            config = TrainConfig(
                ModelSpec(name, input_shape=(3, args.size, args.size)),
                Grid(batch=[int(b) for b in args.batch.split(",")],
                     workers=[int(w) for w in args.workers.split(",")],
                     pin_memory=[True], storage=["disk"], precision=["fp32", "amp"]),
                data=DataSpec(count=args.images, size=args.size, classes=100),
                unit=args.unit, disk_dir=str(out / "data"), profile_steps=24,
                profile_share=0.1)
            report = run_train_predict(
                config, store=store, validate=None, method=method,
                reference_run=reference if method != "simple" else None,
                command=" ".join(sys.argv),
                progress=lambda label, f: print(f"[{time.time() - started:5.0f}s] {label}",
                                                flush=True))
            data = report.to_dict()
            results[name] = data
            print(name, json.dumps(data["scores"]), json.dumps(data["model_info"], default=str),
                  flush=True)
            if reference is None:
                reference = report.run_id
    (out / "train-gpu.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out / 'train-gpu.json'} in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
