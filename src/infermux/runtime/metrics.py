"""Run metrics: raw batch records in, per-run / per-model / per-worker figures out.

A batch record is the raw sample (who ran which items when); every figure is derived from the
records and the load generator's per-query timings. Each item's latency splits into
- queueing: from arrival until a free worker of its model could take it,
- batching wait: from then until its batch was taken (waiting for a fuller batch),
- compute: from the take to the batch's completion (gather, copies, the run), itself split into
  - launch: from the take to the batch's launch (the gather, and the wait for the worker's
    running batch when it was taken ahead of that batch's end),
  - run: from the launch to the outputs collected on the host,
  - host_overhead: what of `run` the device did not account for (GPU runners time their copies
    and compute with CUDA events): launch calls, the collecting thread's wake-up,
- handoff: from the completion stamp to the worker handing the batch to the dispatcher (the
  completion callback runs then; the latency stamp is the completion, not the hand-over).
The load generator's own lateness is the scenario record's `issue_lag`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from infermux.load.scenarios import ScenarioResult
from infermux.runtime.dispatcher import Batch, WorkerState
from infermux.stats import latency_summary_ms

__all__ = ["BatchRecord", "ModelSummary", "Recorder", "TrialSummary", "WorkerSummary", "completed_items",
           "summarise"]

#: How a worker ended a trial: serving, out of device memory, or failed otherwise.
WorkerStatus = Literal["ok", "oom", "failed"]


@dataclass(frozen=True)
class WorkerSummary:
    """One worker's figures in a trial, read from the trial's record."""

    worker: str
    unit: str
    model: str
    status: WorkerStatus
    error: str | None
    batches: int
    items: int
    items_per_s: float | None
    #: One batch from its launch to its outputs on the host (what a bench point times).
    batch_p99_ms: float | None

    @property
    def ok(self) -> bool:
        """Still serving at the end of the trial."""
        return self.status == "ok"

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> WorkerSummary:
        """The typed view of one entry of a trial record's `workers`."""
        status = rec.get("status")
        return cls(str(rec.get("worker")), str(rec.get("unit")), str(rec.get("model")),
                   status if status in ("ok", "oom") else "failed", rec.get("error"),
                   int(rec.get("batches") or 0), int(rec.get("items") or 0),
                   rec.get("items_per_s"), (rec.get("batch_latency") or {}).get("p99_ms"))


def completed_items(rec: dict[str, Any]) -> int:
    """Items a trial record (or one model's entry) completed.

    Records stored before the key was named for items call it `completed_samples`.
    """
    n = rec.get("completed_items")
    if n is None:
        n = rec.get("completed_samples")
    return int(n or 0)


@dataclass(frozen=True)
class ModelSummary:
    """One model's figures in a trial."""

    model: str
    completed_items: int
    items_per_s: float | None
    p99_ms: float | None

    @classmethod
    def from_record(cls, name: str, rec: dict[str, Any]) -> ModelSummary:
        """The typed view of one entry of a trial record's `models`."""
        return cls(name, completed_items(rec),
                   rec.get("items_per_s"), (rec.get("latency") or {}).get("p99_ms"))


@dataclass(frozen=True)
class TrialSummary:
    """A trial's headline, per model and per worker, typed; `record` is the stored dict."""

    scenario: str
    valid: bool
    validity_notes: list[str]
    items_per_s: float | None
    completed_items: int
    models: dict[str, ModelSummary]
    workers: dict[str, WorkerSummary]
    #: A pipeline model's stage figures, by model.
    pipelines: dict[str, list[dict[str, Any]]]
    record: dict[str, Any] = field(repr=False)

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

    @classmethod
    def from_record(cls, rec: dict[str, Any] | None) -> TrialSummary:
        """The typed view of a trial record (`summarise`'s output); empty for None."""
        rec = rec or {}
        return cls(
            str(rec.get("scenario") or ""), bool(rec.get("valid")),
            list(rec.get("validity_notes") or []), rec.get("items_per_s"),
            completed_items(rec),
            {n: ModelSummary.from_record(n, m) for n, m in (rec.get("models") or {}).items()},
            {n: WorkerSummary.from_record(w) for n, w in (rec.get("workers") or {}).items()},
            dict(rec.get("pipelines") or {}), rec)


