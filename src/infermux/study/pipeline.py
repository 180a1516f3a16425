"""`study pipeline`: pipelined plans against the best single unit and data-parallel replicas.

For each network: the network alone on each unit and the pipelined plan the partitioner keeps
(its partitioning run is stored too), the study's central comparison, then replicas of it on
every unit at once with what the budget leaves; each run through the runtime at the same
batch; throughput, and energy per item where the units have power readings. The headline is
the GPU + DLA study's comparison, network by network.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from infermux.errors import RunError
from infermux.runtime.plan import QUEUE_DELAY_MS
from infermux.store import Store
from infermux.study.base import Point, StudyConfig, max_duration_s
from infermux.study.layout import UnitChoice

__all__ = ["build_points", "claims", "headline"]

#: A guess of a partitioning run's seconds (profiling the network's segments on each unit).
_PARTITION_S = 20.0


def _load(config: StudyConfig, b: int) -> dict[str, Any]:
    return {"scenario": "offline", "min_duration_s": config.duration_s,
            "min_queries": max(config.min_queries, 4 * b),
            "max_duration_s": max_duration_s(config)}


def build_points(config: StudyConfig, choice: UnitChoice, engines: dict[str, str],
                 models: list[dict[str, Any]]) -> list[Point]:
    """Per network and batch: alone on each unit, then the pipeline; then data-parallel replicas.

    The pipeline against the best single unit is the paper's comparison, so those points are
    the central ones the budget is planned for, every network's first; the data-parallel
    replicas (on all units at once) run after them with what the budget leaves. Measured
    before them, a slow network's replicas took the time its pipeline needed (a 2-core host
    under load ran each network's replicas and skipped every pipeline).
    """
    units = choice.ids
    points: list[Point] = []
    replicas: list[Point] = []
    pipe_units = [u for u in units if u == "cpu" or u.startswith(("cpu:", "cuda:"))]
    for m in models:
        for b in config.batches:
            base = {"model": m["name"], "batch": b}
            for u in units:
                points.append(Point(f"{m['name']} on {u}", {**base, "mode": "single",
                                                            "units": [u]},
                                    {"name": f"single-{m['name']}", "models": [{**m, "replicas": [
                                        {"unit": u, "engine": engines[u], "batch": b,
                                         "batch_buckets": "none"}]}],
                                     "load": _load(config, b)}))
            if len(units) < 2:
                why = (f"one unit ({units[0]}): data-parallel replicas and a pipeline need two "
                       "or more; pass --units with two, e.g. cpu:0,cpu:1")
                for mode, label in (("pipeline", "pipeline"), ("replicas", "data-parallel")):
                    points.append(Point(f"{m['name']} {label}", {**base, "mode": mode,
                                                                 "units": list(units)}, None,
                                        status="skipped", error=why))
                continue
            point = Point(f"{m['name']} pipeline", {**base, "mode": "pipeline",
                                                    "units": list(pipe_units)}, None,
                          setup_s=_PARTITION_S)
            if len(pipe_units) < 2:
                point.status = "skipped"
                point.error = "a pipeline needs two or more CPU core sets or GPUs among the units"
            else:
                point.prepare = _pipeline_plan(config, m, pipe_units, b)
            points.append(point)
            replicas.append(Point(f"{m['name']} data-parallel", {**base, "mode": "replicas",
                                                                "units": list(units)},
                                  {"name": f"replicas-{m['name']}", "models": [{**m, "replicas": [
                                      {"unit": u, "engine": engines[u], "batch": b,
                                       "batch_buckets": "none"} for u in units]}],
                                   "load": _load(config, b)}, central=False))
    return points + replicas


def _pipeline_plan(config: StudyConfig, model: dict[str, Any], units: Sequence[str], b: int
                   ) -> Callable[[Store | None, dict[str, Any]], dict[str, Any]]:
    """A closure that partitions the network (a stored `partition` run) and returns its plan."""

    def prepare(store: Store | None, params: dict[str, Any]) -> dict[str, Any]:
        from infermux.models import ModelSpec
        from infermux.partition.search import PartitionConfig, run_partition

        shape = tuple(model["input_shape"]) if model.get("input_shape") else None
        report = run_partition(PartitionConfig(
            model=ModelSpec(model["model"], None, shape), units=",".join(units), batch=b,
            top_k=2, max_pieces=8, measure_s=params.get("duration_s", config.duration_s),
            warmup_s=0.5), store=store,
            command=f"infermux study {config.name} (partition {model['name']})")
        params["partition_run"] = report.run_id
        if report.best is None:
            raise RunError(f"the partitioner kept no pipeline for {model['name']} (run "
                           f"{report.run_id}): no candidate measured and agreed")
        entry = report.best.model_copy(update={"name": model["name"]}).model_dump(
            mode="json", exclude_none=True)
        params["stages"] = report.best.describe_stages()
        return {"name": f"pipeline-{model['name']}", "models": [entry],
                "dispatcher": {"max_queue_delay_ms": QUEUE_DELAY_MS}, "load": _load(config, b)}

    return prepare


def headline(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per network and batch: best single unit, data-parallel replicas and the pipeline."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for p in points:
        prm = p["params"]
        row = rows.setdefault((prm["model"], prm["batch"]), {
            "model": prm["model"], "batch": prm["batch"], "single": None, "replicas": None,
            "pipeline": None, "singles": {}})
        f = p.get("figures") or {}
        cell = {"status": p["status"], "items_per_s": f.get("items_per_s") if p["status"] == "ok"
                else None, "energy_per_item_j": f.get("energy_per_item_j"),
                "p99_ms": f.get("p99_ms"), "run": p.get("sub_run_id"), "error": p.get("error"),
                "stages": prm.get("stages"), "partition_run": prm.get("partition_run")}
        if prm["mode"] == "single":
            row["singles"][prm["units"][0]] = cell
            best = row["single"]
            if cell["items_per_s"] and (best is None or cell["items_per_s"] > (
                    best["items_per_s"] or 0)):
                row["single"] = {**cell, "unit": prm["units"][0]}
        else:
            row[prm["mode"]] = cell
    findings = []
    for row in rows.values():
        pipe, single, reps = row["pipeline"], row["single"], row["replicas"]
        p_v = (pipe or {}).get("items_per_s")
        if p_v and single and single.get("items_per_s"):
            row["pipeline_over_single"] = p_v / single["items_per_s"]
            findings.append(f"{row['model']} b{row['batch']}: the pipeline gives "
                            f"{row['pipeline_over_single']:.2f}× the best single unit "
                            f"({single['unit']})")
        if p_v and reps and reps.get("items_per_s"):
            row["pipeline_over_replicas"] = p_v / reps["items_per_s"]
        e_p = (pipe or {}).get("energy_per_item_j")
        e_s = (single or {}).get("energy_per_item_j")
        if e_p and e_s:
            row["energy_vs_single"] = e_p / e_s
    return {"rows": list(rows.values()), "findings": findings,
            "claims": claims(list(rows.values()), points)}


def claims(rows: Sequence[dict[str, Any]], points: Sequence[dict[str, Any]]
           ) -> list[dict[str, str]]:
    """The paper's claims beside this machine's figures: held, did not hold, not measurable."""
    out: list[dict[str, str]] = []
    paper = "the pipeline gives +101% to +680% throughput over the GPU alone (2.01× to 7.8×)"
    ratios = [(r["pipeline_over_single"], r) for r in rows if r.get("pipeline_over_single")]
    if not ratios:
        why = sorted({str(p.get("error") or p["status"]) for p in points
                      if p["params"].get("mode") == "pipeline" and p["status"] != "ok"})
        out.append({"claim": "throughput", "paper": paper, "verdict": "not measurable here",
                    "here": "; ".join(why)[:240] or "no pipeline was measured"})
    else:
        best, _ = max(ratios, key=lambda t: t[0])
        shown = ", ".join(f"{r['model']} b{r['batch']} {g:.2f}×" for g, r in ratios)
        out.append({"claim": "throughput", "paper": paper,
                    "verdict": "held" if best >= 2.01 else "did not hold",
                    "here": f"pipeline ÷ best single unit: {shown}"})
    paper = "the pipeline uses up to 55% less energy per item than the GPU alone"
    energy = [(r["energy_vs_single"], r) for r in rows if r.get("energy_vs_single")]
    if not energy:
        out.append({"claim": "energy", "paper": paper, "verdict": "not measurable here",
                    "here": "no energy per item for both the pipeline and the best single "
                            "unit (these units have no power readings here)"})
    else:
        best_e = min(e for e, _ in energy)
        out.append({"claim": "energy", "paper": paper,
                    "verdict": "held" if best_e < 1.0 else "did not hold",
                    "here": "pipeline ÷ best single unit, J per item: " + ", ".join(
                        f"{r['model']} b{r['batch']} {e:.2f}×" for e, r in energy)})
    return out
