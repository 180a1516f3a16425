"""What every study shares: a grid of runtime plans measured one by one within a budget.

A study owns no measurement code: each point is a Plan run by `infermux.runtime.run_plan`
and stored as a run of kind `run`; the study itself is a run of kind `study` whose
`study_points` rows name each point's parameters, its run and the figures taken from it
(throughput, p99, each unit's items/s). The report reads those rows and the runs they name.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from infermux.errors import DeviceOutOfMemoryError, InfermuxError, UsageError
from infermux.progress import ProgressFn
from infermux.store import Store

__all__ = [
    "MIN_DURATION_S", "Point", "StudyConfig", "StudyReport", "check_budget", "estimate_s",
    "max_duration_s", "measure_points", "unit_of_worker",
]

#: The shortest measured time a study gives a point when its budget is tight.
MIN_DURATION_S = 0.5
#: Trials of a server point: the runtime's peak search runs an offline trial, then bisects the
#: rate six times.
PEAK_TRIALS = 7
#: Seconds around each trial that are not its measured time (warm-up, the drain of the queue).
_TRIAL_SLACK_S = 0.5


@dataclass
class StudyConfig:
    """What a study measures: models, units, batches, instances, how long, within what budget."""

    name: str
    #: Empty: the study's default for the units chosen (lighter where they are CPU core sets).
    models: list[str]
    units: str = "auto"
    batches: list[int] = field(default_factory=lambda: [1, 8, 64])
    instances: list[int] = field(default_factory=lambda: [1, 2])
    engine: str = "auto"
    budget_s: float = 600.0
    #: Each point's minimum duration and query count (offline: samples).
    duration_s: float = 2.0
    min_queries: int = 64
    #: Server load: the p99 bound of the peak search (multi-tenancy); None: 100 ms, or three
    #: times the slowest batch p99 of the models alone offline at the server's batch where
    #: that is longer (one bound for every mode, so the peaks compare).
    p99_ms: float | None = None
    input_shape: tuple[int, ...] | None = None
    #: How the runtime hosts CPU workers: `process` (pinned processes, the runtime's default),
    #: `thread` (starts in a fraction of the time), or `auto`: processes where a GPU is among
    #: the units (its feeding thread keeps this process to itself), threads on a CPU-only host,
    #: where every point starts CPU workers and a child's start-up is most of a point's cost.
    cpu_workers: str = "auto"

    def __post_init__(self) -> None:
        if self.budget_s <= 0:
            raise UsageError(f"--budget {self.budget_s:g}s must be positive, e.g. --budget 10m")
        if any(b < 1 for b in self.batches) or not self.batches:
            raise UsageError(f"--batch {self.batches} must be batch sizes of at least 1")
        if any(k < 1 for k in self.instances) or not self.instances:
            raise UsageError(f"--instances {self.instances} must be counts of at least 1")
        if self.duration_s <= 0:
            raise UsageError(f"--duration {self.duration_s:g}s must be positive, e.g. 2s")
        if self.cpu_workers not in ("auto", "process", "thread"):
            raise UsageError(f"--cpu-workers {self.cpu_workers!r} unknown: use auto, process "
                             "or thread")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (stored with the study's run)."""
        return {"name": self.name, "models": self.models, "units": self.units,
                "batches": self.batches, "instances": self.instances, "engine": self.engine,
                "budget_s": self.budget_s, "duration_s": self.duration_s,
                "min_queries": self.min_queries, "p99_ms": self.p99_ms,
                "input_shape": list(self.input_shape or ()), "cpu_workers": self.cpu_workers}


def max_duration_s(config: StudyConfig) -> float:
    """A point's hard stop, in seconds.

    Generous, so that a slow point on a busy machine still completes its minimum query count
    (a point stopped short is stored as invalid, and says why).
    """
    return max(30.0, 10 * config.duration_s)


