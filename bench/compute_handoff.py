"""What does a hand-off between engines cost? `Runner.compute(x)` against the numpy paths.

`compute(x)` from a torch tensor, vs `set_input` + `run` (outputs left in place) and `infer`
(outputs copied out). A pipeline stage on ONNX Runtime or OpenVINO is called with a torch tensor
and returns torch tensors; this times the three paths on the same runner, in short interleaved
slices (a shared 2-core host drifts by tens of percent over seconds), and prints the median
per-batch time of each and compute's overhead over `set_input` + `run`. The network is cut at a
middle cut point and each half timed, so the input is an image batch for one and a feature map
for the other.

    python3 bench/compute_handoff.py --model mobilenet_v3_small --batch 4 --engines onnxruntime,openvino
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from infermux.engines import create_engine
from infermux.models import load_model
from infermux.models.segments import segment_model
from infermux.partition import capture_graph, split
from infermux.units import discover


def per_batch_us(fn: Callable[[], object], seconds: float) -> float:
    """Median microseconds of `fn` over `seconds`."""
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    """Time the three paths for every engine and half of the network; print a JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--input-shape", default="3x224x224")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--engines", default="onnxruntime,openvino")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--slice", type=float, default=0.5, help="seconds per path per round")
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.input_shape.split("x"))
    cpu = discover(with_runtimes=False).get("cpu")
    assert cpu is not None
    model = load_model(args.model)
    graph = capture_graph(model.module, shape)
    mid = graph.cuts[len(graph.cuts) // 2].node
    segments = split(graph, ["input", mid, "output"])
    for name in args.engines.split(","):
        engine = create_engine(name)
        for index, segment in enumerate(segments):
            runner = engine.build(segment_model(model, segment, index), cpu, args.batch, {})
            x = torch.randn((args.batch, *segment.input.shape))
            array = x.numpy().copy()

            def numpy_path(runner=runner, array=array) -> None:
                runner.set_input(array)
                runner.run()

            paths = {"compute": lambda runner=runner, x=x: runner.compute(x),
                     "set_input+run": numpy_path,
                     "infer": lambda runner=runner, array=array: runner.infer(array)}
            for fn in paths.values():
                fn()
            rounds: dict[str, list[float]] = {p: [] for p in paths}
            for _ in range(args.rounds):
                for path, fn in paths.items():
                    rounds[path].append(per_batch_us(fn, args.slice))
            us = {p: statistics.median(v) for p, v in rounds.items()}
            print(json.dumps({
                "engine": name, "segment": segment.name, "batch": args.batch,
                "input_bytes": int(np.prod(x.shape)) * 4,
                **{f"{p}_us": round(v, 1) for p, v in us.items()},
                "compute_overhead_us": round(us["compute"] - us["set_input+run"], 1),
            }, ensure_ascii=False), flush=True)
        engine.release()


if __name__ == "__main__":
    main()
