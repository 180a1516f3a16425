"""The runtime's public face: what a front (serve, a cluster node, the supervisor) drives.

`Runtime` is the protocol every front codes against: submit queries (with their own input rows
to get outputs back), subscribe to outputs per batch, to completions per query and to batch
statistics, read readiness and counters, and stop (draining what is queued, or not). Two
implementations exist: `LocalRuntime` (this machine's workers, from `start_runtime`) and
`infermux.cluster.runtime.ClusterRuntime` (the nodes of a Ray cluster); mypy checks both
against the protocol.

Subscriptions replace the dispatcher's single hooks: the runtime installs its own hooks once
and hands every event to each subscriber in the order they subscribed, so a front never swaps
or chains a hook another part set, and `Subscription.cancel()` ends one cleanly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from infermux.load.base import CompletionFn, Query
from infermux.runtime.dispatcher import Batch, WorkerState
from infermux.runtime.gcpause import freeze_since
from infermux.runtime.trial import TrialSummary

if TYPE_CHECKING:
    from infermux.load.scenarios import ScenarioResult
    from infermux.runtime.local import _Runtime
    from infermux.runtime.metrics import BatchRecord
    from infermux.runtime.plan import Plan

__all__ = ["BatchFn", "FailureFn", "LocalRuntime", "OutputsFn", "RejectionFn", "Runtime", "RuntimeStats",
           "Subscription", "SubscriptionHub", "TrialCounts", "TrialRuntime"]

#: A batch's output rows: (the batch, one array per model output, a row per item).
OutputsFn = Callable[[Batch, list[np.ndarray]], None]
#: A batch that ran: (worker, batch, start ns, end ns, the runner's timing or None).
BatchFn = Callable[[WorkerState, Batch, int, int, Any], None]
#: A worker just taken out of service.
FailureFn = Callable[[WorkerState], None]
#: Queries whose own input the engine rejected (the worker stays in service), and why.
RejectionFn = Callable[[list[int], str], None]


@dataclass(frozen=True)
class RuntimeStats:
    """Counters of the runtime since it started (or since the trial began)."""

    #: Items run again after the worker holding them failed.
    retried_items: int
    #: Items given up on (answered with an error).
    failed_items: int
    #: Items waiting per model.
    queued_items: dict[str, int]


@dataclass
class TrialCounts:
    """What a trial leaves behind besides its completions: batch records, events, counters."""

    records: list[BatchRecord]
    events: list[dict[str, Any]]
    retried_items: int
    failed_items: int
    #: Every worker's state at the trial's end (what the summary's per-worker rows read).
    workers: list[WorkerState] = field(default_factory=list)


class Subscription:
    """One subscriber's callbacks; `cancel()` stops them (idempotent)."""

    def __init__(self, hub: SubscriptionHub, entry: _Entry) -> None:
        self._hub = hub
        self._entry = entry

    def cancel(self) -> None:
        """No more calls to this subscriber's callbacks."""
        self._hub._remove(self._entry)


@dataclass(eq=False)
class _Entry:
    outputs: OutputsFn | None = None
    completions: CompletionFn | None = None
    batches: BatchFn | None = None
    failures: FailureFn | None = None
    rejections: RejectionFn | None = None


