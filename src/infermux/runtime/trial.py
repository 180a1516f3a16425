"""A runtime trial's record as types: the trial, per model, per worker, its phases and timeline.

`runtime.metrics.summarise` makes a `TrialSummary`, the trial loop (`runtime.peak`) and the
runtime (`TrialRuntime.trial_details`) add their parts, and everything after reads it by
attribute. `to_dict()` is the stored JSON and the `--json` output (keys in the order the record
has always had, parts a trial did not have left out); `from_dict()` reads every version the
store holds: records from before a quantity was named for items (`completed_samples`,
`throughput_samples_per_s`, a worker's `samples`) read as items, and fields added since
(phases' `launch`/`run`, the loop's counters, tokens) read as absent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from infermux.stats import LatencySummary

__all__ = ["ClusterTrial", "LatencySummary", "ModelQueries", "ModelSummary", "Phases",
           "ServerLoad", "Timeline", "TimelineRow", "TrialSummary", "WorkerStatus",
           "WorkerSummary", "completed_items", "latency_of"]

#: How a worker ended a trial: serving, out of device memory, or failed otherwise.
WorkerStatus = Literal["ok", "oom", "failed"]

_PERCENTILE_KEYS = ("p50_ms", "p90_ms", "p95_ms", "p99_ms", "max_ms", "mean_ms")


def latency_of(data: dict[str, Any] | None) -> LatencySummary | None:
    """A stored latency summary, None for an empty one (nothing was measured)."""
    if not data or any(data.get(k) is None for k in _PERCENTILE_KEYS):
        return None
    return LatencySummary.from_dict(data)


def _lat(latency: LatencySummary | None) -> dict[str, float]:
    return latency.to_dict() if latency is not None else {}


def completed_items(rec: dict[str, Any]) -> int:
    """Items a stored trial record (or one model's entry) completed.

    Records stored before the key was named for items call it `completed_samples`.
    """
    n = rec.get("completed_items")
    if n is None:
        n = rec.get("completed_samples")
    return int(n or 0)


def _items_per_s(rec: dict[str, Any]) -> float | None:
    """A stored rate of items; older records name it `throughput_samples_per_s`."""
    if "items_per_s" in rec:
        return rec["items_per_s"]
    return rec.get("throughput_samples_per_s")


def _counts(rec: dict[str, Any]) -> tuple[int, int, int, int, int]:
    return (int(rec.get("issued") or 0), int(rec.get("completed") or 0),
            int(rec.get("failed") or 0), int(rec.get("unfinished") or 0), completed_items(rec))


@dataclass(frozen=True, slots=True)
class ModelQueries:
    """One model's queries as the load generator saw them (the record's `per_model`)."""

    issued: int
    completed: int
    failed: int
    unfinished: int
    completed_items: int
    latency: LatencySummary | None

    def to_dict(self) -> dict[str, Any]:
        """The stored entry."""
        return {"issued": self.issued, "completed": self.completed, "failed": self.failed,
                "unfinished": self.unfinished, "completed_items": self.completed_items,
                "latency": _lat(self.latency)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelQueries:
        """Read a stored entry."""
        return cls(*_counts(data), latency_of(data.get("latency")))


@dataclass(frozen=True, slots=True)
class Phases:
    """Where each item's time went, per phase (see `runtime.metrics` for what each covers)."""

    queueing: LatencySummary | None
    batching_wait: LatencySummary | None
    compute: LatencySummary | None
    launch: LatencySummary | None
    run: LatencySummary | None
    #: Of `run`, what the device did not account for (GPU runners only).
    host_overhead: LatencySummary | None = None
    #: From the completion stamp to the hand-over to the dispatcher (where recorded).
    handoff: LatencySummary | None = None

    def to_dict(self) -> dict[str, dict[str, float]]:
        """The stored phases; the last two only where measured."""
        out = {"queueing": _lat(self.queueing), "batching_wait": _lat(self.batching_wait),
               "compute": _lat(self.compute), "launch": _lat(self.launch), "run": _lat(self.run)}
        if self.host_overhead is not None:
            out["host_overhead"] = self.host_overhead.to_dict()
        if self.handoff is not None:
            out["handoff"] = self.handoff.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Phases:
        """Read stored phases (older records lack `launch` and `run`)."""
        data = data or {}
        return cls(*(latency_of(data.get(k)) for k in ("queueing", "batching_wait", "compute",
                                                        "launch", "run", "host_overhead",
                                                        "handoff")))


