"""An infermux runner against its runtime by hand, in one process, in alternating windows.

On a shared machine, load drifts over minutes; alternating short windows of A and B in one
process and taking the median of the per-pair ratios cancels most of it. A is infermux's runner
(`Runner.run()` in a loop, as `measure()` calls it); B is the runtime's own best loop on the same
ONNX file: `session.run` for ONNX Runtime, a full `AsyncInferQueue` with the throughput hint for
OpenVINO (benchmark_app's method).

    python bench/engines_ab.py --engine openvino --unit openvino:CPU --model mobilenet_v3_small -b 1
    python bench/engines_ab.py --engine onnxruntime --unit cpu --model resnet50 -b 8 --pairs 12
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from infermux.engines import create_engine
from infermux.export import export_onnx
from infermux.models import load_model
from infermux.units import discover, select_units


def rate(step: Callable[[], Any], batch: int, seconds: float) -> float:
    start = time.perf_counter()
    count = 0
    while time.perf_counter() - start < seconds:
        step()
        count += 1
    return count * batch / (time.perf_counter() - start)


def onnxruntime_by_hand(path: str, shape: tuple[int, ...], threads: int
                        ) -> Callable[[float], float]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    session = ort.InferenceSession(path, sess_options=so, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    return lambda seconds: rate(lambda: session.run(None, {name: x}), shape[0], seconds)


def openvino_by_hand(path: str, shape: tuple[int, ...], threads: int, fp32: bool
                     ) -> Callable[[float], float]:
    import openvino as ov

    core = ov.Core()
    model = core.read_model(path)
    model.reshape({model.inputs[0].get_any_name(): ov.PartialShape(list(shape))})
    config = {"PERFORMANCE_HINT": "THROUGHPUT", "INFERENCE_NUM_THREADS": str(threads)}
    if fp32:
        config["INFERENCE_PRECISION_HINT"] = "f32"
    compiled = core.compile_model(model, "CPU", config)
    n = int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
    queue = ov.AsyncInferQueue(compiled, n)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for i in range(n):
        queue[i].set_input_tensor(ov.Tensor(x))
    done = [0]
    queue.set_callback(lambda _r, _u: done.__setitem__(0, done[0] + 1))

    def window(seconds: float) -> float:
        queue.wait_all()
        before, start = done[0], time.perf_counter()
        while time.perf_counter() - start < seconds:
            queue.start_async()
        queue.wait_all()
        return (done[0] - before) * shape[0] / (time.perf_counter() - start)

    return window


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("onnxruntime", "openvino"), required=True)
    parser.add_argument("--unit", default="cpu")
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("-b", "--batch", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--window", type=float, default=1.0, help="seconds per window")
    args = parser.parse_args()

    found = discover()
    unit = select_units(args.unit, found)[0]
    model = load_model(args.model)
    path = str(export_onnx(model).path)
    shape = (args.batch, *model.input_shape)
    threads = len(found.cpu["usable_cores"]) if unit.kind == "openvino" else len(unit.cores)
    runner = create_engine(args.engine).build(model, unit, args.batch, {})
    by_hand = (onnxruntime_by_hand(path, shape, threads) if args.engine == "onnxruntime"
               else openvino_by_hand(path, shape, threads, fp32=unit.kind == "cpu"))
    mux = lambda seconds: rate(runner.run, args.batch, seconds)  # noqa: E731
    mux(args.window)
    by_hand(args.window)
    ratios = []
    for i in range(args.pairs):  # ABAB then BABA…: neither side always goes first
        if i % 2:
            b, a = by_hand(args.window), mux(args.window)
        else:
            a, b = mux(args.window), by_hand(args.window)
        ratios.append(a / b)
    print(f"{args.engine} {unit.id} {model.name} b{args.batch} "
          f"(precision {runner.options.get('precision')}): median infermux / by hand "
          f"{float(np.median(ratios)):.3f} over {args.pairs} pairs of {args.window:g} s; "
          f"pairs: {' '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
