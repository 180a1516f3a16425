"""The partitioner end to end: graph → pieces → profiles → exact DP → measured top candidates.

Profiles are taken alone and lie under contention (two stages share memory bandwidth, caches, the
GIL, a GPU's copy engines), so the DP's best `top_k` plans are each run through the runtime
(`run_plan`, offline, as `infermux run` and the tuner run them: dispatcher, LoadGen, its validity
rule) and the best *measured* one is kept. A plan is a runtime `ModelEntry` with `stages:`.
Every profile and candidate goes to the store.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from infermux.agreement import ChainAgreement, check_stages
from infermux.errors import DeviceOutOfMemoryError, InfermuxError, UsageError
from infermux.models import LoadedModel, ModelSpec, load_model
from infermux.models.graph import ModelGraph, capture_graph
from infermux.models.segments import Segment, split
from infermux.partition.dp import (
    Candidate,
    ProfileCost,
    placement_engine,
    placement_unit,
    solve,
)
from infermux.partition.pipeline_file import entry_name, pipeline_plan, plan_yaml
from infermux.partition.profile import Profile, profile_segments
from infermux.progress import ProgressFn
from infermux.runtime.plan import QUEUE_DELAY_MS, ModelEntry, Stage
from infermux.store import Store, recording
from infermux.units import Unit, discover, select_units

__all__ = [
    "CandidateMeasurement", "CandidateResult", "PartitionConfig", "PartitionReport", "Prediction",
    "check_partitionable", "choose_boundaries", "describe_graph", "predict", "run_partition",
    "to_plan",
]



@dataclass
class PartitionConfig:
    """What a partitioning run searches and how long it measures; stored with the run."""

    model: ModelSpec
    units: str = "cpu:0,cpu:1"
    batch: int = 8
    max_stages: int | None = None
    max_dup: int = 1
    top_k: int = 3
    max_pieces: int = 12
    buffers: int = 2
    measure_s: float = 3.0
    warmup_s: float = 1.0
    profile_s: float = 0.2
    options: dict[str, Any] = field(default_factory=dict)
    #: Engines each stage may run on (profiled per segment and unit; the DP picks per stage).
    engines: tuple[str, ...] = ("torch",)

    def __post_init__(self) -> None:
        for name, value in (("--batch", self.batch), ("--measure-top", self.top_k),
                            ("--max-pieces", self.max_pieces), ("--buffers", self.buffers),
                            ("--duplicate", self.max_dup)):
            if value < 1:
                raise UsageError(f"{name} {value} must be at least 1")
        if self.max_stages is not None and self.max_stages < 1:
            raise UsageError(f"--stages {self.max_stages} must be at least 1")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {
            "model": {"ref": self.model.ref, "weights": self.model.weights,
                      "input_shape": list(self.model.input_shape or ())},
            "units": self.units, "batch": self.batch, "max_stages": self.max_stages,
            "max_dup": self.max_dup, "top_k": self.top_k, "max_pieces": self.max_pieces,
            "buffers": self.buffers, "measure_s": self.measure_s, "warmup_s": self.warmup_s,
            "profile_s": self.profile_s, "options": self.options, "engines": list(self.engines),
        }


@dataclass
class CandidateMeasurement:
    """A candidate's offline trial through the runtime: items, window, stage shares, latency."""

    items: int
    window_s: float
    items_per_s: float
    valid: bool
    validity_notes: list[str] = field(default_factory=list)
    #: Each stage's busy share over the trial.
    stage_busy: list[float] = field(default_factory=list)
    #: Query latency percentiles of the trial (`p50_ms`, `p99_ms`, ...).
    latency: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {"items": self.items, "window_s": self.window_s, "items_per_s": self.items_per_s,
                "valid": self.valid, "validity_notes": self.validity_notes,
                "stage_busy": self.stage_busy, **self.latency}


