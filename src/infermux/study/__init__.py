"""`infermux study NAME`: the seed studies of this field, redone on this machine in one command.

Each study composes the runtime (`run_plan`): it builds a grid of plans, measures them within
a budget, stores each as a `run` and itself as a `study` run (table `study_points`), and its
headline has the shape of the paper's table. From Python:
`run_study(StudyConfig("multi-instance", ["resnet50"], units="cuda:0/*"), store=Store(...))`.
"""

from __future__ import annotations

import time
from typing import Any

from infermux.errors import UsageError
from infermux.progress import ProgressFn
from infermux.store import Store, recording
from infermux.study import multi_instance, multi_tenancy, pipeline
from infermux.study.base import (
    Point,
    StudyConfig,
    StudyReport,
    measure_points,
)
from infermux.study.published import PUBLISHED
from infermux.units import Unit

__all__ = ["PUBLISHED", "STUDIES", "StudyConfig", "StudyReport", "headline_for", "list_studies",
           "run_study"]

#: Study name → (what it compares, its default batches, its default instances).
STUDIES: dict[str, dict[str, Any]] = {
    "multi-instance": {"about": "unit combinations × batch sizes × instances, with contention",
                       "batches": [1, 8, 64], "instances": [1, 2], "models": ["resnet50"]},
    "multi-tenancy": {"about": "several models: sequential vs CME vs static vs dynamic "
                               "placement, offline and server", "batches": [1, 8],
                      "instances": [1], "models": ["mobilenet_v3_small", "resnet18"]},
    "pipeline": {"about": "pipelined plan vs best single unit vs data-parallel replicas, per "
                          "network, throughput and energy", "batches": [8], "instances": [1],
                 "models": ["resnet50", "mobilenet_v3_small", "resnet18"]},
}


def list_studies() -> list[str]:
    """The studies `infermux study` runs."""
    return sorted(STUDIES)


def headline_for(name: str, points: list[dict[str, Any]]) -> dict[str, Any]:
    """The paper-shaped headline of study `name` from its stored points."""
    if name == "multi-instance":
        return multi_instance.headline(points)
    if name == "multi-tenancy":
        return multi_tenancy.headline(points)
    if name == "pipeline":
        return pipeline.headline(points)
    raise UsageError(f"study {name!r} unknown: use {', '.join(list_studies())}")


def _resolve(config: StudyConfig) -> tuple[list[Unit], dict[str, str], list[dict[str, Any]]]:
    """The units, an engine per unit (by id), and a plan model entry per model."""
    from infermux.bench import engines_for
    from infermux.models import ModelSpec, load_model
    from infermux.tune.evaluate import model_name
    from infermux.units import discover, select_units

    units = select_units(config.units, discover())
    specs = [ModelSpec(m, None, config.input_shape) for m in config.models]
    loaded = [load_model(s) for s in specs]
    engines: dict[str, str] = {}
    for unit in units:
        if config.engine == "auto":
            usable = [n for _, n in engines_for("auto", [unit], loaded[0])]
            # torch where it runs (the papers drove CUDA and Tensor Cores from PyTorch), else
            # the first engine that runs the unit (TensorRT on a DLA).
            engines[unit.id] = "torch" if "torch" in usable else usable[0]
        else:
            engines[unit.id] = engines_for(config.engine, [unit], loaded[0])[0][1]
    entries = []
    for spec in specs:
        entry: dict[str, Any] = {"name": model_name(spec.ref), "model": spec.ref}
        if spec.input_shape:
            entry["input_shape"] = list(spec.input_shape)
        entries.append(entry)
    if len({e["name"] for e in entries}) != len(entries):
        raise UsageError(f"models {config.models} repeat a name: give each model once")
    return units, engines, entries


def _sampler(units: list[Unit]) -> tuple[Any, list[str]]:
    """A telemetry sampler beside the study (energy per item of each point), if one can run."""
    from infermux.errors import InfermuxError
    from infermux.telemetry import Sampler

    try:
        sampler = Sampler.for_units(units, interval_s=0.1).start()
    except InfermuxError:
        return None, []
    return sampler, sorted({u.telemetry_device for u in units})


def run_study(config: StudyConfig, *, store: Store | None = None,
              progress: ProgressFn | None = None,
              command: str = "") -> StudyReport:
    """Measure the study's grid within its budget; store every point as it ends."""
    if config.name not in STUDIES:
        raise UsageError(f"study {config.name!r} unknown: use {', '.join(list_studies())}")
    if config.name == "multi-instance" and len(config.models) > 1:
        raise UsageError("study multi-instance takes one model: pass --model once")
    if config.name == "multi-tenancy" and len(config.models) < 2:
        raise UsageError("study multi-tenancy runs several models at once: pass --model "
                         "two or more times, e.g. -m mobilenet_v3_small -m resnet18")
    started = time.monotonic()
    found, engines, entries = _resolve(config)
    units = [u.id for u in found]
    points: list[Point]
    if config.name == "multi-instance":
        points = multi_instance.build_points(config, units, engines, entries[0])
    elif config.name == "multi-tenancy":
        points = multi_tenancy.build_points(config, units, engines, entries)
    else:
        points = pipeline.build_points(config, units, engines, entries)
    status = "failed"
    records: list[dict[str, Any]] = []
    head: dict[str, Any] = {}
    cfg = config.to_dict() | {"resolved_units": units, "engines": engines,
                              "model": ", ".join(config.models), "points": len(points)}
    with recording(store, "study", cfg, command) as rec:
        run_id = rec.run_id
        sampler, devices = _sampler(found)
        try:
            status = measure_points(config, points, store=store, study_run=run_id,
                                    deadline=started + config.budget_s, progress=progress,
                                    sampler=sampler, devices=devices)
            records = [p.record(i) for i, p in enumerate(points)]
        finally:
            if sampler is not None:
                sampler.stop()
            records = records or [p.record(i) for i, p in enumerate(points)]
            head = headline_for(config.name, records)
            counts: dict[str, int] = {}
            for r in records:
                counts[r["status"]] = counts.get(r["status"], 0) + 1
            rec.status, rec.summary = status, {"points": counts,
                                               "elapsed_s": time.monotonic() - started,
                                               "headline": head}
    return StudyReport(run_id, config, records, head, status, time.monotonic() - started)


def points_of(store: Store, run_id: int) -> list[dict[str, Any]]:
    """A stored study's points."""
    return store.study_points(run_id)
