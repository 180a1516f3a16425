"""Does the telemetry sampler move a CPU benchmark's throughput? Measured, not assumed.

One runner (default: mobilenet_v3_small, batch 8, PyTorch on all CPU cores) is measured with
infermux's `measure()` alternately without and with a running sampler, in many short
interleaved rounds (off, 10 Hz, 100 Hz, then reversed), so load from other processes on a
shared machine, which drifts over seconds, hits neighbouring arms alike. The overhead of an arm
is the median over rounds of its throughput divided by the same round's "off" throughput,
minus 1 (paired), with the interquartile range of those ratios. The sampler's own CPU time
per tick and share of a core are reported beside it.

    PYTHONPATH=src python bench/sampler_overhead.py --rounds 30 --duration 1
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from infermux.bench import measure
from infermux.engines import create_engine
from infermux.models import load_model
from infermux.telemetry import Sampler
from infermux.telemetry.cpu import CpuSource
from infermux.units import discover, select_units


def _run(runner, duration_s: float, interval_s: float | None) -> tuple[float, dict | None]:
    if interval_s is None:
        samples, window_s = measure([runner], min_duration_s=duration_s, min_queries=1,
                                    warmup_s=0.2)
        return len(samples) * runner.batch / window_s, None
    with Sampler([CpuSource()], interval_s=interval_s) as sampler:
        samples, window_s = measure([runner], min_duration_s=duration_s, min_queries=1,
                                    warmup_s=0.2)
    return len(samples) * runner.batch / window_s, sampler.cost().to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--units", default="cpu")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--duration", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument("--intervals", default="0.1,0.01", help="sampler periods in seconds")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    unit = select_units(args.units, discover(with_runtimes=False))[0]
    runner = create_engine("torch").build(load_model(args.model), unit, args.batch)
    arms: list[float | None] = [None, *(float(x) for x in args.intervals.split(","))]
    throughput: dict[str, list[float]] = {_name(a): [] for a in arms}
    costs: dict[str, list[dict]] = {_name(a): [] for a in arms if a is not None}
    started = time.time()
    for round_index in range(args.rounds):
        order = arms if round_index % 2 == 0 else arms[::-1]
        for arm in order:
            rate, cost = _run(runner, args.duration, arm)
            throughput[_name(arm)].append(rate)
            if cost is not None:
                costs[_name(arm)].append(cost)
        print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
            f"{k} {v[-1]:.1f}" for k, v in throughput.items()), file=sys.stderr)
    base = statistics.median(throughput["off"])
    rows = []
    for arm in arms:
        name = _name(arm)
        values = throughput[name]
        ratios = sorted(v / o for v, o in zip(values, throughput["off"], strict=True))
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        row = {"arm": name, "median_items_per_s": statistics.median(values),
               "min": min(values), "max": max(values),
               "change_vs_off_pct": 100.0 * (statistics.median(ratios) - 1.0),
               "change_iqr_pct": (100.0 * (q1 - 1.0), 100.0 * (q3 - 1.0))}
        if arm is not None:
            c = costs[name]
            row["sampler_cpu_per_tick_us"] = statistics.median(x["cpu_per_tick_us"] for x in c)
            row["sampler_cpu_share_pct"] = statistics.median(x["cpu_share_pct"] for x in c)
        rows.append(row)
    # Round-to-round noise of the baseline itself, to read the changes against.
    off = throughput["off"]
    noise = 100.0 * (max(off) - min(off)) / base
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": {"cpu": _cpu_model(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "model": args.model, "batch": args.batch, "unit": unit.id, "rounds": args.rounds,
        "duration_s": args.duration, "wall_s": time.time() - started,
        "baseline_spread_pct": noise, "arms": rows,
    }
    print("| sampler | median items/s | min–max | change vs off (paired median) | IQR | "
          "sampler CPU/tick | sampler share of a core |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        cpu = f"{row['sampler_cpu_per_tick_us']:.0f} µs" if "sampler_cpu_per_tick_us" in row else ""
        share = f"{row['sampler_cpu_share_pct']:.2f}%" if "sampler_cpu_share_pct" in row else ""
        iqr = row["change_iqr_pct"]
        print(f"| {row['arm']} | {row['median_items_per_s']:.1f} | {row['min']:.1f}–"
              f"{row['max']:.1f} | {row['change_vs_off_pct']:+.2f}% | {iqr[0]:+.1f}% to "
              f"{iqr[1]:+.1f}% | {cpu} | {share} |")
    print(f"\nbaseline round-to-round spread: {noise:.1f}% ({args.rounds} rounds of "
          f"{args.duration:g} s)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


def _name(interval: float | None) -> str:
    return "off" if interval is None else f"{1 / interval:g} Hz"


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    main()