@dataclass
class BatchRecord:
    """One completed batch."""

    worker: str
    unit: str
    model: str
    size: int
    bucket: int
    taken_ns: int
    start_ns: int
    end_ns: int
    enqueued_ns: list[int]
    ready_ns: list[int]
    device_compute_ns: int = 0
    #: The device's own time for the batch (copies and compute), 0 where not measured.
    device_ns: int = 0
    #: When the worker handed the finished batch to the dispatcher, 0 where not recorded.
    handed_ns: int = 0
    #: Tokens of the batch's items, each at its own length (models with a sequence length).
    tokens: int = 0


class Recorder:
    """Collects batch records from worker threads (installed as the dispatcher's hook)."""

    def __init__(self, clock_ns: Callable[[], int] = time.perf_counter_ns) -> None:
        self.records: list[BatchRecord] = []
        self._lock = threading.Lock()
        #: The workers' clock: a batch's hand-over is stamped with it.
        self.clock_ns = clock_ns
        #: A batch's tokens (its items' own lengths), for models with a sequence length.
        self.tokens_of: Callable[[Batch], int] | None = None

    def reset(self) -> None:
        """Forget everything (between the trials of a peak search)."""
        with self._lock:
            self.records = []

    def on_batch_done(self, w: WorkerState, batch: Batch, start_ns: int, end_ns: int,
                      timing: Any) -> None:
        """The dispatcher's hook: one record per finished batch."""
        rec = BatchRecord(
            w.name, w.unit, batch.model, len(batch.items), batch.bucket, batch.taken_ns,
            start_ns, end_ns, [it.enqueued_ns for it in batch.items], list(batch.ready_ns),
            int(getattr(timing, "compute_ns", 0) or 0),
            sum(int(getattr(timing, k, 0) or 0) for k in ("h2d_ns", "compute_ns", "d2h_ns")),
            self.clock_ns(),
            self.tokens_of(batch) if self.tokens_of is not None else 0,
        )
        with self._lock:
            self.records.append(rec)


def _phases(records: Sequence[BatchRecord]) -> dict[str, dict[str, float]]:
    """Per-item phase percentiles (ms); see the module docstring for what each covers."""
    queue, wait, compute, launch, run, overhead, handoff = [], [], [], [], [], [], []
    for r in records:
        n = len(r.enqueued_ns)
        for enq, ready in zip(r.enqueued_ns, r.ready_ns, strict=True):
            queue.append(ready - enq)
            wait.append(max(0, r.taken_ns - ready))
        compute += [r.end_ns - r.taken_ns] * n
        launch += [max(0, r.start_ns - r.taken_ns)] * n
        run += [r.end_ns - r.start_ns] * n
        if r.device_ns:
            overhead += [max(0, r.end_ns - r.start_ns - r.device_ns)] * n
        if r.handed_ns:
            handoff += [max(0, r.handed_ns - r.end_ns)] * n
    out = {"queueing": latency_summary_ms(queue), "batching_wait": latency_summary_ms(wait),
           "compute": latency_summary_ms(compute), "launch": latency_summary_ms(launch),
           "run": latency_summary_ms(run)}
    if overhead:
        out["host_overhead"] = latency_summary_ms(overhead)
    if handoff:
        out["handoff"] = latency_summary_ms(handoff)
    return out


def _histogram(records: Sequence[BatchRecord]) -> dict[str, int]:
    counts = Counter(r.size for r in records)
    return {str(k): counts[k] for k in sorted(counts)}