@dataclass(frozen=True, slots=True)
class ModelSummary:
    """One model's figures in a trial (the record's `models`)."""

    model: str
    issued: int
    completed: int
    failed: int
    unfinished: int
    completed_items: int
    throughput_qps: float | None
    items_per_s: float | None
    latency: LatencySummary | None
    phases: Phases
    #: Batches by size (the size as a string, as JSON keeps it).
    batch_histogram: dict[str, int]
    batches: int
    mean_batch: float | None
    #: Models with a sequence length: mean tokens per item and tokens per second.
    mean_length: float | None = None
    tokens_per_s: float | None = None

    @property
    def p99_ms(self) -> float | None:
        """The model's query latency p99."""
        return self.latency.p99_ms if self.latency is not None else None

    def to_dict(self) -> dict[str, Any]:
        """The stored entry."""
        out: dict[str, Any] = {
            "model": self.model, "issued": self.issued, "completed": self.completed,
            "failed": self.failed, "unfinished": self.unfinished,
            "completed_items": self.completed_items, "throughput_qps": self.throughput_qps,
            "items_per_s": self.items_per_s, "latency": _lat(self.latency),
            "phases": self.phases.to_dict(), "batch_histogram": self.batch_histogram,
            "batches": self.batches, "mean_batch": self.mean_batch}
        if self.mean_length is not None:
            out["mean_length"] = self.mean_length
            out["tokens_per_s"] = self.tokens_per_s
        return out

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any]) -> ModelSummary:
        """Read a stored entry (`name` where an old entry does not carry its own)."""
        return cls(str(data.get("model") or name), *_counts(data), data.get("throughput_qps"),
                   _items_per_s(data), latency_of(data.get("latency")),
                   Phases.from_dict(data.get("phases")), dict(data.get("batch_histogram") or {}),
                   int(data.get("batches") or 0), data.get("mean_batch"),
                   data.get("mean_length"), data.get("tokens_per_s"))


@dataclass(frozen=True, slots=True)
class WorkerSummary:
    """One worker's figures in a trial (the record's `workers`)."""

    worker: str
    unit: str
    model: str
    status: WorkerStatus
    error: str | None
    batches: int
    items: int
    share: float
    items_by_model: dict[str, int]
    busy_s: float
    utilisation: float | None
    items_per_s: float | None
    batch_histogram: dict[str, int]
    #: One batch from its launch to its outputs on the host (what a bench point times).
    batch_latency: LatencySummary | None
    #: The worker's batch latency estimate per bucket (its own model, and by model).
    latency_estimate_ms: dict[str, float]
    latency_estimate_ms_by_model: dict[str, dict[str, float]]

    @property
    def ok(self) -> bool:
        """Still serving at the end of the trial."""
        return self.status == "ok"

    @property
    def batch_p99_ms(self) -> float | None:
        """One batch's p99 from its launch to its outputs on the host."""
        return self.batch_latency.p99_ms if self.batch_latency is not None else None

    def to_dict(self) -> dict[str, Any]:
        """The stored entry."""
        return {"worker": self.worker, "unit": self.unit, "model": self.model,
                "status": self.status, "error": self.error, "batches": self.batches,
                "items": self.items, "share": self.share, "items_by_model": self.items_by_model,
                "busy_s": self.busy_s, "utilisation": self.utilisation,
                "items_per_s": self.items_per_s, "batch_histogram": self.batch_histogram,
                "batch_latency": _lat(self.batch_latency),
                "latency_estimate_ms": self.latency_estimate_ms,
                "latency_estimate_ms_by_model": self.latency_estimate_ms_by_model}

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any]) -> WorkerSummary:
        """Read a stored entry (older ones count `samples`, not items)."""
        items = data.get("items", data.get("samples"))
        status = data.get("status")
        return cls(str(data.get("worker") or name), str(data.get("unit")),
                   str(data.get("model")), status if status in ("ok", "oom") else "failed",
                   data.get("error"), int(data.get("batches") or 0), int(items or 0),
                   float(data.get("share") or 0.0),
                   dict(data.get("items_by_model", data.get("samples_by_model")) or {}),
                   float(data.get("busy_s") or 0.0), data.get("utilisation"),
                   _items_per_s(data), dict(data.get("batch_histogram") or {}),
                   latency_of(data.get("batch_latency")),
                   dict(data.get("latency_estimate_ms") or {}),
                   dict(data.get("latency_estimate_ms_by_model") or {}))