@dataclass
class SubscriptionHub:
    """Fans the runtime's events out to its subscribers, in the order they subscribed.

    The callbacks run on the thread that produced the event (a worker, a poller); the list of
    subscribers is copied under a lock, so subscribing or cancelling never races a delivery.
    """

    _entries: tuple[_Entry, ...] = ()
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def subscribe(self, *, outputs: OutputsFn | None = None,
                  completions: CompletionFn | None = None, batches: BatchFn | None = None,
                  failures: FailureFn | None = None,
                  rejections: RejectionFn | None = None) -> Subscription:
        """Add a subscriber; any callback left None is not called."""
        entry = _Entry(outputs, completions, batches, failures, rejections)
        with self._lock:
            self._entries = (*self._entries, entry)
        return Subscription(self, entry)

    def _remove(self, entry: _Entry) -> None:
        with self._lock:
            self._entries = tuple(e for e in self._entries if e is not entry)

    def outputs(self, batch: Batch, outputs: list[np.ndarray]) -> None:
        """Deliver a batch's output rows."""
        for e in self._entries:
            if e.outputs is not None:
                e.outputs(batch, outputs)

    def completions(self, done: Sequence[tuple[int, int]], ok: bool, when_ns: int) -> None:
        """Deliver finished (or failed) samples per query."""
        for e in self._entries:
            if e.completions is not None:
                e.completions(done, ok, when_ns)

    def batches(self, w: WorkerState, batch: Batch, start_ns: int, end_ns: int,
                timing: Any) -> None:
        """Deliver a batch that ran."""
        for e in self._entries:
            if e.batches is not None:
                e.batches(w, batch, start_ns, end_ns, timing)

    def failures(self, w: WorkerState) -> None:
        """Deliver a worker taken out of service."""
        for e in self._entries:
            if e.failures is not None:
                e.failures(w)

    def rejections(self, queries: list[int], reason: str) -> None:
        """Deliver queries failed alone because their own input was at fault."""
        for e in self._entries:
            if e.rejections is not None:
                e.rejections(queries, reason)


class Runtime(Protocol):
    """What a front drives: one machine's runtime or a cluster's, alike."""

    @property
    def plan(self) -> Plan:
        """The plan it runs (models, replicas, dispatcher settings)."""
        ...

    @property
    def build_info(self) -> dict[str, Any]:
        """What building it took and found (build seconds, workers, nodes)."""
        ...

    def input_shape(self, model: str) -> tuple[int, ...]:
        """One item's input shape of `model` (no batch axis)."""
        ...

    def workers(self) -> Sequence[WorkerState]:
        """Every worker's state, to read (alive, restarting, error, buckets)."""
        ...

    def submit(self, queries: Sequence[Query]) -> None:
        """Queue the queries' samples; those with `inputs` get their outputs back."""
        ...

    def subscribe(self, *, outputs: OutputsFn | None = None,
                  completions: CompletionFn | None = None, batches: BatchFn | None = None,
                  failures: FailureFn | None = None,
                  rejections: RejectionFn | None = None) -> Subscription:
        """Receive outputs per batch, completions per query, batch statistics, failures."""
        ...

    def ready(self, model: str) -> bool:
        """At least one live worker serves `model`."""
        ...

    def stats(self) -> RuntimeStats:
        """Retried, failed and queued items."""
        ...

    def pipeline_stats(self) -> dict[str, list[dict[str, Any]]]:
        """Per pipelined model, each stage's busy share and link depth (empty without any)."""
        ...

    def worker_pids(self) -> dict[str, int]:
        """Process ids of process-hosted workers, by worker name."""
        ...

    def stop(self, *, drain: bool) -> None:
        """Stop the workers: `drain` finishes what is queued first, else it stays unfinished."""
        ...


class TrialRuntime(Runtime, Protocol):
    """A runtime a load generator's trials run on (`runtime.peak`): the front's face and trials.

    A trial begins from empty queues and zeroed counters, its load generator submits through
    `submit` and hears completions through `subscribe`, `end` flushes partial batches once no
    more queries come, and `end_trial` hands back what the summary needs.
    """

    @property
    def trial(self) -> int:
        """The current trial's number (each `begin_trial` counts one)."""
        ...

    def begin_trial(self, settings: dict[str, Any] | None = None) -> int:
        """Empty the queues and counters for a trial of `settings`; the items dropped.

        `settings` is the trial's `load:` section (a runtime that routes by scenario reads it).
        """
        ...

    def capacity_items(self, model: str) -> int:
        """Items the live workers of `model` hold at once (the offline generator's backlog)."""
        ...

    def sample_counts(self) -> dict[str, int]:
        """Samples in each model's sample library (what queries index)."""
        ...

    def end(self) -> None:
        """No more queries this trial: partial batches go at once."""
        ...

    def end_trial(self) -> TrialCounts:
        """The trial is over: its batch records, events, counters and workers."""
        ...

    def trial_details(self, result: ScenarioResult, record: TrialSummary) -> TrialSummary:
        """The summarised `record` with what this runtime alone knows of the trial added."""
        ...