@dataclass
class CandidateResult:
    """One plan: predicted by the DP, then measured through the runtime (or why it could not be)."""

    rank: int
    plan: ModelEntry
    predicted_items_per_s: float
    stage_times_s: list[float]
    measured: CandidateMeasurement | None = None
    status: str = "ok"  # ok | oom | error | disagrees
    error: str | None = None
    chosen: bool = False
    #: Stage outputs against fp32 references (checked for the measured candidates in turn, best
    #: first, until one passes).
    agreement: ChainAgreement | None = None

    @property
    def measured_items_per_s(self) -> float | None:
        """Measured throughput, None when not measured."""
        return self.measured.items_per_s if self.measured is not None else None

    @property
    def error_pct(self) -> float | None:
        """(predicted − measured) / measured, in percent."""
        m = self.measured_items_per_s
        return 100.0 * (self.predicted_items_per_s - m) / m if m else None

    def record(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "rank": self.rank, "plan": self.plan.describe_stages(),
            "stages": len(self.plan.stages or []),
            "units": [u for s in self.plan.stages or [] for u in s.units],
            "predicted_items_per_s": self.predicted_items_per_s,
            "stage_times_s": self.stage_times_s,
            "measured_items_per_s": self.measured_items_per_s, "error_pct": self.error_pct,
            "measurement": self.measured.to_dict() if self.measured else None,
            "status": self.status, "error": self.error, "chosen": self.chosen,
            "agreement": self.agreement.to_dict() if self.agreement else None,
        }


@dataclass
class PartitionReport:
    """A run's outcome: the pieces, their profile, every candidate and the plan kept."""

    run_id: int | None
    model: LoadedModel
    graph: ModelGraph
    segments: list[Segment]
    profile: Profile
    candidates: list[CandidateResult]
    single_unit: dict[str, float]
    best: ModelEntry | None
    status: str = "complete"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "run_id": self.run_id, "status": self.status, "model": self.model.describe(),
            "capture": self.graph.method, "batch": self.profile.batch,
            "pieces": [s.to_dict() for s in self.segments],
            "profile": self.profile.to_dict(),
            "predicted_single_unit_items_per_s": self.single_unit,
            "candidates": [c.record() for c in self.candidates],
            "plan": (self.best.model_dump(mode="json", exclude_none=True)
                     if self.best else None),
        }


def describe_graph(graph: ModelGraph, segments: list[Segment]) -> dict[str, Any]:
    """`--show`: the cut points with their crossing tensors and each segment's FLOPs/params."""
    return {
        "capture": graph.method, "notes": graph.notes, "input": graph.input.to_dict(),
        "outputs": [o.to_dict() for o in graph.outputs],
        "cuts": [c.to_dict() for c in graph.cuts],
        "segments": [s.to_dict() for s in segments],
    }


def check_partitionable(model: LoadedModel) -> None:
    """One line when `model` is a network the partitioner cannot cut, before anything is traced.

    Pipelines pass one float tensor of a fixed shape from stage to stage, starting from the
    model's one input: an ONNX file (no torch graph to cut) and a network of several inputs,
    integer inputs or a sequence length (a transformer taking token ids and a mask) run whole.
    """
    if model.module is None:
        raise UsageError(f"{model.name} is an ONNX file: partitioning needs a torch model")
    io = model.spec_io
    if not io.simple:
        takes = ", ".join(t.text() for t in io.inputs)
        raise UsageError(f"{model.name} takes {takes}: partition cuts networks of one float "
                         "input of a fixed shape, so this one runs whole (bench, tune, run and "
                         "serve take it as it is)")


def choose_boundaries(graph: ModelGraph, segments: list[Segment], max_pieces: int) -> list[str]:
    """At most `max_pieces` pieces: cut points nearest to equal shares of the FLOPs.

    `segments` are the atomic ones (between consecutive cut points). Fewer pieces keep profiling
    short; the DP is exact over the pieces it is given.
    """
    names = graph.boundaries
    if len(segments) <= max_pieces:
        return names
    cumulative = list(itertools.accumulate(s.flops_per_item for s in segments))
    total = cumulative[-1] or 1
    inner = cumulative[:-1]  # FLOPs done before each cut point
    chosen: list[int] = []
    for q in range(1, max_pieces):
        target = total * q / max_pieces
        best = min(range(len(inner)), key=lambda k: (abs(inner[k] - target), k))
        if best not in chosen:
            chosen.append(best)
    return ["input", *(graph.cuts[k].node for k in sorted(chosen)), "output"]


