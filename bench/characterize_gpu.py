"""Determinism of ResNet50 on one GPU: each precision × eager and torch.compile, rebuilt N times.

Eager with cudnn.benchmark on and off, and torch.compile (default mode); every configuration is
built N times, each build in a fresh process with a fresh cache (`infermux.characterize`).

ResNet50 has random weights (nothing can be downloaded), so the inputs are seeded synthetic
images without labels: accuracy against labels is not scored; agreement with the fp32 CPU
reference, distinct outputs across builds, largest difference, top-1 flips, run-to-run and
batch-size dependence, latency spread across builds, and which knob removes each variance (and
its throughput cost) all are.

    python bench/characterize_gpu.py --json characterize-h100.json
    python bench/characterize_gpu.py --builds 5 --compile-precisions fp16,bf16,tf32,fp32 --json x.json
    python bench/characterize_gpu.py --smoke --json smoke.json     # the same logic on the CPU, tiny

Default cost, estimated (not yet timed on a GPU): about 6 minutes on an H100. Eager: 4
precisions × 2 configurations × 3 builds of ~8 s (process start, CUDA start, build, 128 items,
timing), plus the knob studies of what varies (a knob study that is another configuration's
baseline — cudnn.benchmark off — is that baseline, not built again). torch.compile: fp16 × 2
builds, each compiling one batch size from a cold cache (that is the point: rebuild variance
needs cold builds), without batch-size dependence (each size would be another compilation) and
without knob studies unless `--compile-causes` (each is 2 more compilations per knob).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

EAGER = {"eager+benchmark": {"cudnn_benchmark": True}, "eager": {"cudnn_benchmark": False}}
COMPILE = {"compile": {"compile": "default"}}


def synthetic_images(n: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Seeded smooth random images (low-frequency noise upsampled), ImageNet-normalised."""
    import torch
    from torch.nn import functional

    g = torch.Generator().manual_seed(seed)
    c, h, w = shape
    low = torch.rand((n, c, max(2, h // 16), max(2, w // 16)), generator=g)
    x = functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)
    x = (x + 0.1 * torch.rand((n, c, h, w), generator=g)).clamp(0, 1)
    mean = torch.tensor([0.485, 0.456, 0.406][:c] if c == 3 else [0.5] * c).view(1, c, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225][:c] if c == 3 else [0.5] * c).view(1, c, 1, 1)
    return ((x - mean) / std).numpy().astype(np.float32)


def _summary(report: dict[str, Any]) -> list[str]:
    lines = []
    for v in report["variants"]:
        det = v["determinism"]
        rebuild = det.get("rebuild") or {}
        lat = det.get("latency") or {}
        removed = "; ".join(f"{kind}: {', '.join(knobs) or 'no knob'}"
                            for kind, knobs in v["removed_by"].items()) or "no variance"
        costs = ", ".join(f"{c['knob']} {c['throughput_ratio']:.2f}×" for c in v["causes"]
                          if c.get("throughput_ratio"))
        agree = (v.get("accuracy") or {}).get("agree_top1") or {}
        lines.append(
            f"{v['unit']:>12} {v['config']:>16} | builds {det['builds_ok']}/{det['builds']} "
            f"distinct {rebuild.get('distinct', '–')} max diff {rebuild.get('max_abs_diff', 0):.3g} "
            f"flips {rebuild.get('top1_flips', '–')} | agree fp32 {agree.get('value', 0):.3f} | "
            f"latency {lat.get('median_ms', 0):.3g} ms spread {lat.get('spread') or 0:.1%} | "
            f"{removed}" + (f" | items/s with knob: {costs}" if costs else "")
            + (f" | error: {v['error']}" if v.get("error") else ""))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", dest="json_path", help="write the whole result here")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index")
    parser.add_argument("--builds", type=int, default=3, help="builds per eager configuration")
    parser.add_argument("--precisions", default="fp32,tf32,fp16,bf16")
    parser.add_argument("--compile-precisions", default="fp16",
                        help="precisions built with torch.compile (default mode), or none")
    parser.add_argument("--compile-builds", type=int, default=2)
    parser.add_argument("--items", type=int, default=128, help="synthetic images per build")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--no-causes", action="store_true", help="skip the knob studies")
    parser.add_argument("--compile-causes", action="store_true",
                        help="knob studies for torch.compile too (deterministic, autotuning off, "
                             "shared cache): 2 compilations per knob and precision")
    parser.add_argument("--db", help="also store the runs in this results database")
    parser.add_argument("--smoke", action="store_true",
                        help="the same logic on the CPU: resnet18 at 3x32x32, 2 builds, 16 items")
    args = parser.parse_args()

    from infermux.characterize import CharacterizeConfig, run_characterize
    from infermux.models import ModelSpec
    from infermux.store import open_store

    started = time.perf_counter()
    if args.smoke:
        model, shape = "resnet18", (3, 32, 32)
        args.builds, args.compile_builds, args.items, args.batch = 2, 2, 16, 8
        eager_units = "cpu"
        compile_units = "cpu" if args.compile_precisions not in ("", "none") and (
            "--compile-precisions" in sys.argv) else ""
    else:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA GPU here: run with --smoke for the CPU check", file=sys.stderr)
            return 2
        model, shape = "resnet50", (3, 224, 224)
        eager_units = ",".join(f"cuda:{args.device}/{p}" for p in args.precisions.split(",") if p)
        compile_units = ",".join(f"cuda:{args.device}/{p}"
                                 for p in args.compile_precisions.split(",")
                                 if p and p != "none")
    results: dict[str, Any] = {"model": model, "weights": "random (no download possible)",
                               "input_shape": list(shape), "smoke": args.smoke, "runs": []}
    store = open_store(args.db) if args.db else None
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "synthetic.npz"
        np.savez(data, x=synthetic_images(args.items + 8, shape))
        plan = [("eager", eager_units, EAGER, args.builds, True)]
        if compile_units:
            plan.append(("compile", compile_units, COMPILE, args.compile_builds, False))
        for name, units, configs, builds, eager in plan:
            t0 = time.perf_counter()
            config = CharacterizeConfig(
                ModelSpec(model, None, shape), units=units, engine="torch", builds=builds,
                data=str(data), items=args.items, calibration_items=8, batch=args.batch,
                batch_sizes=(), batch_dependence=eager, int8=False,
                causes=not args.no_causes and (eager or args.compile_causes), configs=configs,
                build_timeout_s=900)

            def progress(label: str, fraction: float, name: str = name, t0: float = t0) -> None:
                print(f"[{name} {time.perf_counter() - t0:6.0f}s {fraction:4.0%}] {label}",
                      flush=True)

            report = run_characterize(config, store=store, progress=progress,
                                      command="bench/characterize_gpu.py").to_dict()
            report["wall_s"] = time.perf_counter() - t0
            results["runs"].append({"name": name, **report})
            print(f"== {name}: {report['wall_s']:.0f} s")
            for line in _summary(report):
                print(line)
    if store is not None:
        store.close()
    results["wall_s"] = time.perf_counter() - started
    print(f"total {results['wall_s']:.0f} s")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=1, default=str))
        print(f"written to {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
