"""`infermux study NAME`: the seed studies of this field, redone on this machine in one command.

Each study composes the runtime (`run_plan`): it builds a grid of plans, measures them within
a budget, stores each as a `run` and itself as a `study` run (table `study_points`), and its
headline has the shape of the paper's table. From Python:
`run_study(StudyConfig("multi-instance", ["resnet50"], units="cuda:0/*"), store=Store(...))`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from infermux.errors import UsageError
from infermux.progress import ProgressFn
from infermux.store import Store, recording
from infermux.study import multi_instance, multi_tenancy, pipeline
from infermux.study.base import (
    Point,
    StudyConfig,
    StudyReport,
    check_budget,
    measure_points,
)
from infermux.study.layout import UnitChoice, choose_units
from infermux.study.published import PUBLISHED
from infermux.units import Unit

__all__ = ["PUBLISHED", "STUDIES", "PreparedStudy", "StudyConfig", "StudyReport",
           "default_models", "headline_for", "list_studies", "prepare_study", "run_study"]

#: Study name → (what it compares, its default batches, its default instances, its default
#: models where a GPU is among the units, and where only CPU core sets are: `cpu_models`).
STUDIES: dict[str, dict[str, Any]] = {
    "multi-instance": {"about": "unit combinations × batch sizes × instances, with contention",
                       "batches": [1, 8, 64], "instances": [1, 2], "models": ["resnet50"],
                       "cpu_models": ["mobilenet_v3_small"]},
    "multi-tenancy": {"about": "several models: sequential vs CME vs static vs dynamic "
                               "placement, offline and server", "batches": [1, 8],
                      "instances": [1], "models": ["mobilenet_v3_small", "resnet18"],
                      "cpu_models": ["mobilenet_v3_small", "resnet18"]},
    "pipeline": {"about": "pipelined plan vs best single unit vs data-parallel replicas, per "
                          "network, throughput and energy", "batches": [8], "instances": [1],
                 "models": ["resnet50", "mobilenet_v3_small", "resnet18"],
                 "cpu_models": ["mobilenet_v3_small"]},
}

#: Why a study's CPU-only default is lighter than its GPU one (said in the header).
_CPU_MODELS_WHY = (
    "the default on CPU core sets: ResNet50, the paper's network, runs where a GPU is among "
    "the units; on one core a batch of ResNet50 takes seconds (0.7 to 4 items/s on a busy "
    "2-core host), so its points stop at their time limit short of their query count")


#: What a study's points beyond its central comparison are.
_FURTHER = {"multi-instance": "more instances", "multi-tenancy": "beyond the central modes",
            "pipeline": "data-parallel replicas"}


def default_models(name: str, gpu: bool) -> tuple[list[str], str]:
    """Study `name`'s models when none is given, and why: by whether a GPU is among its units."""
    d = STUDIES[name]
    if gpu or d["cpu_models"] == d["models"]:
        return list(d["models"]), "the study's default"
    return list(d["cpu_models"]), _CPU_MODELS_WHY


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


def _resolve(config: StudyConfig) -> tuple[StudyConfig, str, UnitChoice, dict[str, str],
                                            list[dict[str, Any]]]:
    """The config with its models, why them, its units (and why), engines and model entries.

    No models given: the study's default for the units chosen. An engine per unit (by id),
    a plan model entry per model.
    """
    from infermux.bench import engines_for
    from infermux.models import ModelSpec, load_model
    from infermux.tune.evaluate import model_name
    from infermux.units import discover

    found = discover()
    models_why = "as given by --model"
    if not config.models:
        count = len(STUDIES[config.name]["models"])
        gpu = any(u.kind != "cpu" for u in choose_units(config.name, config.units, found,
                                                          count).units)
        models, models_why = default_models(config.name, gpu)
        config = dataclasses.replace(config, models=models)
    _check_models(config)
    specs = [ModelSpec(m, None, config.input_shape) for m in config.models]
    choice = choose_units(config.name, config.units, found, len(specs))
    loaded = [load_model(s) for s in specs]
    engines: dict[str, str] = {}
    for unit in choice.units:
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
    return config, models_why, choice, engines, entries