def to_plan(config: PartitionConfig, profile: Profile, candidate: Candidate,
            model: LoadedModel) -> ModelEntry:
    """A DP candidate as a runtime model entry with `stages:` at the profiled batch size."""
    names = profile.boundaries
    return ModelEntry(
        name=entry_name(config.model.ref), model=config.model.ref, weights=config.model.weights,
        input_shape=list(model.input_shape), pipeline_replicas=1, latency_bound_ms=None,
        share=1.0,
        stages=[Stage(start=names[s.start], end=names[s.end], instances=1,
                          units=[placement_unit(u) for u in s.units],
                          engine=placement_engine(s.units[0]),
                          batch=profile.batch, buffers=config.buffers, predicted_time_s=s.time_s,
                          options=config.options if placement_engine(s.units[0]) == "torch" else {})
                for s in candidate.stages],
        predicted_items_per_s=candidate.items_per_s(profile.batch),
    )


@dataclass
class Prediction:
    """What profiling and the DP predict, before anything is measured as a pipeline."""

    model: LoadedModel
    graph: ModelGraph
    segments: list[Segment]
    profile: Profile
    candidates: list[Candidate]
    plans: list[ModelEntry]
    single_unit: dict[str, float]


def predict(config: PartitionConfig, units: list[Unit], model: LoadedModel | None = None,
            progress: ProgressFn | None = None) -> Prediction:
    """Capture, coarsen, profile every piece on every (unit, engine) and solve: the DP's top K."""
    for unit in units:
        if unit.kind not in ("cpu", "cuda"):
            raise UsageError(f"unit {unit.id!r}: pipeline stages run on cpu and cuda units")
    model = model or load_model(config.model)
    check_partitionable(model)
    if progress is not None:
        progress("capturing the graph", 0.0)
    graph = capture_graph(model.module, model.input_shape)
    if not graph.cuts:
        raise UsageError(f"{model.name} has no valid cut point: it can only run whole")
    segments = split(graph, choose_boundaries(graph, split(graph), config.max_pieces))
    profile = profile_segments(model, segments, units, config.batch, options=config.options,
                               engines=config.engines, min_time_s=config.profile_s,
                               progress=progress)
    found = solve(profile.pieces, profile.units, ProfileCost(profile),
                  max_stages=config.max_stages, max_dup=config.max_dup, top_k=config.top_k)
    alone = ProfileCost(profile, calibration="alone")
    single = {u: config.batch / alone(0, profile.pieces, (u,), ("host",)) for u in profile.units}
    plans = [to_plan(config, profile, c, model) for c in found]
    return Prediction(model, graph, segments, profile, found, plans, single)


def check_plan(plan: ModelEntry, model: LoadedModel, graph: ModelGraph,
               units: dict[str, Unit]) -> ChainAgreement:
    """Each stage of `plan` (on its first unit) against its segment's fp32 reference.

    The chain's output is checked against the whole model's too (`agreement.check_stages`).
    """
    return check_stages(model, graph, [(s.start, s.end, units[s.units[0]], s.engine, s.options)
                                       for s in plan.stages or []])


def measure_plan(plan: ModelEntry, *, duration_s: float,
                 progress: ProgressFn | None = None) -> CandidateMeasurement:
    """Run `plan` alone through the runtime, offline, for at least `duration_s`.

    The build warms every stage's runners up before the trial starts, so warm-up is excluded
    as in any run; the trial is valid by LoadGen's rule (its duration and query count).
    """
    from infermux.runtime.session import run_plan

    runtime_plan = pipeline_plan(
        plan, name=f"{plan.name}-candidate",
        load={"scenario": "offline", "min_duration_s": duration_s, "min_queries": 64,
              "max_duration_s": max(10.0, 4 * duration_s), "sample_pool": 64},
        dispatcher={"max_queue_delay_ms": QUEUE_DELAY_MS})
    report = run_plan(runtime_plan, progress=progress)
    summary = report.final
    if summary is None:
        return CandidateMeasurement(items=0, window_s=0.0, items_per_s=0.0, valid=False)
    worker = next(iter(summary.workers.values()), None)
    if worker is not None and not worker.ok:
        raise (DeviceOutOfMemoryError if worker.status == "oom" else InfermuxError)(
            worker.error or "the pipeline failed")
    return CandidateMeasurement(
        items=summary.completed_items, window_s=summary.duration_s,
        items_per_s=summary.items_per_s or 0.0, valid=summary.valid,
        validity_notes=summary.validity_notes,
        stage_busy=[float(st.get("busy") or 0.0)
                    for st in (summary.pipelines or {}).get(plan.name, [])],
        latency=summary.latency.to_dict() if summary.latency is not None else {})


