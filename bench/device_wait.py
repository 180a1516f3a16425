r"""How long a GPU takes to answer small work after an idle gap, and what changes it.

A light server load leaves the device idle between batches, and `runtime.host_probe` times a
tiny kernel's launch and wait after 20 ms idle. This bench asks which side the delay is on:

1. `styles`: a tiny matmul launched and waited on after a gap of 0, 0.5, 2 and 20 ms, waiting
   four ways: `Event.synchronize`, `Stream.synchronize`, polling `Event.query` in a loop, and
   polling with a zero sleep between queries; then twice with four other Python threads busy
   (the interpreter lock shared as in a runtime process);
2. `fill`: the same kernel after gaps of 0.5, 2 and 20 ms spent three ways: sleeping, spinning
   the CPU (the core stays awake), and spinning while a tiny kernel is sent to the device every
   0.2 ms (the device stays busy);
3. `keep_warm`: the runtime's own runner (`--model`, `--batch`, the torch engine's defaults: one
   CUDA graph) after 2 and 20 ms gaps, alone and with a thread that keeps the device busy with
   a tiny kernel every 1 or 0.2 ms, two rounds.

Wall times in µs (the kernel) or ms (the runner), p50 / p99 / max. One JSON file.

    python bench/device_wait.py --json device_wait.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np


def _summary(ns: list[int], unit: float) -> dict[str, float]:
    a = np.asarray(ns) / unit
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max())}


def _kernel_waits(x: Any, stream: Any, gap_s: float, style: str, runs: int,
                  fill: str = "sleep") -> dict[str, float]:
    """A tiny matmul's launch-and-wait (µs) after `gap_s` spent as `fill`, waited on as `style`."""
    import torch

    event = torch.cuda.Event()
    took = []
    for _ in range(runs):
        if fill == "sleep":
            time.sleep(gap_s)
        else:
            end = time.perf_counter() + gap_s
            feed_at = 0.0
            while time.perf_counter() < end:
                if fill == "spin_feed" and time.perf_counter() > feed_at:
                    with torch.cuda.stream(stream):
                        x.add_(0)
                    feed_at = time.perf_counter() + 0.0002
            stream.synchronize()
        start = time.perf_counter_ns()
        with torch.cuda.stream(stream):
            torch.mm(x, x)
            event.record(stream)
        if style == "event_sync":
            event.synchronize()
        elif style == "stream_sync":
            stream.synchronize()
        else:
            while not event.query():
                if style == "poll_sleep":
                    time.sleep(0)
        took.append(time.perf_counter_ns() - start)
    return _summary(took, 1e3)


def _busy_threads(count: int) -> tuple[list[threading.Thread], list[bool]]:
    stop = [False]

    def spin() -> None:
        while not stop[0]:
            sum(range(200))

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return threads, stop


def _runner_waits(runner: Any, batch: Any, gap_s: float, warm_every_s: float, runs: int
                  ) -> dict[str, float]:
    """The runner's batch (set input, run) wall time (ms) after `gap_s` idle, with a keep-warm."""
    import torch

    x = torch.randn(16, 16, device="cuda")
    stream = torch.cuda.Stream()
    stop = [False]

    def keep() -> None:
        while not stop[0]:
            with torch.cuda.stream(stream):
                x.add_(0)
            time.sleep(warm_every_s)

    thread = threading.Thread(target=keep, daemon=True) if warm_every_s else None
    if thread is not None:
        thread.start()
    took = []
    for _ in range(runs):
        time.sleep(gap_s)
        start = time.perf_counter_ns()
        runner.set_input(batch)
        runner.run()
        took.append(time.perf_counter_ns() - start)
    stop[0] = True
    if thread is not None:
        thread.join()
    return _summary(took, 1e6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--unit", default="cuda:0/fp16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--runs", type=int, default=300, help="kernels per point (100 at 20 ms)")
    a = p.parse_args()
    import torch

    from infermux.engines import create_engine
    from infermux.models import load_model
    from infermux.units import discover, select_units

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "styles": [], "fill": [],
                              "keep_warm": []}

    def save() -> None:
        Path(a.json).write_text(json.dumps(report, indent=1))

    x = torch.randn(64, 64, device="cuda")
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    for style in ("event_sync", "stream_sync", "poll", "poll_sleep"):
        for gap in (0.0, 0.0005, 0.002, 0.02):
            r = _kernel_waits(x, stream, gap, style, a.runs if gap < 0.02 else a.runs // 3)
            report["styles"].append({"style": style, "gap_ms": gap * 1e3, **r})
            print(f"{style:12s} gap {gap * 1e3:4g} ms: p50 {r['p50']:7.1f} p99 {r['p99']:7.1f} "
                  f"max {r['max']:9.1f} µs", flush=True)
    threads, stop = _busy_threads(4)
    for style in ("event_sync", "poll"):
        r = _kernel_waits(x, stream, 0.0005, style, a.runs)
        report["styles"].append({"style": style, "gap_ms": 0.5, "busy_threads": 4, **r})
        print(f"{style:12s} gap  0.5 ms, 4 busy threads: p50 {r['p50']:9.1f} p99 {r['p99']:9.1f} "
              f"µs", flush=True)
    stop[0] = True
    for t in threads:
        t.join()
    save()
    for gap in (0.0005, 0.002, 0.02):
        for fill in ("sleep", "spin", "spin_feed"):
            r = _kernel_waits(x, stream, gap, "event_sync", a.runs // 2 if gap < 0.02 else 60,
                              fill)
            report["fill"].append({"gap_ms": gap * 1e3, "fill": fill, **r})
            print(f"gap {gap * 1e3:4g} ms {fill:9s}: p50 {r['p50']:7.1f} p99 {r['p99']:7.1f} "
                  f"max {r['max']:8.1f} µs", flush=True)
    save()
    unit = select_units([a.unit], discover(with_runtimes=False))[0]
    runner = create_engine("torch").build(load_model(a.model), unit, a.batch, {})
    batch = np.random.default_rng(0).standard_normal((a.batch, *runner.input_shape)
                                                     ).astype(np.float32)
    for _ in range(20):
        runner.set_input(batch)
        runner.run()
    for rnd in range(2):
        for gap in (0.002, 0.02):
            for every in (0.0, 0.001, 0.0002):
                r = _runner_waits(runner, batch, gap, every, 150)
                report["keep_warm"].append({"round": rnd, "gap_ms": gap * 1e3,
                                            "keep_warm_every_ms": every * 1e3, **r})
                print(f"round {rnd} {a.model} b{a.batch} gap {gap * 1e3:4g} ms, keep-warm every "
                      f"{every * 1e3:4g} ms: p50 {r['p50']:.2f} p99 {r['p99']:.2f} max "
                      f"{r['max']:.2f} ms", flush=True)
                save()


if __name__ == "__main__":
    main()
