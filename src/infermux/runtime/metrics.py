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
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from infermux.load.scenarios import ScenarioResult
from infermux.runtime.dispatcher import Batch, WorkerState
from infermux.runtime.trial import (
    LatencySummary,
    ModelQueries,
    ModelSummary,
    Phases,
    ServerLoad,
    Timeline,
    TimelineRow,
    TrialSummary,
    WorkerSummary,
    latency_of,
)
from infermux.stats import latency_summary_ms

__all__ = ["BatchRecord", "Recorder", "summarise"]


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
            int(getattr(timing, "device_ns", 0) or 0),
            self.clock_ns(),
            self.tokens_of(batch) if self.tokens_of is not None else 0,
        )
        with self._lock:
            self.records.append(rec)


def _phases(records: Sequence[BatchRecord]) -> Phases:
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
    return Phases(_latency(queue), _latency(wait), _latency(compute), _latency(launch),
                  _latency(run), _latency(overhead), _latency(handoff))


def _latency(values_ns: Sequence[int]) -> LatencySummary | None:
    """The latency summary of ns values, None when there are none."""
    return latency_of(latency_summary_ms(values_ns))


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
) -> TrialSummary:
    """The trial's record: scenario headline, per-model and per-worker figures, timeline."""
    run = result.record()
    duration = result.duration_s
    total_items = sum(r.size for r in records) or 1
    models: dict[str, ModelSummary] = {}
    for name in result.models:
        recs = [r for r in records if r.model == name]
        base = ModelQueries.from_dict(run["per_model"][name])
        items = sum(r.size for r in recs)
        rate = base.completed_items / duration if duration else None
        tokens = sum(r.tokens for r in recs)
        # Tokens beside items: each item counts its own length, not its bucket's padding.
        with_tokens = bool(tokens and items)
        models[name] = ModelSummary(
            name, base.issued, base.completed, base.failed, base.unfinished,
            base.completed_items, base.completed / duration if duration else None, rate,
            base.latency, _phases(recs), _histogram(recs), len(recs),
            items / len(recs) if recs else None,
            tokens / items if with_tokens else None,
            rate * tokens / items if with_tokens and rate is not None else None)
    per_worker: dict[str, WorkerSummary] = {}
    for w in workers:
        recs = [r for r in records if r.worker == w.name]
        items = sum(r.size for r in recs)
        busy = sum(r.end_ns - r.start_ns for r in recs) / 1e9
        served: Counter[str] = Counter()
        for r in recs:
            served[r.model] += r.size
        per_worker[w.name] = WorkerSummary(
            w.name, w.unit, worker_models.get(w.name, w.model),
            "ok" if w.alive else ("oom" if w.failure == "oom" else "failed"), w.error,
            len(recs), items,
            items / total_items, dict(served), busy, busy / duration if duration else None,
            items / duration if duration else None, _histogram(recs),
            # One batch from its launch to its outputs on the host (what a bench point times).
            _latency([r.end_ns - r.start_ns for r in recs]),
            {str(b): v / 1e6 for b, v in w.estimate.snapshot(w.model).items()},
            {m: {str(b): v / 1e6 for b, v in w.estimate.snapshot(m).items()}
             for m in w.estimate.models()})
    token_rates = [m.tokens_per_s for m in models.values() if m.tokens_per_s]
    metric = str(run["metric"])
    return TrialSummary(
        result.scenario, bool(run["valid"]), list(run["validity_notes"]), duration,
        run["issued"], run["completed"], run["failed"], run["unfinished"],
        run["completed_items"], run["throughput_qps"], run["items_per_s"],
        latency_of(run["latency"]), bool(run["interrupted"]),
        ServerLoad.from_dict(run) if result.scenario == "server" else None,
        metric, run["metric_value" if metric == "items_per_s" else "metric_value_ms"],
        {m: ModelQueries.from_dict(v) for m, v in run["per_model"].items()}, models,
        per_worker, timeline(records, result.start_ns, duration, timeline_bins),
        [{**e, "t_s": (e["t_ns"] - result.start_ns) / 1e9} for e in events
         if e["t_ns"] >= result.start_ns],
        tokens_per_s=sum(token_rates) if token_rates else None)


def timeline(records: Sequence[BatchRecord], start_ns: int, duration_s: float,
             bins: int) -> Timeline:
    """Items each worker served for each model, per time bin (by batch completion)."""
    if not records or duration_s <= 0:
        return Timeline(0.0, [])
    bin_s = duration_s / bins
    table: Counter[tuple[int, str, str, str]] = Counter()
    for r in records:
        idx = min(bins - 1, max(0, int((r.end_ns - start_ns) / 1e9 / bin_s)))
        table[(idx, r.worker, r.unit, r.model)] += r.size
    rows = [TimelineRow(round(i * bin_s, 4), w, u, m, n)
            for (i, w, u, m), n in sorted(table.items())]
    return Timeline(bin_s, rows)


def records_array(records: Sequence[BatchRecord]) -> list[dict[str, Any]]:
    """Batch records as plain dicts (for JSON)."""
    return [asdict(r) for r in records]


def percentile_ms(values_ns: Sequence[int], q: float) -> float | None:
    """One percentile of ns values, in ms."""
    if not values_ns:
        return None
    return float(np.percentile(np.asarray(values_ns, dtype=np.float64), q) / 1e6)
