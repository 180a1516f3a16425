"""Shared by the partition benchmarks: pipeline vs best single unit vs data-parallel replicas.

For each batch size: `run_partition` profiles the pieces, solves the DP and measures its top
candidates as real pipelines, keeping the best measured; then, in `rounds` interleaved rounds
(a shared host drifts over seconds), the kept pipeline, each unit alone, and independent
instances one per unit (data-parallel, each thread on its own unit's cores, no pipeline
machinery) are measured for `duration_s` each. Figures are medians over the rounds; the
prediction error compares the DP's prediction with the pipeline measured in the rounds.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from infermux.engines import create_engine
from infermux.models import ModelSpec, load_model
from infermux.models.graph import capture_graph
from infermux.partition.dp import ProfileCost
from infermux.partition.search import PartitionConfig, run_partition
from infermux.runtime.stages import Pipeline
from infermux.runtime.transfer import HOST, pin_thread
from infermux.units import Unit, discover, select_units


def measure_instances(model: Any, units: list[Unit], batch: int, duration_s: float,
                      warmup_s: float) -> float:
    """Independent instances, one per unit, each a thread on its unit running whole batches."""
    engine = create_engine("torch")
    runners = [engine.build(model, u, batch, data="host", instance=i) for i, u in enumerate(units)]
    counts = [0] * len(units)
    stop = threading.Event()

    def loop(i: int) -> None:
        with pin_thread(units[i]):
            while not stop.is_set():
                runners[i].run()
                counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(len(units))]
    for t in threads:
        t.start()
    time.sleep(warmup_s)
    before, start = sum(counts), time.perf_counter()
    time.sleep(duration_s)
    after, end = sum(counts), time.perf_counter()
    stop.set()
    for t in threads:
        t.join()
    for r in runners:
        r.close()
    getattr(engine, "release", lambda: None)()
    return (after - before) * batch / (end - start)


def compare(model_ref: str, unit_spec: str, batches: list[int], *, input_shape: tuple | None = None,
            measure_top: int = 3, duration_s: float = 3.0, warmup_s: float = 1.0,
            rounds: int = 2, max_pieces: int = 12, max_stages: int | None = None,
            progress: bool = True) -> list[dict[str, Any]]:
    """One row per batch size; see the module docstring for the method."""
    found = discover(with_runtimes=False)
    units = select_units(unit_spec, found)
    spec = ModelSpec(model_ref, input_shape=input_shape)
    model = load_model(spec)
    graph = capture_graph(model.module, model.input_shape)
    by_id = {u.id: u for u in units}
    rows = []
    for batch in batches:
        def say(label: str, fraction: float, batch: int = batch) -> None:
            if progress:
                print(f"  [b{batch} {fraction:4.0%}] {label}", flush=True)

        config = PartitionConfig(spec, units=unit_spec, batch=batch, top_k=measure_top,
                                 max_pieces=max_pieces, max_stages=max_stages,
                                 measure_s=duration_s, warmup_s=warmup_s)
        report = run_partition(config, progress=say)
        kept = next(c for c in report.candidates if c.chosen)
        cost = ProfileCost(report.profile)
        n = report.profile.pieces
        predicted_dp = batch / cost(0, n, tuple(by_id), (HOST,))
        samples: dict[str, list[float]] = {"pipeline": [], "data_parallel": []}
        samples.update({u.id: [] for u in units})
        busy: list[list[float]] = []
        for r in range(rounds):
            say(f"round {r + 1}/{rounds}: pipeline, single units, data-parallel", r / rounds)
            with Pipeline(kept.plan, model, graph, by_id) as pipeline:
                m = pipeline.measure(duration_s, warmup_s)
            samples["pipeline"].append(m.items_per_s)
            busy.append(m.stage_busy)
            for unit in units:
                samples[unit.id].append(measure_instances(model, [unit], batch, duration_s,
                                                          warmup_s))
            samples["data_parallel"].append(measure_instances(model, units, batch, duration_s,
                                                              warmup_s))
        med = {k: statistics.median(v) for k, v in samples.items()}
        best_unit = max(units, key=lambda u: med[u.id])
        predicted = kept.predicted_items_per_s
        rows.append({
            "model": model.name, "batch": batch, "units": [u.id for u in units],
            "plan": kept.plan.describe(), "stages": len(kept.plan.stages),
            "predicted_stage_s": kept.stage_times_s,
            "stage_busy": [statistics.median(b) for b in zip(*busy, strict=True)],
            "pipeline_predicted": predicted, "pipeline_measured": med["pipeline"],
            "pipeline_error_pct": 100 * (predicted - med["pipeline"]) / med["pipeline"],
            "candidates": [c.record() for c in report.candidates],
            "single_unit": best_unit.id, "single_predicted": report.single_unit[best_unit.id],
            "single_measured": med[best_unit.id],
            "single_all": {u.id: med[u.id] for u in units},
            "dp_predicted": predicted_dp, "dp_measured": med["data_parallel"],
            "pipeline_vs_single": med["pipeline"] / med[best_unit.id],
            "pipeline_vs_dp": med["pipeline"] / med["data_parallel"],
            "samples": samples,
        })
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table (items/s)."""
    lines = [
        "| model | batch | kept plan | pipeline pred. | pipeline meas. | error | stage busy "
        "| best single (pred./meas.) | data-parallel (pred./meas.) | pipe/single | pipe/DP |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        busy = " / ".join(f"{b:.0%}" for b in r["stage_busy"])
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['plan'].replace('|', '¦')} | "
            f"{r['pipeline_predicted']:.1f} | {r['pipeline_measured']:.1f} | "
            f"{r['pipeline_error_pct']:+.0f}% | {busy} | "
            f"{r['single_unit']}: {r['single_predicted']:.1f} / {r['single_measured']:.1f} | "
            f"{r['dp_predicted']:.1f} / {r['dp_measured']:.1f} | {r['pipeline_vs_single']:.2f}× | "
            f"{r['pipeline_vs_dp']:.2f}× |")
    return "\n".join(lines)