def summarise(
    result: ScenarioResult,
    records: Sequence[BatchRecord],
    workers: Sequence[WorkerState],
    worker_models: dict[str, str],
    *,
    events: Sequence[dict[str, Any]] = (),
    timeline_bins: int = 20,
) -> dict[str, Any]:
    """The run's record: scenario headline, per-model and per-worker figures, timeline."""
    run = result.record()
    duration = result.duration_s
    total_items = sum(r.size for r in records) or 1
    models: dict[str, dict[str, Any]] = {}
    for name in result.models:
        recs = [r for r in records if r.model == name]
        base = run["per_model"][name]
        items = sum(r.size for r in recs)
        models[name] = {
            "model": name,
            **{k: base[k] for k in ("issued", "completed", "failed", "unfinished",
                                    "completed_items")},
            "throughput_qps": base["completed"] / duration if duration else None,
            "items_per_s": base["completed_items"] / duration if duration else None,
            "latency": base["latency"],
            "phases": _phases(recs),
            "batch_histogram": _histogram(recs),
            "batches": len(recs),
            "mean_batch": items / len(recs) if recs else None,
        }
        tokens = sum(r.tokens for r in recs)
        if tokens and items:
            # Tokens beside items: each item counts its own length, not its bucket's padding.
            rate = models[name]["items_per_s"]
            models[name]["mean_length"] = tokens / items
            models[name]["tokens_per_s"] = rate * tokens / items if rate is not None else None
    per_worker: dict[str, dict[str, Any]] = {}
    for w in workers:
        recs = [r for r in records if r.worker == w.name]
        items = sum(r.size for r in recs)
        busy = sum(r.end_ns - r.start_ns for r in recs) / 1e9
        served: Counter[str] = Counter()
        for r in recs:
            served[r.model] += r.size
        per_worker[w.name] = {
            "worker": w.name, "unit": w.unit, "model": worker_models.get(w.name, w.model),
            "status": "ok" if w.alive else (w.failure or "failed"), "error": w.error,
            "batches": len(recs), "items": items, "share": items / total_items,
            "items_by_model": dict(served),
            "busy_s": busy, "utilisation": busy / duration if duration else None,
            "items_per_s": items / duration if duration else None,
            "batch_histogram": _histogram(recs),
            # One batch from its launch to its outputs on the host (what a bench point times).
            "batch_latency": latency_summary_ms([r.end_ns - r.start_ns for r in recs]),
            "latency_estimate_ms": {str(b): v / 1e6
                                    for b, v in w.estimate.snapshot(w.model).items()},
            "latency_estimate_ms_by_model": {
                m: {str(b): v / 1e6 for b, v in w.estimate.snapshot(m).items()}
                for m in w.estimate.models()},
        }
    run["models"] = models
    token_rates = [m["tokens_per_s"] for m in models.values() if m.get("tokens_per_s")]
    if token_rates:
        run["tokens_per_s"] = sum(token_rates)
    run["workers"] = per_worker
    run["timeline"] = timeline(records, result.start_ns, duration, timeline_bins)
    run["events"] = [{**e, "t_s": (e["t_ns"] - result.start_ns) / 1e9} for e in events
                     if e["t_ns"] >= result.start_ns]
    return run


def timeline(records: Sequence[BatchRecord], start_ns: int, duration_s: float,
             bins: int) -> dict[str, Any]:
    """Items each worker served for each model, per time bin (by batch completion)."""
    if not records or duration_s <= 0:
        return {"bin_s": 0.0, "rows": []}
    bin_s = duration_s / bins
    table: Counter[tuple[int, str, str, str]] = Counter()
    for r in records:
        idx = min(bins - 1, max(0, int((r.end_ns - start_ns) / 1e9 / bin_s)))
        table[(idx, r.worker, r.unit, r.model)] += r.size
    rows = [{"t_s": round(i * bin_s, 4), "worker": w, "unit": u, "model": m, "items": n}
            for (i, w, u, m), n in sorted(table.items())]
    return {"bin_s": bin_s, "rows": rows}


def records_array(records: Sequence[BatchRecord]) -> list[dict[str, Any]]:
    """Batch records as plain dicts (for JSON)."""
    return [asdict(r) for r in records]


def percentile_ms(values_ns: Sequence[int], q: float) -> float | None:
    """One percentile of ns values, in ms."""
    if not values_ns:
        return None
    return float(np.percentile(np.asarray(values_ns, dtype=np.float64), q) / 1e6)