class LocalRuntime:
    """The runtime of this machine (built and started by `start_runtime`), as a `Runtime`.

    Besides the front's protocol it is a `TrialRuntime` (what a load generator's trial needs)
    and offers the supervisor's restart controls.
    """

    def __init__(self, rt: _Runtime, *, record_batches: bool = True) -> None:
        self._rt = rt
        self._d = rt.dispatcher
        self._hub = SubscriptionHub()
        self._restart_policy: Callable[[WorkerState, BaseException], bool] | None = None
        d = self._d
        if record_batches:
            # The batch records (what a trial summarises) are the first subscriber.
            self._hub.subscribe(batches=rt.recorder.on_batch_done)
        d.on_batch_done = self._hub.batches
        d.on_outputs = self._hub.outputs
        d.on_worker_failed = self._hub.failures
        d.on_rejected = self._hub.rejections
        d.set_completion(self._hub.completions)

    # -- the protocol ---------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """The plan it runs."""
        return self._rt.plan

    @property
    def build_info(self) -> dict[str, Any]:
        """What `build()` returned: build seconds, workers, host cores."""
        return self._rt.build_info

    def input_shape(self, model: str) -> tuple[int, ...]:
        """One item's input shape of `model`."""
        return tuple(self._rt.models[model].input_shape)

    def io_spec(self, model: str) -> tuple[Any, list[int | None]]:
        """`model`'s `IOSpec` (every input and output) and the sequence lengths compiled."""
        return self._rt.models[model].spec_io, list(self._rt.qsl[model].seq_lengths)

    def workers(self) -> Sequence[WorkerState]:
        """Every worker's state (replicas, then pipelines)."""
        return self._rt.states

    def submit(self, queries: Sequence[Query]) -> None:
        """Queue the queries' samples."""
        self._d.submit(queries)

    def subscribe(self, *, outputs: OutputsFn | None = None,
                  completions: CompletionFn | None = None, batches: BatchFn | None = None,
                  failures: FailureFn | None = None,
                  rejections: RejectionFn | None = None) -> Subscription:
        """Receive the runtime's events (see `SubscriptionHub`)."""
        return self._hub.subscribe(outputs=outputs, completions=completions, batches=batches,
                                   failures=failures, rejections=rejections)

    def ready(self, model: str) -> bool:
        """At least one live worker serves `model`."""
        return any(s.alive and (s.model == model or model in s.serves) for s in self._rt.states)

    def stats(self) -> RuntimeStats:
        """Retried, failed and queued items (since start or the trial's beginning)."""
        d = self._d
        with d.cond:
            return RuntimeStats(d.retried, d.failed_items, {m: d.queued(m) for m in d.models})

    def pipeline_stats(self) -> dict[str, list[dict[str, Any]]]:
        """Per pipelined model, each stage's figures."""
        return {p.state.model: p.stage_stats() for p in self._rt.pipelines}

    def worker_pids(self) -> dict[str, int]:
        """Process ids of process-hosted workers (a restarted worker has a new one)."""
        return {self._d.workers[wid].name: host.pid for wid, host in self._rt.host_by_id.items()
                if host.pid is not None}

    def stop(self, *, drain: bool) -> None:
        """Stop the workers (after finishing what is queued, with `drain`)."""
        self._rt.shutdown(now=not drain)

    # -- settings -------------------------------------------------------------------------

    def set_take_when_idle(self, on: bool) -> None:
        """An idle worker takes a partial batch at once (on) or waits out the queue delay."""
        with self._d.cond:
            self._d.take_when_idle = on

    def set_batching(self, rule: str) -> None:
        """How partial batches wait: `deadline` or `queue_delay` (`DispatcherSettings.batching`)."""
        with self._d.cond:
            self._d.batching = rule

    # -- a load generator's trial (`TrialRuntime`) ------------------------------------------

    @property
    def trial(self) -> int:
        """The current trial's number."""
        return self._d.trial

    def begin_trial(self, settings: dict[str, Any] | None = None) -> int:
        """Empty the queues, counters and batch records for a new trial; the items dropped."""
        dropped = self._d.begin_trial()
        self._rt.recorder.reset()
        freeze_since()  # earlier trials' records out of the collector's walk (runtime.gcpause)
        self._rt.gc_pauses.reset()
        for pipe in self._rt.pipelines:
            pipe.begin_window()
        return dropped

    def capacity_items(self, model: str) -> int:
        """Items the live workers of `model` can hold at once.

        A model batched by length (`Dispatcher.group_of`) counts one such holding per length
        bucket: batches take one bucket's items, so the offline backlog holds enough for each
        bucket's batches to fill.
        """
        groups = len(self._rt.qsl[model].seq_lengths) if model in self._d.group_of else 1
        return groups * sum(w.batch * w.depth for w in self._d.workers.values()
                            if w.alive and (w.model == model or model in w.serves))

    def sample_counts(self) -> dict[str, int]:
        """Samples in each model's sample library."""
        return {m: q.count for m, q in self._rt.qsl.items()}

    def end(self) -> None:
        """No more queries this trial: partial batches go at once."""
        self._d.end()

    def end_trial(self) -> TrialCounts:
        """The trial's counts (its workers keep running for the next one)."""
        return self.trial_counts()

    def gc_summary(self) -> dict[str, Any]:
        """The collector's pauses in this process since start or the trial's beginning."""
        return self._rt.gc_pauses.summary()

    def trial_details(self, result: ScenarioResult, record: TrialSummary) -> TrialSummary:
        """The collector's pauses and each pipeline's stages (its busiest stage: its utilisation)."""
        record = replace(record, gc=self.gc_summary())
        pipelines = self._rt.pipelines
        if not pipelines:
            return record
        stages = {p.state.model: p.stage_stats() for p in pipelines}
        workers = dict(record.workers)
        for pipe in pipelines:
            row = workers.get(pipe.state.name)
            if row is not None:
                # Batches overlap in a pipeline: its busiest stage is its utilisation.
                workers[pipe.state.name] = replace(row, utilisation=max(
                    (st["busy"] for st in stages[pipe.state.model]), default=None))
        return replace(record, pipelines=stages, workers=workers)

    def trial_counts(self) -> TrialCounts:
        """The trial's batch records, dispatcher events and retried/failed items."""
        d = self._d
        with d.cond:
            return TrialCounts(list(self._rt.recorder.records), [dict(e) for e in d.events],
                               d.retried, d.failed_items, list(self._rt.states))

    # -- the supervisor's controls ----------------------------------------------------------

    def set_restart_policy(self, policy: Callable[[WorkerState, BaseException], bool] | None
                           ) -> None:
        """Asked, under the dispatcher's lock, whether a failed worker will be restarted."""
        self._d.will_restart = policy

    def worker(self, worker_id: int) -> WorkerState:
        """The state of worker `worker_id`."""
        return self._d.workers[worker_id]

    def restartable(self, worker_id: int) -> bool:
        """Whether the worker can be restarted at all (replicas and pipelines can)."""
        return self._rt.can_restart(worker_id)

    def restart_worker(self, worker_id: int, timeout_s: float = 300.0) -> None:
        """Bring a failed worker back into service; raises RunError when it cannot."""
        self._rt.restart_worker(worker_id, timeout_s)

    def dead_processes(self) -> list[tuple[WorkerState, str]]:
        """Live workers whose child process has exited, with how it died."""
        out = []
        for wid, host in list(self._rt.host_by_id.items()):
            w = self._d.workers.get(wid)
            if w is not None and w.alive and host.exited() is not None:
                out.append((w, host.death()))
        return out

    def fail_idle(self, w: WorkerState, exc: BaseException) -> bool:
        """Take a worker that holds no batch out of service (its process died)."""
        return self._d.fail_idle(w, exc)

    def give_up(self, w: WorkerState, reason: str) -> None:
        """Leave a failed worker out of service; what waited for it fails or goes elsewhere."""
        self._d.give_up(w, reason)

    def mark_restarting(self, w: WorkerState) -> None:
        """A failed worker's restart has begun: its model's items wait for it."""
        with self._d.cond:
            w.restarting = w.restarting or not w.alive

    def set_error(self, w: WorkerState, error: str) -> None:
        """Record why a worker is out of service."""
        with self._d.cond:
            w.error = error


if TYPE_CHECKING:
    # mypy checks that this machine's runtime is a `Runtime` every front can drive.
    _IS_RUNTIME: type[TrialRuntime] = LocalRuntime
