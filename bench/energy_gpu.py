"""ResNet50 energy on one GPU: fp32 (CUDA cores) vs fp16 (Tensor Cores) at batch 64 and 256.

Runs through infermux's offline benchmark with the telemetry sampler (10 Hz, NVML), so every
point has images/s, energy per image, mean/peak power and images/s per watt, plus the
validity flags; then measures the sampler's own effect on the GPU: one runner (fp16, batch 64,
CUDA graph: the point most sensitive to host-side interference) measured alternately with no
sampler, a 10 Hz sampler and a 100 Hz sampler.

    python3 bench/energy_gpu.py --out DIR      # about 3 minutes on an H100/H200

Writes DIR/energy_gpu.md (the tables), DIR/energy_gpu.json (all figures) and DIR/energy.db
(the infermux results store, telemetry series included). Needs torch with CUDA, torchvision,
nvidia-ml-py, pydantic, psutil, rich, typer and pyyaml.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

try:
    import infermux  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _points(out: Path, duration_s: float) -> tuple[list[dict], dict]:
    from infermux.bench import BenchConfig, run_bench
    from infermux.models import ModelSpec
    from infermux.store import Store

    rows: list[dict] = []
    telemetry: dict = {}
    with Store(out / "energy.db") as store:
        for mode in ("fp32", "fp16"):
            config = BenchConfig(
                model=ModelSpec("resnet50"), units=f"cuda:0/{mode}", batches=[64, 256],
                min_duration_s=duration_s, min_queries=2048, warmup_s=2.0,
                max_duration_s=max(30.0, 3 * duration_s),
            )
            report = run_bench(config, store=store, command="bench/energy_gpu.py")
            telemetry = report.telemetry or {}
            for record in report.to_dict()["results"]:
                record["run_id"] = report.run_id
                rows.append(record)
                print(f"{record['unit']} b{record['batch']}: "
                      f"{record.get('items_per_s') or 0:,.0f} img/s, "
                      f"{record.get('energy_per_item_j')} J/img", file=sys.stderr)
    return rows, telemetry


def _overhead(rounds: int, duration_s: float) -> list[dict]:
    from infermux.bench import measure
    from infermux.engines import create_engine
    from infermux.models import load_model
    from infermux.telemetry import Sampler
    from infermux.units import discover, select_units

    unit = select_units("cuda:0/fp16", discover(with_runtimes=False))[0]
    runner = create_engine("torch").build(load_model("resnet50"), unit, 64)
    arms: list[float | None] = [None, 0.1, 0.01]
    rates: dict[str, list[float]] = {_arm(a): [] for a in arms}
    costs: dict[str, list[dict]] = {_arm(a): [] for a in arms if a is not None}
    for index in range(rounds):
        for arm in (arms if index % 2 == 0 else arms[::-1]):
            if arm is None:
                samples, window_s = measure([runner], min_duration_s=duration_s,
                                            min_queries=1, warmup_s=1.0)
            else:
                with Sampler.for_units([unit], interval_s=arm) as sampler:
                    samples, window_s = measure([runner], min_duration_s=duration_s,
                                                min_queries=1, warmup_s=1.0)
                costs[_arm(arm)].append(sampler.cost().to_dict())
            rates[_arm(arm)].append(len(samples) * runner.batch / window_s)
        print(f"overhead round {index + 1}/{rounds}: " + ", ".join(
            f"{k} {v[-1]:,.0f}" for k, v in rates.items()), file=sys.stderr)
    runner.close()
    rows = []
    for arm in arms:
        name = _arm(arm)
        ratios = [v / o for v, o in zip(rates[name], rates["off"], strict=True)]
        row = {"sampler": name, "median_items_per_s": statistics.median(rates[name]),
               "min": min(rates[name]), "max": max(rates[name]),
               # paired: each round's arm against the same round's "off"
               "change_vs_off_pct": 100.0 * (statistics.median(ratios) - 1.0)}
        if arm is not None:
            row["cpu_per_tick_us"] = statistics.median(c["cpu_per_tick_us"] for c in costs[name])
            row["wall_per_tick_us"] = statistics.median(c["wall_per_tick_us"] for c in costs[name])
            row["cpu_share_pct"] = statistics.median(c["cpu_share_pct"] for c in costs[name])
        rows.append(row)
    return rows


def _arm(interval: float | None) -> str:
    return "off" if interval is None else f"{1 / interval:g} Hz"


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "–" if value is None else format(value, spec) + unit


def _markdown(points: list[dict], overhead: list[dict], telemetry: dict, machine: dict) -> str:
    lines = [f"ResNet50, PyTorch (CUDA graphs, channels_last for fp16), {machine['gpu']}, "
             f"driver {machine.get('driver', '?')}, torch {machine['torch']}; energy from "
             f"{', '.join(sorted({p.get('energy_source', 'none') for p in points}))}.", "",
             "| mode | batch | images/s | J/image | mean W | peak W | images/s/W | GPU util % "
             "| SM MHz | flags | valid |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        gpu = p.get("utilisation", {}).get("cuda:0", {})
        lines.append(
            f"| {p['unit'].split('/')[1]} | {p['batch']} | "
            f"{_fmt(p.get('items_per_s'), ',.0f')} | "
            f"{_fmt(p.get('energy_per_item_j'), '.4f')} | {_fmt(p.get('mean_power_w'), '.0f')} | "
            f"{_fmt(p.get('peak_power_w'), '.0f')} | {_fmt(p.get('items_per_s_per_w'), '.2f')} | "
            f"{_fmt(gpu.get('util_pct'), '.0f')} | {_fmt(gpu.get('clock_mhz'), '.0f')} | "
            f"{'; '.join(p.get('telemetry_flags', [])) or '–'} | "
            f"{'yes' if p['valid'] else 'no: ' + p.get('validity_note', '')} |")
    lines += ["", "Sampler overhead (fp16, batch 64, CUDA graph; rounds interleaved; change = "
              "median of per-round ratios to the same round's run without a sampler):", "",
              "| sampler | median images/s | min–max | change vs off | sampler CPU/tick "
              "| wall/tick | share of a core |", "|---|---|---|---|---|---|---|"]
    for row in overhead:
        lines.append(
            f"| {row['sampler']} | {row['median_items_per_s']:,.0f} | {row['min']:,.0f}–"
            f"{row['max']:,.0f} | {row['change_vs_off_pct']:+.2f}% | "
            f"{_fmt(row.get('cpu_per_tick_us'), '.0f', ' µs')} | "
            f"{_fmt(row.get('wall_per_tick_us'), '.0f', ' µs')} | "
            f"{_fmt(row.get('cpu_share_pct'), '.2f', '%')} |")
    notes = telemetry.get("notes", [])
    if notes:
        lines += ["", "Telemetry notes: " + "; ".join(notes)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per point")
    parser.add_argument("--rounds", type=int, default=4, help="overhead rounds")
    parser.add_argument("--overhead-duration", type=float, default=5.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/energy_gpu.py needs a CUDA GPU: torch.cuda.is_available() is False")
    from infermux.units.cuda import nvml_info

    started = time.time()
    machine = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "python": platform.python_version(), **nvml_info(0)}
    points, telemetry = _points(args.out, args.duration)
    overhead = _overhead(args.rounds, args.overhead_duration)
    machine["wall_s"] = time.time() - started
    table = _markdown(points, overhead, telemetry, machine)
    print(table)
    (args.out / "energy_gpu.md").write_text(table)
    (args.out / "energy_gpu.json").write_text(json.dumps(
        {"command": "python3 " + " ".join(sys.argv), "machine": machine, "points": points,
         "overhead": overhead, "telemetry": telemetry}, indent=2, default=str))


if __name__ == "__main__":
    main()
