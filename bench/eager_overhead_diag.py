"""Where does an eager runner's per-batch time go? Isolates stream, events and the runner path.

Variants on the same eager module, same pinned input, per-batch synchronize, alternated rounds:
plain loop on the default stream; plain loop on a side stream; plain loop with four timing events;
the torch runner (cuda_graph off). Also the cost of the bare per-batch extras.

    python3 bench/eager_overhead_diag.py --unit cuda:0/fp16 --batch 1,32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infermux.bench import measure
from infermux.engines import create_engine
from infermux.models import load_model
from infermux.units import discover, select_units


def loop(module, x_host, x_dev, seconds, stream=None, events=False):
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    n = 0
    start = time.perf_counter()
    ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(None)
    with torch.inference_mode(), ctx:
        while time.perf_counter() - start < seconds:
            if events:
                evs[0].record()
            x_dev.copy_(x_host, non_blocking=True)
            if events:
                evs[1].record()
            y = module(x_dev)
            if events:
                evs[2].record()
            y = y.to("cpu", non_blocking=True)
            if events:
                evs[3].record()
                evs[3].synchronize()
                _ = (evs[0].elapsed_time(evs[1]), evs[1].elapsed_time(evs[2]),
                     evs[2].elapsed_time(evs[3]))
            else:
                torch.cuda.current_stream().synchronize()
            n += 1
    return n * x_host.shape[0] / (time.perf_counter() - start)


def micro(n=20000):
    s = torch.cuda.Stream()
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    t = time.perf_counter()
    for _ in range(n):
        with torch.cuda.stream(s):
            pass
    ctx_us = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(n):
        for e in evs:
            e.record(s)
    rec_us = (time.perf_counter() - t) / n / 4 * 1e6
    evs[3].synchronize()
    t = time.perf_counter()
    for _ in range(n):
        evs[0].elapsed_time(evs[1])
    el_us = (time.perf_counter() - t) / n * 1e6
    print(f"stream context enter+exit {ctx_us:.2f} us; event record {rec_us:.2f} us; "
          f"elapsed_time {el_us:.2f} us")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--unit", default="cuda:0/fp16")
    p.add_argument("--batch", default="1,32")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    micro()
    unit = select_units(a.unit, discover(with_runtimes=False))[0]
    model = load_model(a.model)
    engine = create_engine("torch")
    for b in [int(x) for x in a.batch.split(",")]:
        runner = engine.build(model, unit, b, {"cuda_graph": False})
        module = next(iter(engine._modules.values()))
        x_host = runner._x_host
        x_dev = torch.empty_like(runner._x_dev)
        side = torch.cuda.Stream()
        res = {k: [] for k in ("default", "side", "events", "runner")}
        for _ in range(a.rounds):
            res["default"].append(loop(module, x_host, x_dev, a.seconds))
            res["side"].append(loop(module, x_host, x_dev, a.seconds, stream=side))
            res["events"].append(loop(module, x_host, x_dev, a.seconds, events=True))
            samples, window = measure([runner], min_duration_s=a.seconds, min_queries=1,
                                      warmup_s=0.2, deadline_s=a.seconds * 3)
            res["runner"].append(len(samples) * b / window)
        base = statistics.median(res["default"])
        print(f"batch {b}: " + "; ".join(
            f"{k} {statistics.median(v):,.0f} ({statistics.median(v) / base:.3f})"
            for k, v in res.items()))


if __name__ == "__main__":
    main()