@dataclass(frozen=True, slots=True)
class TimelineRow:
    """Items one worker served for one model in one time bin (by batch completion)."""

    t_s: float
    worker: str
    unit: str
    model: str
    items: int

    def to_dict(self) -> dict[str, Any]:
        """The stored row."""
        return {"t_s": self.t_s, "worker": self.worker, "unit": self.unit,
                "model": self.model, "items": self.items}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TimelineRow:
        """Read a stored row (older ones count `samples`)."""
        return cls(float(data.get("t_s") or 0.0), str(data.get("worker")), str(data.get("unit")),
                   str(data.get("model")), int(data.get("items", data.get("samples")) or 0))


@dataclass(frozen=True, slots=True)
class Timeline:
    """The trial's items per worker, model and time bin."""

    bin_s: float
    rows: list[TimelineRow]

    def to_dict(self) -> dict[str, Any]:
        """The stored timeline."""
        return {"bin_s": self.bin_s, "rows": [r.to_dict() for r in self.rows]}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Timeline:
        """Read a stored timeline."""
        data = data or {}
        return cls(float(data.get("bin_s") or 0.0),
                   [TimelineRow.from_dict(r) for r in data.get("rows") or []])


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """A server trial's own figures: its rate and how the load generator kept to it."""

    rate_qps: float | None
    achieved_issue_rate_qps: float | None
    #: The latency from each query's issue, not its due time (hides the generator's lag).
    latency_from_issue: LatencySummary | None
    #: From each query's due time to its issue.
    issue_lag: LatencySummary | None
    #: The generator fell behind its schedule (`load.scenarios.lag_note`), and what it says.
    load_generator_lag: bool
    load_generator_note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record's server keys."""
        out: dict[str, Any] = {
            "rate_qps": self.rate_qps, "achieved_issue_rate_qps": self.achieved_issue_rate_qps,
            "latency_from_issue": _lat(self.latency_from_issue),
            "issue_lag": _lat(self.issue_lag), "load_generator_lag": self.load_generator_lag}
        if self.load_generator_note is not None:
            out["load_generator_note"] = self.load_generator_note
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServerLoad:
        """Read a stored record's server keys."""
        return cls(data.get("rate_qps"), data.get("achieved_issue_rate_qps"),
                   latency_of(data.get("latency_from_issue")), latency_of(data.get("issue_lag")),
                   bool(data.get("load_generator_lag")), data.get("load_generator_note"))


@dataclass(frozen=True, slots=True)
class ClusterTrial:
    """What a cluster's runtime adds to a trial (`cluster.runtime.ClusterRuntime`)."""

    #: One row per node: its status, share, rates, routing counts and its own facts.
    nodes: list[dict[str, Any]]
    node_timeline: dict[str, Any]
    cluster_events: list[dict[str, Any]]
    #: The router's costs: pieces routed, per piece/call/answer, poll round trips.
    routing: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """The record's cluster keys."""
        return {"nodes": self.nodes, "node_timeline": self.node_timeline,
                "cluster_events": self.cluster_events, "routing": self.routing}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterTrial:
        """Read a stored record's cluster keys."""
        return cls(list(data.get("nodes") or []), dict(data.get("node_timeline") or {}),
                   list(data.get("cluster_events") or []), dict(data.get("routing") or {}))


