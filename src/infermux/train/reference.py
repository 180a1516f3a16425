"""The machine's own speed beside a validation: fixed reference work, read again and again.

A drift probe re-measures a training step as it ran at profile time, a handful of minibatches
each side, and on a GPU host that gives its ratio a noise of ±15-30% (docs/benchmarks.md), so
a drift of 10% can be neither shown nor ruled out from it. Fixed work whose time depends on
the machine alone spreads by a few percent among its repeats: one Python core's loop (the
interpreter the training process and its loader workers run on) and, on a GPU, a fixed
half-precision matrix product timed by CUDA events. (A copy in host memory was tried too: on
the 2-core machine its best of five moved by up to 1.34x between readings a minute apart, far
more than the loop, so it is not a reference.) `_validate` reads them
after the profiles and after each validated configuration; each reading over the first says
whether the machine itself moved between the profiles and the epochs, and by how much, with
the readings' own spread beside it. They correct nothing: a training step's time is not
proportional to any of them (the step probes' drift does that where it stands out of its
noise, `drift.epoch_drift`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["REPEATS", "best_of", "read_speed", "speed_drift"]

#: Repeats of each reference per reading: its best is the reading, its spread the noise.
REPEATS = 5
#: The Python loop's steps (about 50 ms on a current core).
LOOP_STEPS = 1_000_000
#: The device product: a square FP16 matrix of this side, multiplied this many times.
MATMUL_SIDE, MATMUL_TIMES = 2048, 10


def best_of(fn: Any) -> dict[str, float]:
    """`fn` timed `REPEATS` times on the host clock: its best (s) and spread (`_entry`)."""
    times = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return _entry(times)


def _entry(times: list[float]) -> dict[str, float]:
    """The best time (s) and the spread: the median over the best, less one."""
    best = min(times)
    return {"s": best, "spread": statistics.median(times) / best - 1.0 if best > 0 else 0.0}


def read_speed(unit: str, when: str) -> dict[str, Any]:
    """One reading of each reference on `unit`'s machine (`when`: what it was taken after)."""
    reading: dict[str, Any] = {"when": when}
    reading["python_loop"] = best_of(lambda: sum(i * i for i in range(LOOP_STEPS)))
    if unit.startswith("cuda"):
        import torch

        device = torch.device(unit.split("/")[0])
        x = torch.randn(MATMUL_SIDE, MATMUL_SIDE, device=device, dtype=torch.float16)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def product() -> float:
            start.record()
            for _ in range(MATMUL_TIMES):
                torch.mm(x, x)
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3

        with torch.cuda.device(device):  # the events on the product's device
            product()  # the first call's kernel choice is not timed
            reading["device_matmul"] = _entry([product() for _ in range(REPEATS)])
    return reading


def speed_drift(readings: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Each reference's time in each reading over the first reading's (above 1: slower).

    `range` per reference, its `noise` (the largest spread of its readings' repeats), and
    `within_10pct`: every reference's every ratio within ±10%, each measured beyond its
    noise or not. None with fewer than two readings.
    """
    if len(readings) < 2:
        return None
    first = readings[0]
    out: dict[str, Any] = {"readings": len(readings), "by_reference": {}}
    for name in ("python_loop", "device_matmul"):
        if name not in first or not first[name]["s"]:
            continue
        ratios = [r[name]["s"] / first[name]["s"] for r in readings if name in r]
        out["by_reference"][name] = {
            "range": [min(ratios), max(ratios)],
            "noise": max(r[name]["spread"] for r in readings if name in r)}
    refs = out["by_reference"].values()
    out["within_10pct"] = all(lo >= 0.9 and hi <= 1.1 for lo, hi in (r["range"] for r in refs))
    return out