@dataclass
class Point:
    """One measurement of a study: a plan (as a dict), what it stands for, and its outcome."""

    variant: str
    params: dict[str, Any]
    plan: dict[str, Any] | None
    status: str = "pending"
    error: str | None = None
    sub_run_id: int | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    #: Builds the plan when the point's turn comes (a pipeline from a partitioning run that
    #: is stored too); None when `plan` is known up front.
    prepare: Callable[[Store | None, dict[str, Any]], dict[str, Any]] | None = field(
        default=None, repr=False)
    #: Part of the study's central comparison: the budget is planned so these all run; the
    #: others (more instances) run with what is left.
    central: bool = True
    #: The offline point of the same mode and batch: its items/s tells how long a server
    #: point's low-rate trials take to reach their query count.
    twin: int | None = None
    #: Seconds its plan's setup takes beyond its trials (a partitioning run, for a pipeline).
    setup_s: float = 0.0

    def record(self, index: int) -> dict[str, Any]:
        """The stored row's content."""
        return {"point": index, "variant": self.variant, "status": self.status,
                "error": self.error, "sub_run_id": self.sub_run_id, "params": self.params,
                "figures": self.figures}


@dataclass
class StudyReport:
    """What a study returns: its run, every point and its headline (the paper-shaped tables)."""

    run_id: int | None
    config: StudyConfig
    points: list[dict[str, Any]]
    headline: dict[str, Any]
    status: str
    elapsed_s: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"run_id": self.run_id, "study": self.config.name, "status": self.status,
                "config": self.config.to_dict(), "elapsed_s": self.elapsed_s,
                "headline": self.headline, "points": self.points}


def unit_of_worker(worker_unit: str, units: Sequence[str]) -> str:
    """The study unit a runtime worker ran on (a CPU worker runs on a share of its unit)."""
    if worker_unit in units or not worker_unit.startswith("cpu") or "|" in worker_unit:
        return worker_unit  # a unit of the study, a GPU or DLA, or a pipeline's stage units
    from infermux.units import parse_core_set

    mine = set(parse_core_set(worker_unit[4:])) if worker_unit.startswith("cpu:") else set()
    for unit in units:
        if unit.startswith("cpu:") and mine <= set(parse_core_set(unit[4:])):
            return unit
    return "cpu" if "cpu" in units else worker_unit


def _figures(report: Any, units: Sequence[str]) -> dict[str, Any]:
    """Throughput, p99 and each unit's and model's items/s of a finished runtime run."""
    from infermux.runtime.trial import TrialSummary

    summary = report.final
    if summary is None:
        summary = TrialSummary.from_dict({})  # no trial ran: every figure empty
    per_unit: dict[str, float] = {}
    batch_p99 = []
    failed = []
    for w in summary.workers.values():
        unit = unit_of_worker(w.unit, units)
        per_unit[unit] = per_unit.get(unit, 0.0) + (w.items_per_s or 0.0)
        if w.batch_p99_ms is not None:
            batch_p99.append(w.batch_p99_ms)
        if not w.ok:
            failed.append(f"{w.worker}: {w.error}")
    per_model = {name: m.items_per_s for name, m in summary.models.items()}
    peak = report.peak or {}
    return {
        "scenario": summary.scenario or None,
        "items_per_s": summary.items_per_s,
        "p99_ms": summary.latency.p99_ms if summary.latency is not None else None,
        "batch_p99_ms": max(batch_p99) if batch_p99 else None,
        "per_unit": per_unit, "per_model": per_model, "valid": summary.valid,
        "notes": summary.validity_notes, "failed_workers": failed,
        "peak_qps": peak.get("peak_qps"), "peak_reason": peak.get("reason"),
        "p99_bound_ms": peak.get("p99_bound_ms"),
    }


def _outcome(point: Point, exc: InfermuxError) -> None:
    text = str(exc)
    point.error = text
    if isinstance(exc, UsageError):
        point.status = "skipped"  # a plan this machine cannot run (e.g. too few cores)
    elif isinstance(exc, DeviceOutOfMemoryError):
        point.status = "oom"
    else:
        point.status = "error"


