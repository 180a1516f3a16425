"""PyTorch eager vs ONNX Runtime vs OpenVINO on the CPU, through infermux and by hand, in one run.

For each model and batch size, every engine is measured through infermux (`run_bench`, the
path `infermux bench` takes, agreement check included) and right after it "by hand": the
runtime's own plain loop with its best settings, on the same ONNX file:
- PyTorch: `torch.inference_mode()` loop, threads = the cores;
- ONNX Runtime: one `InferenceSession` (all graph optimisations, intra-op threads = the cores),
  `session.run` in a loop;
- OpenVINO: a compiled model with the throughput hint and an `AsyncInferQueue` of the optimal
  number of requests kept full, as benchmark_app does.
The ratio infermux / by hand shows what infermux costs (target: at least 0.95).

    python bench/engines_cpu.py --duration 5            # 2 cores: about 6 minutes
    python bench/engines_cpu.py --duration 10 --repeats 2 --json out.json

Runtimes that are not installed are skipped with a note.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from infermux.bench import BenchConfig, run_bench
from infermux.export import export_onnx
from infermux.models import ModelSpec, load_model
from infermux.units import discover


@dataclass
class Row:
    """One (model, batch, engine) pair: infermux's throughput and the by-hand one."""

    model: str
    batch: int
    engine: str
    unit: str
    precision: str
    infermux_items_per_s: float | None
    by_hand_items_per_s: float | None
    agreement: str
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """Infermux / by hand."""
        if self.infermux_items_per_s and self.by_hand_items_per_s:
            return self.infermux_items_per_s / self.by_hand_items_per_s
        return None


def _loop(step: Any, batch: int, duration_s: float, warmup_s: float) -> float:
    """Items per second of `step()` over `duration_s`, after `warmup_s` (at least 3 calls)."""
    start = time.perf_counter()
    count = 0
    while count < 3 or time.perf_counter() - start < warmup_s:
        step()
        count += 1
    count = 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration_s:
        step()
        count += 1
    return count * batch / (time.perf_counter() - start)


def by_hand_torch(module: Any, shape: tuple[int, ...], threads: int, duration_s: float,
                  warmup_s: float) -> float:
    import torch

    torch.set_num_threads(threads)
    x = torch.randn(shape)
    with torch.inference_mode():
        return _loop(lambda: module(x), shape[0], duration_s, warmup_s)