def run_partition(
    config: PartitionConfig,
    *,
    store: Store | None = None,
    progress: ProgressFn | None = None,
    command: str = "",
) -> PartitionReport:
    """Profile, balance, measure the top candidates and keep the best measured plan."""
    found = discover(with_runtimes=False)
    unit_list = select_units(config.units, found)
    for unit in unit_list:
        if unit.kind not in ("cpu", "cuda"):
            raise UsageError(f"unit {unit.id!r}: pipeline stages run on cpu and cuda units")
    units = {u.id: u for u in unit_list}
    model = load_model(config.model)
    check_partitionable(model)
    cfg = config.to_dict() | {"resolved_units": list(units),
                              "model_description": model.describe()}
    with recording(store, "partition", cfg, command) as rec:
        run_id = rec.run_id
        predicted = predict(config, unit_list, model, progress)
        graph, segments, profile = predicted.graph, predicted.segments, predicted.profile
        rec.summary = {"capture": graph.method, "pieces": len(segments)}
        if store is not None and run_id is not None:
            store.add_partition_profile(run_id, profile)
        found_plans = predicted.candidates
        report = PartitionReport(run_id, model, graph, segments, profile, [],
                                 predicted.single_unit, None)
        for rank, candidate in enumerate(found_plans, start=1):
            plan = predicted.plans[rank - 1]
            result = CandidateResult(rank, plan, candidate.items_per_s(config.batch),
                                     [s.time_s for s in candidate.stages])
            if progress is not None:
                progress(f"measuring #{rank}: {plan.describe_stages()}", rank / (len(found_plans) + 1))
            try:
                result.measured = measure_plan(plan, duration_s=config.measure_s)
            except DeviceOutOfMemoryError as exc:
                result.status, result.error = "oom", str(exc)
            except InfermuxError as exc:
                if isinstance(exc, UsageError):
                    raise
                result.status, result.error = "error", str(exc)
            report.candidates.append(result)
            if store is not None and run_id is not None:
                _store_candidate(store, run_id, model, plan, result)
        measured = sorted((c for c in report.candidates if c.measured_items_per_s),
                          key=lambda c: -(c.measured_items_per_s or 0.0))
        best: CandidateResult | None = None
        for tried in measured:
            # A wrong cut or an engine that computes a segment wrong is caught before it is kept.
            tried.agreement = check_plan(tried.plan, model, graph, units)
            if tried.agreement.passed:
                best = tried
                break
            tried.status = "disagrees"
            tried.error = tried.agreement.message
        if best is not None:
            best.chosen = True
            best.plan = best.plan.model_copy(
                update={"measured_items_per_s": best.measured_items_per_s})
            report.best = best.plan
            if store is not None and run_id is not None:
                store.choose_partition_candidate(run_id, best.rank)
        report.status = "complete"
        return report


def _store_candidate(store: Store, run_id: int, model: LoadedModel, plan: ModelEntry,
                     result: CandidateResult) -> None:
    record = result.record()
    store.add_partition_candidate(run_id, record, plan_yaml(plan))
    stages = plan.stages or []
    m = result.measured
    point = {
        "model": model.name, "unit": "|".join("+".join(s.units) for s in stages),
        "engine": "pipeline:" + "|".join(s.engine for s in stages), "batch": stages[0].batch,
        "instances": plan.pipeline_replicas, "data": "host", "status": result.status,
        "valid": m is not None and m.valid,
        "validity_note": "" if m is not None else (result.error or ""),
        "items": m.items if m else 0, "window_s": m.window_s if m else 0.0,
        "items_per_s": result.measured_items_per_s, "error": result.error,
        "plan": plan.describe_stages(), "predicted_items_per_s": result.predicted_items_per_s,
        **({k: v for k, v in m.latency.items() if k.endswith("_ms")} if m else {}),
    }
    # The per-query latencies are in the trial's summary (`latency`), not chunk by chunk.
    store.add_result(run_id, point, [])