def _check_models(config: StudyConfig) -> None:
    if config.name == "multi-instance" and len(config.models) > 1:
        raise UsageError("study multi-instance takes one model: pass --model once")
    if config.name == "multi-tenancy" and len(config.models) < 2:
        raise UsageError("study multi-tenancy runs several models at once: pass --model "
                         "two or more times, e.g. -m mobilenet_v3_small -m resnet18")


@dataclass
class PreparedStudy:
    """A study ready to measure: its units and why, its points, and how its budget is split."""

    config: StudyConfig
    choice: UnitChoice
    engines: dict[str, str]
    points: list[Point]
    budget: dict[str, Any]
    started: float
    #: Why these models: given by --model, or the study's default for its units.
    models_why: str = "as given by --model"

    def header(self) -> list[str]:
        """What the study will do, said before it starts."""
        b = self.budget
        lines = [f"units: {', '.join(self.choice.ids)} — {self.choice.why}",
                 f"models: {', '.join(self.config.models)} — {self.models_why}",
                 f"budget {self.config.budget_s:g} s: {b['central_points']} central points "
                 f"at {b['duration_s']:.2f} s a trial (about {b['estimate_s']:.0f} s), CPU "
                 f"workers as {'processes' if self.config.cpu_workers == 'process' else 'threads'}"]
        if b["other_points"]:
            lines.append(f"{b['other_points_that_fit']} of {b['other_points']} further points "
                         f"({_FURTHER[self.config.name]}) fit after them; the rest are skipped "
                         "for the budget")
        return lines


def prepare_study(config: StudyConfig) -> PreparedStudy:
    """Choose the units, build the grid and check the budget: nothing is measured yet.

    A budget too small for the central comparison is a UsageError saying what would fit.
    No models (`StudyConfig.models` empty): the study's default for the units chosen.
    """
    if config.name not in STUDIES:
        raise UsageError(f"study {config.name!r} unknown: use {', '.join(list_studies())}")
    if config.models:
        _check_models(config)
    started = time.monotonic()
    config, models_why, choice, engines, entries = _resolve(config)
    if config.cpu_workers == "auto":
        gpu = any(u.kind != "cpu" for u in choice.units)
        config = dataclasses.replace(config, cpu_workers="process" if gpu else "thread")
    points: list[Point]
    if config.name == "multi-instance":
        points = multi_instance.build_points(config, choice, engines, entries[0])
    elif config.name == "multi-tenancy":
        points = multi_tenancy.build_points(config, choice, engines, entries)
    else:
        points = pipeline.build_points(config, choice, engines, entries)
    _refuse_early(config, points)
    budget = check_budget(config, points)
    return PreparedStudy(config, choice, engines, points, budget, started, models_why)


def _refuse_early(config: StudyConfig, points: list[Point]) -> None:
    """Skip now, with the runtime's reason, the points whose plan this machine refuses.

    (Too many instances for a core set): the budget is then not planned for them.
    """
    from infermux.runtime import parse_plan

    for i, point in enumerate(points):
        if point.plan is None:
            continue
        try:
            parse_plan(point.plan, source=f"{config.name} point {i}")
        except UsageError as exc:
            point.plan, point.status, point.error = None, "skipped", str(exc)


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
              command: str = "", prepared: PreparedStudy | None = None) -> StudyReport:
    """Measure the study's grid within its budget; store every point as it ends."""
    ready = prepared or prepare_study(config)
    config, found, points = ready.config, ready.choice, ready.points
    units = found.ids
    status = "failed"
    records: list[dict[str, Any]] = []
    head: dict[str, Any] = {}
    cfg = config.to_dict() | {"resolved_units": units, "engines": ready.engines,
                              "units_why": found.why, "models_why": ready.models_why,
                              "budget_plan": ready.budget,
                              "model": ", ".join(config.models), "points": len(points)}
    with recording(store, "study", cfg, command) as rec:
        run_id = rec.run_id
        sampler, devices = _sampler(found.units)
        try:
            status = measure_points(config, points, store=store, study_run=run_id,
                                    deadline=ready.started + config.budget_s,
                                    progress=progress, sampler=sampler, devices=devices)
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
                                               "elapsed_s": time.monotonic() - ready.started,
                                               "headline": head}
    return StudyReport(run_id, config, records, head, status,
                       time.monotonic() - ready.started)


def points_of(store: Store, run_id: int) -> list[dict[str, Any]]:
    """A stored study's points."""
    return store.study_points(run_id)