def by_hand_onnxruntime(path: str, shape: tuple[int, ...], threads: int, duration_s: float,
                        warmup_s: float) -> float:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(path, sess_options=so, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    return _loop(lambda: session.run(None, {name: x}), shape[0], duration_s, warmup_s)


def by_hand_openvino(path: str, shape: tuple[int, ...], precision: str | None, threads: int,
                     duration_s: float, warmup_s: float) -> float:
    """benchmark_app's method: throughput hint, optimal requests, the queue kept full."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(path)
    model.reshape({model.inputs[0].get_any_name(): ov.PartialShape(list(shape))})
    config = {"PERFORMANCE_HINT": "THROUGHPUT", "INFERENCE_NUM_THREADS": str(threads)}
    if precision:
        config["INFERENCE_PRECISION_HINT"] = precision
    compiled = core.compile_model(model, "CPU", config)
    requests = int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
    queue = ov.AsyncInferQueue(compiled, requests)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for i in range(requests):
        queue[i].set_input_tensor(ov.Tensor(x))
    done = [0]

    def finished(_request: Any, _userdata: Any) -> None:
        done[0] += 1

    queue.set_callback(finished)

    def fill_for(seconds: float) -> tuple[int, float]:
        queue.wait_all()
        before = done[0]
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            queue.start_async()  # blocks until a request is free: the pool stays full
        queue.wait_all()
        return done[0] - before, time.perf_counter() - start

    fill_for(max(warmup_s, 0.1))
    completed, elapsed = fill_for(duration_s)
    return completed * shape[0] / elapsed


def through_infermux(model: str, unit: str, engine: str, batch: int, options: dict[str, Any],
                     duration_s: float, warmup_s: float) -> tuple[float | None, str, str, str]:
    config = BenchConfig(model=ModelSpec(model), units=unit, batches=[batch], engine=engine,
                         min_duration_s=duration_s, min_queries=1, warmup_s=warmup_s,
                         options=options)
    point = run_bench(config).measurements[0]
    agreement = point.agreement or {}
    agree = agreement.get("status", "–")
    if agreement.get("rel_err") is not None:
        agree += f" ({agreement['rel_err']:.0e})"
    precision = str(point.options.get("precision") or "fp32")
    return point.throughput, precision, agree, point.error or ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mobilenet_v3_small,resnet50")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per point")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up per point")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measure each pair N times, alternating; keep the best of each")
    parser.add_argument("--engines", default="torch,onnxruntime,openvino,openvino-auto",
                        help="openvino: on the cpu unit (fp32); openvino-auto: on openvino:CPU "
                             "with the device's default precision")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    found = discover()
    cores = len(found.cpu["usable_cores"])
    load_before = os.getloadavg()[0]
    have = {name: importlib.util.find_spec(name) is not None for name in ("onnxruntime",
                                                                           "openvino")}
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    notes = []
    rows: list[Row] = []
    for ref in [m.strip() for m in args.models.split(",") if m.strip()]:
        loaded = load_model(ref)
        onnx_path = str(export_onnx(loaded).path) if any(have.values()) else ""
        for batch in [int(b) for b in args.batches.split(",")]:
            shape = (batch, *loaded.input_shape)
            for engine in wanted:
                runtime = "openvino" if engine.startswith("openvino") else engine
                if runtime != "torch" and not have.get(runtime, False):
                    note = f"{engine}: skipped, {runtime} is not installed"
                    if note not in notes:
                        notes.append(note)
                    continue
                unit = "openvino:CPU" if engine == "openvino-auto" else "cpu"
                if unit == "openvino:CPU" and found.get(unit) is None:
                    notes.append("openvino-auto: skipped, OpenVINO reports no CPU device")
                    continue
                best_mux: float | None = None
                best_hand: float | None = None
                precision, agree, error = "fp32", "–", ""
                for _ in range(args.repeats):
                    mux, precision, agree, error = through_infermux(
                        ref, unit, runtime, batch, {}, args.duration, args.warmup)
                    if engine == "torch":
                        hand = by_hand_torch(loaded.module, shape, cores, args.duration,
                                             args.warmup)
                    elif engine == "onnxruntime":
                        hand = by_hand_onnxruntime(onnx_path, shape, cores, args.duration,
                                                   args.warmup)
                    else:
                        ov_precision = "f32" if engine == "openvino" else None
                        hand = by_hand_openvino(onnx_path, shape, ov_precision, cores,
                                                args.duration, args.warmup)
                    best_mux = max(best_mux or 0.0, mux or 0.0) or None
                    best_hand = max(best_hand or 0.0, hand)
                row = Row(loaded.name, batch, engine, unit, precision, best_mux, best_hand,
                          agree, error)
                rows.append(row)
                print(f"  {row.model} b{batch} {engine}: infermux {_fmt(best_mux)}, "
                      f"by hand {_fmt(best_hand)} items/s", file=sys.stderr, flush=True)

    print(_markdown(rows, found.cpu, cores, args, notes, (load_before, os.getloadavg()[0])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r), "ratio": r.ratio} for r in rows], f, indent=2)


def _fmt(value: float | None) -> str:
    return "–" if value is None else (f"{value:,.0f}" if value >= 100 else f"{value:.1f}")


def _markdown(rows: list[Row], cpu: dict[str, Any], cores: int, args: argparse.Namespace,
              notes: list[str], load: tuple[float, float]) -> str:
    import torch

    versions = [f"torch {torch.__version__}"]
    for name in ("onnxruntime", "openvino"):
        if importlib.util.find_spec(name) is not None:
            module = __import__(name)
            versions.append(f"{name} {getattr(module, '__version__', '?').split('-')[0]}")
    command = "python " + shlex.join(["bench/engines_cpu.py", *sys.argv[1:]])
    lines = [
        f"Machine: {cpu['model']}, {cores} usable cores, ISA {' '.join(cpu['isa'])}; "
        f"Python {platform.python_version()}; {', '.join(versions)}; 1-minute load average "
        f"{load[0]:.2f} before, {load[1]:.2f} after.",
        f"Command: `{command}`",
        "",
        "| model | batch | engine | unit | precision | infermux items/s | by hand items/s "
        "| infermux / by hand | agreement |",
        "|---|---:|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = f"{r.ratio:.2f}" if r.ratio is not None else "–"
        lines.append(f"| {r.model} | {r.batch} | {r.engine} | {r.unit} | {r.precision} | "
                     f"{_fmt(r.infermux_items_per_s)} | {_fmt(r.by_hand_items_per_s)} | {ratio} "
                     f"| {r.agreement}{' ' + r.note if r.note else ''} |")
    best = _best_per_model_batch(rows)
    if best:
        lines.append("")
        lines.append("Best engine per (model, batch) through infermux: " + "; ".join(best) + ".")
    ratios = [r.ratio for r in rows if r.ratio is not None]
    if ratios:
        lines.append(f"infermux / by hand: min {min(ratios):.2f}, median "
                     f"{float(np.median(ratios)):.2f} (target ≥ 0.95).")
    lines.extend(f"Note: {n}" for n in notes)
    return "\n".join(lines)


def _best_per_model_batch(rows: list[Row]) -> list[str]:
    out = []
    for key in dict.fromkeys((r.model, r.batch) for r in rows):
        group = [r for r in rows if (r.model, r.batch) == key and r.infermux_items_per_s]
        if group:
            top = max(group, key=lambda r: r.infermux_items_per_s or 0.0)
            out.append(f"{key[0]} b{key[1]}: {top.engine} ({_fmt(top.infermux_items_per_s)})")
    return out


if __name__ == "__main__":
    main()