def _energy(sampler: Any, devices: Sequence[str], t0: int | None, t1: int,
            items: int) -> dict[str, Any]:
    """Energy per item and mean power of a point's measured window (empty without readings)."""
    if sampler is None or t0 is None or not items:
        return {}
    record = sampler.window(t0, t1).summary(list(devices)).record(items)
    return {k: record.get(k) for k in ("energy_per_item_j", "mean_power_w", "energy_source")}


def _startup_s(point: Point, config: StudyConfig) -> float:
    """A guess of the seconds a point takes to build its workers (corrected as points end)."""
    units = point.params.get("units") or []
    if any(not str(u).startswith("cpu") for u in units):
        return 4.0  # a GPU worker: CUDA context, runners per batch bucket
    return 4.0 if config.cpu_workers == "process" else 1.0


def _server(point: Point) -> bool:
    load = (point.plan or {}).get("load") or {}
    return point.params.get("scenario") == "server" or load.get("scenario") == "server"


def estimate_s(point: Point, config: StudyConfig, duration_s: float,
               points: Sequence[Point] = (), startup_s: float | None = None) -> float:
    """The seconds `point` should take if each of its trials is measured for `duration_s`.

    A server point's peak search runs PEAK_TRIALS trials, and those at low rates last until
    their query count: at half its twin's offline items/s (the bisection's first rate),
    `min_queries` queries take min_queries ÷ that rate. `startup_s`: the seconds a point took
    beyond its trials so far on this machine (a guess by default).
    """
    if point.status == "skipped" and point.plan is None and point.prepare is None:
        return 0.0
    trial = duration_s + _TRIAL_SLACK_S
    total = (_startup_s(point, config) if startup_s is None else startup_s) + point.setup_s + trial
    if _server(point):
        slow = duration_s
        twin = points[point.twin] if point.twin is not None and point.twin < len(points) else None
        rate = (twin.figures.get("items_per_s") if twin is not None else None) or 0.0
        if rate > 0:
            slow = max(duration_s, config.min_queries / (0.5 * rate))
        total += (PEAK_TRIALS - 1) * (slow + _TRIAL_SLACK_S)
    return total


def _fit_duration_s(rest: Sequence[Point], config: StudyConfig, points: Sequence[Point],
                    startup_s: float | None, left_s: float) -> float | None:
    """The longest per-trial time, at most `config.duration_s`, that lets `rest` end in time.

    None when even MIN_DURATION_S does not fit `rest` into `left_s`.
    """
    def cost(d: float) -> float:
        return sum(estimate_s(p, config, d, points, startup_s) for p in rest)

    hi = config.duration_s
    lo = min(MIN_DURATION_S, hi)
    if cost(hi) <= left_s:
        return hi
    if cost(lo) > left_s:
        return None
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost(mid) <= left_s else (lo, mid)
    return lo


def _crowds_out(point: Point, rest: Sequence[Point], config: StudyConfig,
                points: Sequence[Point], startup_s: float | None, left_s: float) -> bool:
    """Whether `point` is among the dearest of `rest` that must go for the others to fit.

    When the points left do not fit, the dearest are dropped first, so that as many modes as
    possible keep a figure (a slow model's server search can cost as much as five others).
    """
    floor = min(MIN_DURATION_S, config.duration_s)
    costs = sorted(((estimate_s(p, config, floor, points, startup_s), id(p)) for p in rest),
                   reverse=True)
    total = sum(c for c, _ in costs)
    for cost, key in costs:
        if total <= left_s:
            return False
        if key == id(point):
            return True
        total -= cost
    return False


