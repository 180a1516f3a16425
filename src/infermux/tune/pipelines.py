"""Pipelines in the tuner's search: the partitioner's best predicted plans, measured like replicas.

With two or more units (and one torch model), the tuner asks the partitioner for its best
predicted pipelines over the same units and engines (`partition.predict`: every piece profiled
on every (unit, engine), exact DP), then runs each through the runtime with the same trial load
as the replica plans' runtime trials. A pipeline replaces the best replica plan only when it
measures faster through the runtime (and holds the constraints); either way every pipeline trial
is reported beside the replica plans, with the ratio.

Pipelines are searched at the batch of the best replica plan's configuration on that model (the
batch the ladders found best for the units), capped at 64: a stage's batch is a latency per stage
as well as a throughput knob, and the partitioner's profile is taken at one batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from infermux.errors import DeviceOutOfMemoryError, InfermuxError, UsageError
from infermux.models import LoadedModel, ModelSpec
from infermux.progress import ProgressFn
from infermux.runtime.plan import ModelEntry
from infermux.tune.evaluate import QUEUE_DELAY_MS, Constraints, TrialSettings
from infermux.units import Unit

__all__ = ["PipelineTrial", "pipeline_units", "tune_pipelines"]

#: Largest stage batch the tuner tries for a pipeline.
MAX_PIPELINE_BATCH = 64


@dataclass
class PipelineTrial:
    """One pipeline candidate: predicted by the partitioner, measured through the runtime."""

    plan: ModelEntry  # a model entry with `stages:`
    predicted_items_per_s: float | None
    status: str = "ok"  # ok | oom | error | invalid | skipped
    items_per_s: float | None = None
    #: The 99th percentile of a batch's latency through the whole pipeline (launch to outputs).
    p99_ms: float | None = None
    stages: list[dict[str, Any]] = field(default_factory=list)
    cost_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Measured, valid and with a throughput."""
        return self.status == "ok" and self.items_per_s is not None

    def violations(self, constraints: Constraints) -> list[str]:
        """Why it breaks the constraints (a batch takes at most half a p99 bound, as replicas)."""
        if not self.ok:
            return [f"{self.status}: {self.error or 'no measurement'}"]
        bound = constraints.p99_bound_ms
        if bound is not None and (self.p99_ms is None or self.p99_ms > bound / 2):
            return [f"batch p99 {self.p99_ms} ms > half the bound ({bound / 2:g} ms)"]
        return []

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"plan": self.plan.describe_stages(),
                "stages": [s.model_dump() for s in self.plan.stages or []],
                "predicted_items_per_s": self.predicted_items_per_s, "status": self.status,
                "items_per_s": self.items_per_s, "p99_ms": self.p99_ms,
                "stage_figures": self.stages, "cost_s": self.cost_s, "error": self.error}


def pipeline_units(units: list[Unit]) -> list[Unit]:
    """The units a pipeline may use: CPU core sets and GPUs (not `openvino:CPU`, an alias)."""
    return [u for u in units if u.kind in ("cpu", "cuda")]


def _runtime_trial(plan: ModelEntry, name: str, spec: ModelSpec, settings: TrialSettings,
                   progress: ProgressFn | None) -> PipelineTrial:
    from infermux.runtime import run_plan
    from infermux.runtime.plan import parse_plan

    entry = plan.model_copy(update={"name": name}).model_dump(mode="json", exclude_none=True)
    if spec.weights:
        entry["weights"] = spec.weights
    runtime_plan = parse_plan({
        "name": f"tuned-{name}-pipeline", "models": [entry],
        "dispatcher": {"max_queue_delay_ms": QUEUE_DELAY_MS},
        "load": {"scenario": "offline", "min_duration_s": settings.min_duration_s,
                 "min_queries": settings.min_queries,
                 "max_duration_s": max(10.0, 4 * settings.min_duration_s)}},
        source="tuner pipeline")
    trial = PipelineTrial(plan, plan.predicted_items_per_s)
    started = time.monotonic()
    try:
        report = run_plan(runtime_plan, progress=progress)
    except DeviceOutOfMemoryError as exc:
        trial.status, trial.error = "oom", str(exc)
    except InfermuxError as exc:
        if isinstance(exc, UsageError):
            raise
        trial.status, trial.error = "error", str(exc)
    else:
        summary = report.final
        worker = next(iter(summary.workers.values()), None) if summary is not None else None
        if worker is None or not worker.ok:
            trial.status = "error"
            trial.error = (worker.error if worker else None) or "the pipeline failed"
        elif summary is None or not summary.valid:
            trial.status = "invalid"
            trial.error = "; ".join(summary.validity_notes if summary else []) or None
        trial.items_per_s = summary.items_per_s if summary and trial.status == "ok" else None
        trial.p99_ms = worker.batch_p99_ms if worker else None
        trial.stages = (summary.pipelines or {}).get(name, []) if summary else []
    trial.cost_s = time.monotonic() - started
    return trial


def tune_pipelines(
    *,
    name: str,
    spec: ModelSpec,
    model: LoadedModel,
    units: list[Unit],
    engines: list[str],
    batch: int,
    settings: TrialSettings,
    budget_s: float,
    top_k: int = 2,
    progress: ProgressFn | None = None,
) -> tuple[list[PipelineTrial], str | None]:
    """Predict the best pipelines over `units` × `engines` and measure them through the runtime.

    Returns the trials and, when none could be tried, the reason.
    """
    from infermux.partition.search import PartitionConfig, predict

    usable = pipeline_units(units)
    if len(usable) < 2:
        return [], "pipelines need two or more CPU core sets or GPUs among the units"
    if model.module is None:
        return [], f"{model.name} is an ONNX file: pipelines cut torch models"
    batch = max(1, min(batch, MAX_PIPELINE_BATCH))
    deadline = time.monotonic() + budget_s
    config = PartitionConfig(
        model=spec, units=",".join(u.id for u in usable), batch=batch, top_k=top_k,
        max_pieces=6, profile_s=0.1, engines=tuple(engines))
    try:
        predicted = predict(config, usable, model, progress)
    except DeviceOutOfMemoryError as exc:
        return [], f"profiling the pieces ran out of device memory: {exc}"
    except UsageError as exc:
        return [], str(exc)
    except InfermuxError as exc:
        return [], f"profiling the pieces failed: {exc}"
    trials = []
    for plan in predicted.plans:
        stages = plan.stages or []
        if len(stages) < 2 and len(stages[0].units) < 2:
            continue  # the whole model on one unit: a replica plan, searched already
        if time.monotonic() >= deadline:
            trials.append(PipelineTrial(plan, plan.predicted_items_per_s, "skipped",
                                        error="the budget ran out before it was measured"))
            continue
        trials.append(_runtime_trial(plan, name, spec, settings, progress))
    return trials, None
