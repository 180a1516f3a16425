r"""Whether a GPU host stops for long moments, and on which side: the host's CPU or the device.

A p99 bound of 15 ms fails at every rate on some GPU hosts, with small batches whose own run
is a few milliseconds. This bench watches for stalls with four probes in their own processes,
all at once, for `--seconds` each of two phases:

- `spin`: a Python loop reading the clock; a gap over 0.5 ms is the process not running (the
  vCPU descheduled, an interrupt storm);
- `sleep`: 1 ms sleeps; an overshoot over 1 ms;
- `gpu_wait` (phase `idle_device`): a tiny matmul launched and waited on every 1 ms; a wait
  over 1 ms, with the launch and the wait's shares;
- `gpu_side` (phase `busy_device`): the device kept fed by streams of small matmuls with
  events between them; a gap over 1 ms between two consecutive events' device times is the
  device (or its feed) stopping while work was queued.

A stall that shows in a GPU probe and in no CPU probe at that moment is on the device's side.
Printed: each probe's count of stalls, the largest, the times; one JSON file.

    python bench/device_stalls.py --seconds 20 --json stalls.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

#: Gaps over these are recorded (ms): the spin loop's, the sleep's overshoot, the GPU waits'.
SPIN_MS, SLEEP_MS, GPU_MS = 0.5, 1.0, 1.0


def _spin(q: Any, t_end: float) -> None:
    events, n = [], 0
    last = time.perf_counter_ns()
    while last / 1e9 < t_end:
        now = time.perf_counter_ns()
        n += 1
        if now - last > SPIN_MS * 1e6:
            events.append((last / 1e9, (now - last) / 1e6))
        last = now
    q.put({"probe": "spin", "n": n, "events": events})


def _sleep(q: Any, t_end: float) -> None:
    events, n = [], 0
    while time.perf_counter() < t_end:
        t0 = time.perf_counter_ns()
        time.sleep(0.001)
        over = (time.perf_counter_ns() - t0) / 1e6 - 1.0
        n += 1
        if over > SLEEP_MS:
            events.append((t0 / 1e9, over))
    q.put({"probe": "sleep", "n": n, "events": events})


def _gpu_wait(q: Any, t_end: float) -> None:
    import torch

    x = torch.ones((64, 64), device="cuda")
    done = torch.cuda.Event()
    torch.cuda.synchronize()
    events, waits = [], []
    while time.perf_counter() < t_end:
        time.sleep(0.001)
        t0 = time.perf_counter_ns()
        torch.mm(x, x)
        done.record()
        t1 = time.perf_counter_ns()
        done.synchronize()
        t2 = time.perf_counter_ns()
        total = (t2 - t0) / 1e6
        waits.append(total)
        if total > GPU_MS:
            events.append((t0 / 1e9, total, (t1 - t0) / 1e6))
    waits.sort()
    pcts = {f"p{p}": waits[int(p / 100 * (len(waits) - 1))] for p in (50, 99, 99.9)}
    q.put({"probe": "gpu_wait", "n": len(waits), "events": events,
           "wait_ms": {**pcts, "max": waits[-1]}})


def _gpu_side(q: Any, t_end: float) -> None:
    import torch

    x = torch.ones((256, 256), device="cuda")
    torch.cuda.synchronize()
    events, n = [], 0
    while time.perf_counter() < t_end:
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(201)]
        marks[0].record()
        for i in range(200):
            for _ in range(20):
                torch.mm(x, x)
            marks[i + 1].record()
        queued = time.perf_counter()
        marks[-1].synchronize()
        for i in range(200):
            gap = marks[i].elapsed_time(marks[i + 1])
            n += 1
            if gap > GPU_MS:
                events.append((queued, gap))
    q.put({"probe": "gpu_side", "n": n, "events": events})


PHASES = {"idle_device": (_spin, _sleep, _gpu_wait), "busy_device": (_spin, _sleep, _gpu_side)}


def run_phase(probes: tuple[Any, ...], seconds: float) -> dict[str, Any]:
    """Every probe in its own process for `seconds` (after their start-up), at once."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t_end = time.perf_counter() + seconds + 8.0  # spawning and CUDA's start inside the window
    procs = [ctx.Process(target=p, args=(q, t_end)) for p in probes]
    for p in procs:
        p.start()
    got = [q.get() for _ in procs]
    for p in procs:
        p.join()
    return {g["probe"]: g for g in got}


def beside_cpu(result: dict[str, Any], gpu_probe: str, over_ms: float = 5.0) -> tuple[int, int]:
    """(GPU stalls over `over_ms`, of them those with a CPU spin gap over 2 ms within 10 ms)."""
    spins = [t for t, ms in result["spin"]["events"] if ms > 2.0]
    stalls = [(e[0], e[1]) for e in result[gpu_probe]["events"] if e[1] > over_ms]
    beside = sum(1 for t, ms in stalls if any(abs(t - s) < 0.01 + ms / 1e3 for s in spins))
    return len(stalls), beside


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="each phase's watch")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out: dict[str, Any] = {"seconds": args.seconds}
    for phase, probes in PHASES.items():
        result = run_phase(probes, args.seconds)
        out[phase] = result
        for name, r in result.items():
            largest = sorted(e[1] for e in r["events"])[-5:]
            extra = f"  wait ms {r['wait_ms']}" if "wait_ms" in r else ""
            print(f"{phase:12s} {name:9s} n={r['n']:>10d} stalls={len(r['events']):5d} "
                  f"largest ms {[round(v, 1) for v in largest]}{extra}")
        gpu = "gpu_wait" if "gpu_wait" in result else "gpu_side"
        stalls, beside = beside_cpu(result, gpu)
        print(f"{phase:12s} {gpu}: {stalls} stalls over 5 ms, {beside} beside a CPU gap over 2 ms")
    if args.json:
        args.json.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