def check_budget(config: StudyConfig, points: Sequence[Point]) -> dict[str, Any]:
    """Before anything runs: the planned seconds per trial, or a UsageError saying what fits.

    The central points must fit at MIN_DURATION_S a trial (guessed start-up costs included);
    the others are planned with what is left, and those that do not fit are named.
    """
    import math

    central = [p for p in points if p.central]
    need_s = sum(estimate_s(p, config, min(MIN_DURATION_S, config.duration_s), points)
                 for p in central)
    if need_s > config.budget_s:
        servers = sum(1 for p in central if _server(p) and p.plan is not None)
        runs = sum(1 for p in central if p.plan is not None or p.prepare is not None)
        raise UsageError(
            f"--budget {config.budget_s:g}s is too small for study {config.name}: its "
            f"{runs} central points ({servers} of them server peak searches of {PEAK_TRIALS} "
            f"trials) need about {need_s:.0f} s even at {MIN_DURATION_S:g} s a trial; "
            f"--budget {math.ceil(need_s * 1.25 / 60)}m would fit, or pass fewer --batch sizes")
    duration = _fit_duration_s(central, config, points, None, config.budget_s) or MIN_DURATION_S
    left = config.budget_s - sum(estimate_s(p, config, duration, points) for p in central)
    extra = [p for p in points if not p.central and (p.plan is not None or p.prepare)]
    fits = 0
    for p in extra:
        cost = estimate_s(p, config, duration, points)
        if cost > left:
            break
        left -= cost
        fits += 1
    return {"duration_s": duration, "central_points": len(central),
            "other_points": len(extra), "other_points_that_fit": fits,
            "estimate_s": config.budget_s - left}


def measure_points(
    config: StudyConfig,
    points: list[Point],
    *,
    store: Store | None,
    study_run: int | None,
    deadline: float,
    progress: ProgressFn | None = None,
    sampler: Any = None,
    devices: Sequence[str] = (),
) -> str:
    """Run each point's plan in order until the budget ends; returns `complete` or `interrupted`.

    The budget is split over the points still to run: each point's trials are measured for
    `config.duration_s`, or less (not under MIN_DURATION_S) when the central points left would
    not otherwise fit before `deadline`; a point's start-up is estimated from what the points
    so far took beyond their trials. When even that does not fit, the dearest points go first
    (recorded as skipped for the budget, with their estimate), so that most modes keep one.
    A point that cannot run here (a usage error: too few cores for its instances) is
    skipped with the reason; one that fails is recorded with its error and the study goes on.
    """
    overheads: list[float] = []  # seconds each point took beyond its measured trials
    status = "complete"
    floor = min(MIN_DURATION_S, config.duration_s)
    for i, point in enumerate(points):
        if progress is not None:
            progress(f"{config.name}: {point.variant}", i / max(1, len(points)))
        if point.plan is None and point.prepare is None:
            pass  # decided when the grid was built (skipped, with its reason)
        else:
            startup = sum(overheads) / len(overheads) if overheads else None
            left_s = deadline - time.monotonic()
            rest = [p for p in points[i:] if p.central and p.status == "pending"] \
                if point.central else [point]
            duration = _fit_duration_s(rest, config, points, startup, left_s)
            need_s = estimate_s(point, config, floor, points, startup)
            if duration is None and need_s <= left_s and not _crowds_out(
                    point, rest, config, points, startup, left_s):
                duration = floor  # the dearer points after this one will not fit
            if duration is None:
                point.status, point.error = "skipped", (
                    f"budget: not started, about {need_s:.0f} s needed and {max(0.0, left_s):.0f}"
                    " s left for it and the points after it (raise --budget)")
            else:
                started = time.monotonic()
                measured = _measure(config, point, i, duration, store, sampler, points,
                                    devices)
                overheads.append(max(0.0, time.monotonic() - started - measured
                                     - point.setup_s))
        if store is not None and study_run is not None:
            _store_point(store, study_run, i, point)
        if point.status == "interrupted":
            status = "interrupted"
            for rest_point in points[i + 1:]:
                rest_point.status, rest_point.error = "skipped", "the study was interrupted"
            break
    return status


