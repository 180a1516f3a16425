"""A batch's latency after the device has been idle, gap by gap.

Does a light load's gap slow the next batch? On some GPU hosts every server plan breaks its
p99 bound at a fraction of its offline rate, with batches of 6-8 items taking 4 ms at the p99
and a tiny kernel's launch-and-wait 1.8 ms (`runtime.host_probe`, docs/benchmarks.md), while
the threads' wake-ups are as quick as on good hosts. A light load leaves the device idle
between batches. This runs one built runner (the engine and options the runtime uses) batch
after batch, each after a fixed idle gap, the gaps alternated round by round, and reports per
batch size and gap: the batch's wall time (set input, launch, collect) and its device time
(the runner's CUDA events), p50 / p99, and the SM clock NVML read just before each batch
(where NVML is there). A device that slows after a gap shows as wall and device time
rising with the gap while the clock reads drop.

    python bench/idle_gap.py --model resnet50 --unit cuda:0/fp16 --batch 8,32 \
        --gaps 0,0.5,2,5,20 --runs 200 --json idle_gap.json
    python bench/idle_gap.py --model mobilenet_v3_small --unit cpu --batch 1 --runs 20 \
        --gaps 0,2 --json /tmp/idle.json      # the same loop on a CPU, as a check
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from infermux.engines import create_engine
from infermux.models import load_model
from infermux.stats import latency_summary_ms
from infermux.units import discover, select_units


def _clock_reader(unit_id: str) -> Any:
    """A function returning the SM clock (MHz) of the unit's GPU, or None where unreadable."""
    if not unit_id.startswith("cuda"):
        return lambda: None
    try:
        import pynvml

        pynvml.nvmlInit()
        index = int(unit_id.split("/")[0].split(":")[1]) if ":" in unit_id else 0
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return lambda: float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
    except Exception:  # noqa: BLE001 - no NVML: the clock is not read
        return lambda: None


def run_gap(runner: Any, batch: np.ndarray, gap_s: float, runs: int, clock: Any
            ) -> dict[str, Any]:
    """`runs` batches, each after `gap_s` of idle: wall and device times, SM clocks (MHz)."""
    wall, device, clocks = [], [], []
    for _ in range(runs):
        if gap_s > 0:
            time.sleep(gap_s)
        mhz = clock()
        t0 = time.perf_counter_ns()
        runner.set_input(batch)
        timing = runner.run()
        wall.append(time.perf_counter_ns() - t0)
        device.append(timing.h2d_ns + timing.compute_ns + timing.d2h_ns)
        if mhz is not None:
            clocks.append(mhz)
    return {"gap_ms": gap_s * 1e3, "runs": runs, "wall": latency_summary_ms(wall),
            "device": latency_summary_ms(device),
            "sm_clock_mhz": {"min": min(clocks), "median": float(np.median(clocks))}
            if clocks else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--unit", default="cuda:0/fp16")
    p.add_argument("--engine", default="torch")
    p.add_argument("--options", default="{}", help="engine options, JSON (the runner's)")
    p.add_argument("--batch", default="8,32")
    p.add_argument("--gaps", default="0,0.5,2,5,20", help="idle gaps before each batch, ms")
    p.add_argument("--runs", type=int, default=200, help="batches per gap and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds (the gaps' order flips)")
    p.add_argument("--json", dest="json_path", required=True)
    a = p.parse_args()
    unit = select_units([a.unit], discover(with_runtimes=False))[0]
    model = load_model(a.model)
    engine = create_engine(a.engine)
    options = json.loads(a.options)
    gaps = [float(g) / 1e3 for g in a.gaps.split(",")]
    clock = _clock_reader(unit.id)
    out: dict[str, Any] = {"args": vars(a), "unit": unit.id, "rows": []}
    rng = np.random.default_rng(0)
    for b in [int(x) for x in a.batch.split(",")]:
        runner = engine.build(model, unit, b, options)
        batch = rng.standard_normal((b, *runner.input_shape)).astype(np.float32)
        for _ in range(20):  # warm-up
            runner.set_input(batch)
            runner.run()
        for r in range(a.rounds):
            for gap in (gaps if r % 2 == 0 else list(reversed(gaps))):
                row = {"batch": b, "round": r, **run_gap(runner, batch, gap, a.runs, clock)}
                out["rows"].append(row)
                wall, dev, mhz = row["wall"], row["device"], row["sm_clock_mhz"]
                print(f"b{b} round {r} gap {gap * 1e3:5.1f} ms: wall p50/p99 "
                      f"{wall['p50_ms']:.2f}/{wall['p99_ms']:.2f} ms, device "
                      f"{dev['p50_ms']:.2f}/{dev['p99_ms']:.2f} ms"
                      + (f", SM clock median {mhz['median']:.0f} MHz (min {mhz['min']:.0f})"
                         if mhz else ""), flush=True)
                Path(a.json_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
