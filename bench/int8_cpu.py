"""int8 (Q/DQ) against fp32 on the CPU, with ONNX Runtime and OpenVINO, side by side in one run.

For each model and engine, two runners are built through infermux on the same cores: the fp32
unit (`cpu:0-1`) and the int8 unit (`cpu:0-1/int8`, the Q/DQ model `infermux.quantize` makes
from calibration data). They are measured in alternating rounds (fp32, int8, fp32, int8, ...)
so that load from other processes falls on both alike; the ratio is int8 / fp32 items/s.

Agreement: the int8 model's top-1 against the fp32 model's on held-out inputs, and the largest
output error relative to the fp32 output's scale. The torchvision models are randomly
initialised here (no weights can be downloaded), so they are calibrated and compared on seeded
noise: their throughput is right, their agreement says little. The trained `digits-cnn`
(characterize's model, trained on first use) is calibrated on its calibration split and scored
on its labelled test split: that is the accuracy check.

    python bench/int8_cpu.py                                   # 2 cores: about 6 minutes
    python bench/int8_cpu.py --models resnet50 --batch 16 --rounds 6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infermux.engines import create_engine
from infermux.models import ModelSpec, load_model
from infermux.units import discover, select_units
from infermux.units.cpu import read_cpu_info


@dataclass
class Row:
    """One (model, engine): fp32 and int8 throughput, measured alternately, and agreement."""

    model: str
    engine: str
    batch: int
    fp32_items_per_s: float
    int8_items_per_s: float
    top1_agreement: float
    max_rel_error: float
    fp32_accuracy: float | None
    int8_accuracy: float | None
    eval_items: int
    weights: str
    build_int8_s: float

    @property
    def ratio(self) -> float:
        """int8 / fp32 throughput."""
        return self.int8_items_per_s / self.fp32_items_per_s


def _items_per_s(runner: Any, seconds: float) -> tuple[int, float]:
    """Batches run back to back for `seconds`: (items, wall seconds)."""
    runner.run()  # the first batch after a new input is not a steady one
    start = time.perf_counter()
    items = 0
    while time.perf_counter() - start < seconds:
        runner.run()
        items += runner.batch
    return items, time.perf_counter() - start


def _outputs(runner: Any, x: np.ndarray) -> np.ndarray:
    b = runner.batch
    out = []
    for i in range(0, len(x), b):
        chunk = x[i:i + b]
        if len(chunk) < b:
            chunk = np.concatenate([chunk, np.zeros((b - len(chunk), *chunk.shape[1:]),
                                                    chunk.dtype)])
        out.append(runner.infer(chunk)[0][: min(b, len(x) - i)])
    return np.concatenate(out)


def measure(model_ref: str, engine_name: str, batch: int, cores: str, rounds: int,
            seconds: float, calibration_items: int, eval_items: int, work: Path) -> Row:
    """Build fp32 and int8 runners for one model on one engine; measure them alternately."""
    model = load_model(ModelSpec(model_ref))
    if model_ref == "digits-cnn":
        from infermux.characterize.data import load_data

        data = load_data("digits", model.input_shape, calibration_items=calibration_items)
        x, labels, calibration = data.x[:eval_items], data.y, data.calibration
        weights = "trained (digits)"
    else:
        rng = np.random.default_rng(1)
        calibration = rng.standard_normal((calibration_items, *model.input_shape),
                                          dtype=np.float32)
        x = rng.standard_normal((eval_items, *model.input_shape), dtype=np.float32)
        labels = None
        weights = "random init, noise inputs"
    calib_file = work / f"{model.name}-calibration.npy"
    np.save(calib_file, calibration)
    found = discover(with_runtimes=False)
    fp32_unit, int8_unit = select_units(f"cpu:{cores},cpu:{cores}/int8", found)
    engine = create_engine(engine_name)
    fp32 = engine.build(model, fp32_unit, batch)
    started = time.perf_counter()
    int8 = engine.build(model, int8_unit, batch, {"calibration_data": str(calib_file),
                                                  "calibration_items": calibration_items})
    build_int8_s = time.perf_counter() - started
    want, got = _outputs(fp32, x), _outputs(int8, x)
    scale = float(np.abs(want).max()) or 1.0
    agreement = float(np.mean(want.argmax(1) == got.argmax(1)))
    totals = {"fp32": [0, 0.0], "int8": [0, 0.0]}
    for _ in range(rounds):
        for name, runner in (("fp32", fp32), ("int8", int8)):
            items, wall = _items_per_s(runner, seconds)
            totals[name][0] += items
            totals[name][1] += wall
    engine.release()
    accuracy = (None, None) if labels is None else (
        float(np.mean(want.argmax(1) == labels[:len(x)])),
        float(np.mean(got.argmax(1) == labels[:len(x)])))
    return Row(model.name, engine_name, batch, totals["fp32"][0] / totals["fp32"][1],
               totals["int8"][0] / totals["int8"][1], agreement,
               float(np.abs(got - want).max()) / scale, accuracy[0], accuracy[1], len(x),
               weights, build_int8_s)


def main() -> None:
    """Run the comparison and print a markdown table (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mobilenet_v3_small,resnet50,digits-cnn")
    parser.add_argument("--engines", default="onnxruntime,openvino")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cores", default="0-1", help="core set of both units")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per pair")
    parser.add_argument("--seconds", type=float, default=3.0, help="per runner per round")
    parser.add_argument("--calibration-items", type=int, default=64)
    parser.add_argument("--eval-items", type=int, default=256)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as work:
        for model in args.models.split(","):
            for engine in args.engines.split(","):
                row = measure(model, engine, args.batch, args.cores, args.rounds, args.seconds,
                              args.calibration_items, args.eval_items, Path(work))
                rows.append(row)
                print(f"# {model} {engine}: {row.ratio:.2f}x", file=sys.stderr, flush=True)
    print(f"command: python bench/int8_cpu.py {shlex.join(sys.argv[1:])}")
    print(f"machine: {read_cpu_info()['model'] or platform.machine()}, "
          f"{len(os.sched_getaffinity(0))} usable cores, load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print()
    print("| model | engine | batch | fp32 items/s | int8 items/s | int8/fp32 | top-1 agreement "
          "| max rel. error | accuracy fp32 → int8 | weights |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = ("–" if r.fp32_accuracy is None else
               f"{r.fp32_accuracy:.1%} → {r.int8_accuracy:.1%}")
        print(f"| {r.model} | {r.engine} | {r.batch} | {r.fp32_items_per_s:.1f} | "
              f"{r.int8_items_per_s:.1f} | {r.ratio:.2f}× | {r.top1_agreement:.1%} of "
              f"{r.eval_items} | {r.max_rel_error:.3f} | {acc} | {r.weights} |")
    if args.json:
        Path(args.json).write_text(json.dumps([{**asdict(r), "ratio": r.ratio} for r in rows],
                                              indent=2))


if __name__ == "__main__":
    main()