#: The server bound when the models' own batches leave room for it (and with no figure).
DEFAULT_P99_MS = 100.0
#: The most `--p99 auto` allows: past a second a server is not serving (and on a machine so
#: busy that one model's batch takes seconds, no peak is found, and the point says why).
MAX_AUTO_P99_MS = 1000.0


def server_bound_ms(points: Sequence[Point], batch: int | None) -> float:
    """The p99 bound of the server points when none is given.

    100 ms, or three times the slowest batch p99 of the models alone offline at `batch`
    (rounded up to 50 ms) where that is longer, at most MAX_AUTO_P99_MS: a bound that no model
    meets even alone finds no peak for any mode (resnet18 at batch 8 takes longer than 100 ms
    on one core).
    """
    import math

    slowest = [float(p.figures["batch_p99_ms"]) for p in points
               if p.params.get("mode") == "alone" and p.params.get("scenario") == "offline"
               and p.params.get("batch") == batch and p.status == "ok"
               and p.figures.get("batch_p99_ms")]
    if not slowest:
        return DEFAULT_P99_MS
    return min(MAX_AUTO_P99_MS, max(DEFAULT_P99_MS, math.ceil(3 * max(slowest) / 50) * 50))


def _measure(config: StudyConfig, point: Point, i: int, duration_s: float,
             store: Store | None, sampler: Any, points: Sequence[Point],
             devices: Sequence[str]) -> float:
    """Run one point's plan, its trials measured for `duration_s`; fill in its outcome.

    Returns the seconds its trials took (what a point costs beyond its start-up).
    """
    measured_s = 0.0
    from infermux.runtime import parse_plan, run_plan

    marks: dict[str, int] = {}

    def mark(label: str, fraction: float, marks: dict[str, int] = marks) -> None:
        if label == "built":
            marks["t0"] = time.perf_counter_ns()

    point.params["duration_s"] = round(duration_s, 3)
    try:
        if point.plan is None and point.prepare is not None:
            point.plan = point.prepare(store, point.params)
        if point.plan is None:
            raise UsageError(f"point {point.variant!r} has no plan")
        load = {**(point.plan.get("load") or {}), "min_duration_s": duration_s}
        if load.get("find_peak") and load.get("p99_bound_ms") is None:
            load["p99_bound_ms"] = server_bound_ms(points, point.params.get("batch"))
        data = {**point.plan, "load": load,
                "dispatcher": {**(point.plan.get("dispatcher") or {}),
                               "cpu_workers": config.cpu_workers}}
        plan = parse_plan(data, source=f"{config.name} point {i}")
        report = run_plan(plan, store=store, progress=mark,
                          command=f"infermux study {config.name} (point {i})")
        t1 = time.perf_counter_ns()
        measured_s = sum(t.duration_s for t in report.trials)
        point.sub_run_id = report.run_id
        point.figures = _figures(report, point.params.get("units") or [])
        if point.figures.get("scenario") == "offline":
            completed = report.final.completed_items if report.final is not None else 0
            point.figures.update(_energy(sampler, devices, marks.get("t0"), t1, completed))
        if report.status == "interrupted":
            point.status, point.error = "interrupted", "interrupted by the user"
        elif point.figures["failed_workers"]:
            point.status = "error"
            point.error = "; ".join(point.figures["failed_workers"])
        else:
            point.status = "ok" if point.figures["valid"] else "invalid"
            point.error = "; ".join(point.figures["notes"]) or None
    except InfermuxError as exc:
        _outcome(point, exc)
    except KeyboardInterrupt:
        point.status, point.error = "interrupted", "interrupted by the user"
    return measured_s


def _store_point(store: Store, run_id: int, index: int, point: Point) -> None:
    store.add_study_point(run_id, index, point.variant, point.status, point.error,
                          point.sub_run_id, point.params, point.figures)