@dataclass(frozen=True, slots=True)
class TrialSummary:
    """One runtime trial: the scenario's headline, per model, per worker, its timeline.

    Made by `runtime.metrics.summarise`; the trial loop adds `settings` and its counters, the
    runtime its `pipelines` or `cluster` part. Parts a trial did not have are None and left
    out of `to_dict()`.
    """

    scenario: str
    valid: bool
    validity_notes: list[str]
    duration_s: float
    issued: int
    completed: int
    failed: int
    unfinished: int
    completed_items: int
    throughput_qps: float | None
    items_per_s: float | None
    latency: LatencySummary | None
    interrupted: bool
    #: The server scenario's rate and load-generator figures (None for other scenarios).
    server: ServerLoad | None
    #: The scenario's metric: a latency percentile (`p99_ms`, ...) or `items_per_s`.
    metric: str
    metric_value: float | None
    per_model: dict[str, ModelQueries]
    models: dict[str, ModelSummary]
    workers: dict[str, WorkerSummary]
    timeline: Timeline
    #: Dispatcher events in the trial (worker failures, restarts), with `t_s` from its start.
    events: list[dict[str, Any]]
    #: Summed over models with a sequence length.
    tokens_per_s: float | None = None
    #: The trial's `load:` settings.
    settings: dict[str, Any] | None = None
    #: A pipeline model's stage figures, by model (`runtime.pipelined`).
    pipelines: dict[str, list[dict[str, Any]]] | None = None
    cluster: ClusterTrial | None = None
    retried_items: int | None = None
    failed_items: int | None = None
    dropped_from_earlier_trial: int | None = None
    #: The trial's number in its run.
    trial: int | None = None
    #: The runtime process's garbage-collector pauses in the trial (`runtime.gcpause`).
    gc: dict[str, Any] | None = None

    @property
    def rate_qps(self) -> float | None:
        """A server trial's rate (None for other scenarios)."""
        return self.server.rate_qps if self.server is not None else None

    @property
    def load_generator_lag(self) -> bool:
        """A server trial whose generator fell behind its schedule."""
        return self.server is not None and self.server.load_generator_lag

    @property
    def failed_workers(self) -> list[WorkerSummary]:
        """Workers that did not end the trial serving."""
        return [w for w in self.workers.values() if not w.ok]

    def failures(self) -> str:
        """One line per distinct failure, naming the workers it took out (empty when none).

        Four workers that ran out of memory the same way are one message, not four.
        """
        errors: dict[str, list[str]] = {}
        for w in self.failed_workers:
            errors.setdefault(w.error or w.status, []).append(w.worker)
        return "; ".join(f"{text} ({', '.join(names)})" if len(names) > 1 else text
                         for text, names in errors.items())

    def to_dict(self) -> dict[str, Any]:
        """The stored record and the `--json` output, keys in the record's order."""
        out: dict[str, Any] = {
            "scenario": self.scenario, "valid": self.valid, "validity_notes": self.validity_notes,
            "duration_s": self.duration_s, "issued": self.issued, "completed": self.completed,
            "failed": self.failed, "unfinished": self.unfinished,
            "completed_items": self.completed_items, "throughput_qps": self.throughput_qps,
            "items_per_s": self.items_per_s, "latency": _lat(self.latency),
            "interrupted": self.interrupted}
        if self.server is not None:
            out.update(self.server.to_dict())
        out["metric"] = self.metric
        out["metric_value" if self.metric == "items_per_s" else "metric_value_ms"] = \
            self.metric_value
        out["per_model"] = {n: m.to_dict() for n, m in self.per_model.items()}
        out["models"] = {n: m.to_dict() for n, m in self.models.items()}
        if self.tokens_per_s is not None:
            out["tokens_per_s"] = self.tokens_per_s
        out["workers"] = {n: w.to_dict() for n, w in self.workers.items()}
        out["timeline"] = self.timeline.to_dict()
        out["events"] = self.events
        if self.settings is not None:
            out["settings"] = self.settings
        if self.pipelines is not None:
            out["pipelines"] = self.pipelines
        if self.cluster is not None:
            out.update(self.cluster.to_dict())
        for key, value in (("retried_items", self.retried_items),
                           ("failed_items", self.failed_items),
                           ("dropped_from_earlier_trial", self.dropped_from_earlier_trial),
                           ("trial", self.trial), ("gc", self.gc)):
            if value is not None:
                out[key] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialSummary:
        """Read a stored record, of this version or an earlier one."""
        scenario = str(data.get("scenario") or "")
        server = (ServerLoad.from_dict(data) if scenario == "server" or "rate_qps" in data
                  else None)
        metric = str(data.get("metric") or "items_per_s")
        value = data.get("metric_value_ms") if "metric_value_ms" in data else data.get(
            "metric_value")
        return cls(
            scenario, bool(data.get("valid")), list(data.get("validity_notes") or []),
            float(data.get("duration_s") or 0.0), *_counts(data), data.get("throughput_qps"),
            _items_per_s(data), latency_of(data.get("latency")), bool(data.get("interrupted")),
            server, metric, value,
            {n: ModelQueries.from_dict(m) for n, m in (data.get("per_model") or {}).items()},
            {n: ModelSummary.from_dict(n, m) for n, m in (data.get("models") or {}).items()},
            {n: WorkerSummary.from_dict(n, w) for n, w in (data.get("workers") or {}).items()},
            Timeline.from_dict(data.get("timeline")), list(data.get("events") or []),
            data.get("tokens_per_s"), data.get("settings"), data.get("pipelines"),
            ClusterTrial.from_dict(data) if "nodes" in data else None,
            data.get("retried_items"), data.get("failed_items"),
            data.get("dropped_from_earlier_trial"), data.get("trial"), data.get("gc"))
