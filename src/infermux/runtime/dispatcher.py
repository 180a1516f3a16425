"""The dispatcher: one queue per model, pulled by free workers, batched with a deadline.

- **Pull (work stealing).** A worker that is free takes the oldest queued items of its model;
  a faster unit comes back sooner and so takes more. `round_robin` instead assigns every item
  to the next worker on arrival (each worker has its own queue): the blind baseline.
- **Dynamic batching, sized to the deadline.** A worker takes up to its batch size. With a
  latency bound for the model (`deadline_ns`: the model's `latency_bound_ms`, else the load's
  `p99_bound_ms`) fewer items wait as long as the oldest can still finish in time
  (`deadline_take`): its deadline is its arrival plus `deadline_share` of the bound, the batch
  starts when the worker frees up (the batch it is computing counts) and takes the worker's
  measured launch overhead and the bucket's measured latency. A full largest bucket goes at
  once; once waiting is no longer safe the largest bucket that still meets the deadline goes
  (the rest waits for the next batch); a partial batch goes at once when no worker of the
  model holds a batch (light load: no running batch's end to overlap, so a wait only adds
  latency), or when the worker asking is free and no further item is expected before the
  batch's latest safe start (the model's mean gap between arrivals is longer than that wait:
  it would only add latency). Without a bound (or with `batching="queue_delay"`) it waits until the oldest has
  waited `max_queue_delay_ms`, then takes what is there; there `take_when_idle` (a server's
  latency setting) takes a partial batch at once when every worker of the model is idle.
  After the load generator's last query (`end()`) partial batches go at once.
- **SLO-aware placement.** With a model's `latency_bound_ms`, a worker whose expected
  completion (moving average of its batch latency) would break the oldest item's bound leaves
  the items when another worker can meet it once free (`placement.slo_take`).
- **Dynamic placement.** A worker whose own model's queue is empty serves another model it
  holds a runner for, when that model's queue has a full batch waiting or its oldest item has
  waited out the queue delay (its own workers are behind). `move()` reassigns a worker for good.
- **Taking ahead.** A worker that queues its next batch while one runs (`take_ahead`: a CPU
  worker's process holds it in its pipe) leaves the items to an idle worker of the model that
  would finish them sooner, since that one can start now and it only when its batch ends.
- **Tail.** Once no more items will come, a worker takes a batch only if it would finish no
  later than the other workers would clear the rest without it (`placement.tail_take`): a slow
  unit does not stretch the end of an offline run.
- **Faults.** A worker whose batch fails is taken out of service; the batch's items go back to
  the front of the queue for another worker, at most `max_retries` times, then their queries are
  reported failed. Nothing is dropped silently. A batch of served items that raised on a worker
  that then ran a batch of its own samples is the input's fault (`rejected`): the worker stays
  in service, a batch of one request's items fails that request alone (`on_rejected`), and the
  items of a batch mixing requests run again one request per batch, so the next failure names
  the request at fault. A supervisor (`runtime.supervisor`) may restart
  it: while a worker whose process died is `restarting`, its model's items wait for it (they
  count as servable), `revive()` puts it back in service, `give_up()` fails what waited.
- **Trials.** `begin_trial()` starts a trial from empty queues and zeroed counters: what an
  earlier trial left queued is dropped (it was reported unfinished there), and a batch of it
  still running when the new trial starts is neither reported to nor recorded in the new one.

`poll()` is the non-blocking core, driven by an injectable clock, so batching and placement are
testable deterministically; `next_batch()` is its blocking form for worker threads.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infermux.errors import first_line
from infermux.load.base import CompletionFn, Query
from infermux.runtime.placement import LatencyEstimate, WorkerView, slo_take, tail_take

__all__ = ["Batch", "Dispatcher", "Item", "WorkerState", "batch_ready", "deadline_take"]

#: `poll` returns this (seconds to wait) when only a new item or event can change anything.
WAIT_FOREVER = float("inf")


@dataclass
class Item:
    """One sample of a query waiting in a model's queue."""

    query: int
    model: str
    sample: int
    enqueued_ns: int
    attempts: int = 0
    #: The trial the item belongs to (`Dispatcher.begin_trial`).
    trial: int = 0
    #: The sample's own input row (a served request's), instead of the QSL's row `sample`.
    data: Any = None
    #: Run in a batch of its own query's items only: its batch raised, and which request's
    #: input was at fault is being narrowed down (`Dispatcher.rejected`).
    alone: bool = False
    #: Its sequence-length bucket, where the model has several (`Dispatcher.group_of`).
    group: int = 0


@dataclass
class Batch:
    """Items a worker took, with when each became ready (a free worker and the item present)."""

    model: str
    items: list[Item]
    bucket: int
    taken_ns: int
    ready_ns: list[int]
    #: When the worker gathered, launched, collected and reported it (clock ns; the served
    #: requests' stage trace reads them: serve/trace.py).
    stamps: dict[str, int] = field(default_factory=dict)
    #: Its time on the device (the runner's copies and compute, from its own device timing;
    #: 0 where the runner has none), set when it finished.
    device_ns: int = 0
    #: A pipelined (GPU) worker's: where its gather ran (`here` on the worker's thread while
    #: the batch before ran, on the `helper` thread, `after` that batch was collected, or
    #: `idle`: nothing ran), and how long the worker's device had no batch of its own while
    #: this batch's first item waited (from the batch before's collection to this launch).
    gather_path: str = ""
    idle_before_ns: int = 0

    @property
    def samples(self) -> list[int]:
        """The QSL indices of the batch's items, in order."""
        return [it.sample for it in self.items]

    def inputs(self) -> np.ndarray | None:
        """The items' own input rows stacked `(n, *shape)`, float32 (served requests), else None."""
        if not self.items or self.items[0].data is None:
            return None
        return np.stack([it.data for it in self.items]).astype(np.float32, copy=False)

    def rows(self) -> list[np.ndarray] | None:
        """The items' own input rows, unstacked (a runner may copy them straight in), else None."""
        if not self.items or self.items[0].data is None:
            return None
        return [it.data for it in self.items]


def failure_kind(exc: BaseException) -> str:
    """A stopped worker's status from its error's type: `oom` or `failed`."""
    from infermux.engines.base import is_out_of_memory

    return "oom" if is_out_of_memory(exc) else "failed"


@dataclass
class WorkerState:
    """The dispatcher's view of one worker."""

    id: int
    name: str
    unit: str
    model: str
    buckets: list[int]
    serves: set[str]
    estimate: LatencyEstimate
    #: Batches it may hold at once: 2 for workers that prepare the next batch while one runs.
    depth: int = 1
    alive: bool = True
    error: str | None = None
    #: Why a worker that is not alive stopped: `oom` (an out-of-memory error, by its type) or
    #: `failed` (any other error).
    failure: str | None = None
    #: Being restarted by a supervisor: its model's items wait for it meanwhile.
    restarting: bool = False
    #: Times a supervisor brought it back into service.
    restarts: int = 0
    free_since_ns: int = 0
    busy_until_ns: int = 0
    in_flight: int = 0
    own_queue: deque[Item] = field(default_factory=deque)
    last_served: str | None = None
    #: Moving average of the time from when a batch could start (taken, and the worker's
    #: previous batch ended) to its launch: the gather and the hand-over, ns. Deadline
    #: batching adds it to a batch's expected latency, which counts from the launch only.
    launch_ns: float = 0.0
    #: When the worker's last finished batch ended (what `launch_ns` is measured from).
    last_end_ns: int = 0

    @property
    def batch(self) -> int:
        """The largest batch it takes."""
        return self.buckets[-1]

    def view(self, model: str | None = None) -> WorkerView:
        """The placement functions' view of this worker, for batches of `model` (default: its own)."""
        return WorkerView(self.id, self.buckets, self.estimate, self.busy_until_ns, self.alive,
                          model or self.model, self.unit)

    def bucket_for(self, n: int, model: str | None = None) -> int:
        """The runner batch size a batch of `n` items of `model` (default: its own) runs at.

        The smallest holding them, or on a GPU a larger one measured faster (`bucket_holding`).
        """
        return self.view(model).bucket_for(n)


def batch_ready(queued: int, batch: int, oldest_ns: int, now_ns: int, max_delay_ns: int,
                flush: bool) -> tuple[bool, int]:
    """(take now, else ns to wait): full batch, the oldest item's delay spent, or flushing."""
    if queued >= batch or flush:
        return True, 0
    due = oldest_ns + max_delay_ns
    if now_ns >= due:
        return True, 0
    return False, due - now_ns


def deadline_take(queued: int, buckets: Sequence[int], expected_ns: Callable[[int], float],
                  now_ns: int, free_ns: int, deadline_ns: int, *, idle: bool,
                  flush: bool, arrival_gap_ns: float | None = None) -> tuple[int, int]:
    """(items to take now, else 0 and ns to wait) under deadline batching.

    `expected_ns(bucket)` is a batch's time from its start to its completion (the worker's
    launch overhead and the bucket's measured latency); the batch starts at
    `max(now_ns, free_ns)`, when the worker is done with the batch it computes. A full largest
    bucket, a flush, or a model whose workers are all `idle` take what is queued at once.
    Otherwise waiting is safe while the batch as it stands would still meet `deadline_ns` (the
    oldest item's) if it started later: wait until the latest such start, unless the worker is
    free now and the model's mean gap between arrivals (`arrival_gap_ns`, None: not known yet)
    is longer than that wait: then no item is expected to join the batch, and the wait would
    only spend the margin a slow batch needs, so it goes at once. Once waiting is not safe,
    take the largest batch (all queued, else a full smaller bucket) that meets the deadline; if
    none does, take all queued (late is better than never, and a backlog needs the throughput).
    """
    top = buckets[-1]
    if queued >= top:
        return top, 0
    if flush or idle:
        return queued, 0
    bucket = next(b for b in buckets if b >= queued)
    latest_start = deadline_ns - int(expected_ns(bucket))
    if now_ns < latest_start and free_ns < latest_start:
        if (free_ns <= now_ns and arrival_gap_ns is not None
                and arrival_gap_ns > latest_start - now_ns):
            return queued, 0
        return 0, latest_start - now_ns
    start = max(now_ns, free_ns)
    for size in [queued] + [b for b in reversed(buckets) if b < queued]:
        if start + expected_ns(next(b for b in buckets if b >= size)) <= deadline_ns:
            return size, 0
    return queued, 0


class Dispatcher:
    """Per-model queues, pulled by workers; see the module docstring for the rules."""

    def __init__(
        self,
        models: Iterable[str],
        *,
        max_queue_delay_ns: int,
        latency_bound_ns: dict[str, int | None] | None = None,
        deadline_ns: dict[str, int | None] | None = None,
        batching: str = "deadline",
        policy: str = "pull",
        max_retries: int = 2,
        dynamic: bool = False,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self.models = list(models)
        #: Dynamic placement: an idle worker serves another model whose queue has grown.
        self.dynamic = dynamic
        self.max_events = 10_000
        self.max_queue_delay_ns = max_queue_delay_ns
        self.latency_bound_ns = dict(latency_bound_ns or {})
        #: Per model, the latency bound partial batches are sized to (`deadline_take`); a
        #: model without one (or `batching="queue_delay"`) waits out `max_queue_delay_ns`.
        self.deadline_ns = {m: v for m, v in (deadline_ns or {}).items() if v}
        if batching not in ("deadline", "queue_delay"):
            raise ValueError(f"batching {batching!r}: use 'deadline' or 'queue_delay'")
        self.batching = batching
        #: The share of the bound a batch is planned to finish within; the rest is left to
        #: what the dispatcher does not see: the load generator's issue lag, the completion's
        #: hand-over and a batch slower than its moving average (the bound is on the p99).
        self.deadline_share = 0.8
        self.policy = policy
        self.max_retries = max_retries
        self.clock_ns = clock_ns
        #: Take a partial batch at once when every worker of its model is idle (see above).
        self.take_when_idle = False
        #: Per model, the moving average of the gap between two items' arrivals, and when the
        #: last one came: deadline batching waits only where an item is expected to join.
        self.arrival_gap_ns: dict[str, float] = {}
        self._last_arrival_ns: dict[str, int] = {}
        self.workers: dict[int, WorkerState] = {}
        self.queues: dict[str, deque[Item]] = {m: deque() for m in self.models}
        #: Per model of several sequence-length buckets: an item's bucket (its group), from
        #: its QSL sample or its own inputs. A batch takes items of its oldest item's group
        #: (see `_take`), so a short query is not padded to a long one's length.
        self.group_of: dict[str, Callable[[int, Any], int]] = {}
        self.cond = threading.Condition()
        self._rr: Counter[str] = Counter()
        self._on_complete: CompletionFn | None = None
        self._flush = False
        self._closed = False
        self._stopped = False
        self.retried = 0
        self.failed_items = 0
        #: The current trial: items of an earlier one are stale (see `begin_trial`).
        self.trial = 0
        self.on_batch_done: Callable[[WorkerState, Batch, int, int, Any], None] | None = None
        #: Where the outputs of batches with their own inputs go (a server): (batch, outputs),
        #: one float32 array per model output, a row per item, before completion is reported.
        self.on_outputs: Callable[[Batch, list[np.ndarray]], None] | None = None
        self.events: list[dict[str, Any]] = []
        #: Called, outside the lock, with each worker just taken out of service (a supervisor).
        self.on_worker_failed: Callable[[WorkerState], None] | None = None
        #: Asked, under the lock, whether a failed worker will be restarted (a supervisor's
        #: answer): if so, the items it held and its model's queue wait for it.
        self.will_restart: Callable[[WorkerState, BaseException], bool] | None = None
        #: Called, outside the lock, with the queries whose own input the engine rejected and
        #: the engine's message, before they are reported failed (a server answers them 400).
        self.on_rejected: Callable[[list[int], str], None] | None = None

    # -- set-up -----------------------------------------------------------------------------

    def add_worker(self, worker: WorkerState) -> None:
        """Register a worker before the run starts."""
        worker.free_since_ns = self.clock_ns()
        self.workers[worker.id] = worker

    def set_completion(self, on_complete: CompletionFn) -> None:
        """Where finished (or failed) samples are reported: the load generator."""
        self._on_complete = on_complete

    def begin_trial(self, settle_s: float = 30.0) -> int:
        """Start a new trial from empty queues and zeroed counters; the items dropped.

        Queued items of the previous trial are dropped (its load generator reported them
        unfinished). Batches of it still running finish unreported and unrecorded; this waits
        up to `settle_s` for them so the new trial starts on free workers.
        """
        with self.cond:
            self.trial += 1
            dropped = sum(len(q) for q in self.queues.values())
            for queue in self.queues.values():
                queue.clear()
            for w in self.workers.values():
                dropped += len(w.own_queue)
                w.own_queue.clear()
            self.retried = 0
            self.failed_items = 0
            self._flush = False
            # A trial's load is its own: the gaps of an earlier one say nothing of it.
            self.arrival_gap_ns.clear()
            self._last_arrival_ns.clear()
            deadline = time.monotonic() + settle_s
            while any(w.alive and w.in_flight for w in self.workers.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(min(left, 0.05))
            self.cond.notify_all()
        return dropped

    # -- the load's side --------------------------------------------------------------------

    def submit(self, queries: Sequence[Query]) -> None:
        """Queue every sample of `queries`; a model with no live worker fails them at once."""
        now = self.clock_ns()
        dead: list[Item] = []
        with self.cond:
            servable: dict[str, bool] = {}
            for q in queries:
                ok = servable.get(q.model)
                if ok is None:
                    ok = servable[q.model] = self._can_serve(q.model)
                group_of = self.group_of.get(q.model)
                for j, s in enumerate(q.samples):
                    item = Item(q.id, q.model, s, now, trial=self.trial,
                                data=None if q.inputs is None else q.inputs[j])
                    if group_of is not None:
                        item.group = group_of(s, item.data)
                    if not ok:
                        dead.append(item)
                        continue
                    self._arrived(q.model, now)
                    if self.policy == "round_robin":
                        self._place(item)
                    else:
                        self.queues[q.model].append(item)
            self.cond.notify_all()
        self._fail_items(dead, now)

    def _arrived(self, model: str, now_ns: int) -> None:
        """Fold one item's arrival into its model's mean gap between arrivals (lock held).

        Items submitted together count as gaps of 0: a burst is a high rate.
        """
        last = self._last_arrival_ns.get(model)
        self._last_arrival_ns[model] = now_ns
        if last is not None:
            gap = float(now_ns - last)
            old = self.arrival_gap_ns.get(model)
            self.arrival_gap_ns[model] = gap if old is None else old + _GAP_ALPHA * (gap - old)

    def _live(self, model: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.alive and w.model == model]

    def _can_serve(self, model: str) -> bool:
        # Round robin feeds only a model's own workers: borrowing reads the shared queues.
        borrow = self.dynamic and self.policy == "pull"
        # A worker being restarted keeps its model's items queued for it (pull only: round
        # robin's own queues are emptied when a worker fails).
        waiting = self.policy == "pull"
        return any((w.alive or (waiting and w.restarting))
                   and (w.model == model or (borrow and model in w.serves))
                   for w in self.workers.values())

    def _place(self, item: Item, front: bool = False) -> bool:
        live = self._live(item.model)
        if not self._can_serve(item.model):
            return False
        if self.policy == "round_robin" and live:
            idx = self._rr[item.model] % len(live)
            self._rr[item.model] += 1
            queue = live[idx].own_queue
        else:
            queue = self.queues[item.model]
        if front:
            queue.appendleft(item)
        else:
            queue.append(item)
        return True

    def end(self) -> None:
        """No more items will come: partial batches go without waiting."""
        with self.cond:
            self._flush = True
            self.cond.notify_all()

    def close(self) -> None:
        """Workers exit once the queues they serve are empty."""
        with self.cond:
            self._flush = True
            self._closed = True
            self.cond.notify_all()

    def stop(self) -> None:
        """Workers exit after the batch in hand (Ctrl-C); queued items stay unfinished."""
        with self.cond:
            self._flush = self._closed = self._stopped = True
            self.cond.notify_all()

    def queued(self, model: str) -> int:
        """Items of `model` waiting (in the shared queue or workers' own queues)."""
        own = sum(len(w.own_queue) for w in self.workers.values() if w.model == model)
        return len(self.queues[model]) + own

    # -- the workers' side ------------------------------------------------------------------

    def _queue_of(self, w: WorkerState) -> deque[Item]:
        return w.own_queue if self.policy == "round_robin" else self.queues[w.model]

    def _borrow(self, w: WorkerState, now: int) -> tuple[str | None, float]:
        """Dynamic placement: another model for idle worker `w` to serve, or (None, wait).

        A model qualifies when `w` holds a runner for it and its queue has outgrown its own
        workers: a full batch waits, or the oldest item has waited out the queue delay.
        """
        best: tuple[int, str] | None = None
        wait_ns = WAIT_FOREVER
        for model in w.serves:
            queue = self.queues.get(model)
            if model == w.model or not queue:
                continue
            oldest = queue[0].enqueued_ns
            if len(queue) >= w.batch or now - oldest >= self.max_queue_delay_ns or self._flush:
                if best is None or oldest < best[0]:
                    best = (oldest, model)
            else:
                wait_ns = min(wait_ns, oldest + self.max_queue_delay_ns - now)
        if best is None:
            return None, wait_ns / 1e9 if wait_ns != WAIT_FOREVER else WAIT_FOREVER
        return best[1], 0.0

    def poll(self, w: WorkerState, launch_ns: int | None = None) -> Batch | float | None:
        """A batch for worker `w`, else seconds to wait before asking again, else None (exit).

        `launch_ns`: the earliest the batch could launch, where that is later than now (a busy
        worker asking for the batch to gather under its running one). The queue delay is
        counted to the launch, as a batcher that forms batches only for a free instance counts
        it: items whose delay will be over by then go in this batch. Counted to the take, a
        busy worker's next batch in a closed loop was rarely ready before the running one
        ended (the items that came back from the batch before arrived a few milliseconds
        into it), so every gather ran with the device idle.

        Call with `self.cond` held (or from one thread, as tests do).
        """
        if self._stopped or not w.alive:
            return None
        model, queue = w.model, self._queue_of(w)
        now = self.clock_ns()
        if not queue and self.dynamic and self.policy == "pull":
            borrowed, wait_s = self._borrow(w, now)
            if borrowed is None:
                return None if self._closed else wait_s
            model, queue = borrowed, self.queues[borrowed]
        if not queue:
            return None if self._closed else WAIT_FOREVER
        oldest = queue[0].enqueued_ns
        bound = self.deadline_ns.get(model) if self.batching == "deadline" else None
        if bound is not None and self.policy == "pull":
            n, wait_ns = self._deadline_take(w, model, len(queue), oldest, now, bound)
            if n == 0:
                return wait_ns / 1e9
        else:
            at = now if launch_ns is None else max(now, launch_ns)
            take_now, wait_ns = batch_ready(len(queue), w.batch, oldest, at,
                                            self.max_queue_delay_ns, self._flush)
            if not take_now and self.take_when_idle and not w.in_flight:
                take_now = not any(o.in_flight for o in self._live(model))
            if not take_now:
                return wait_ns / 1e9
            n = min(len(queue), w.batch)
        if self._flush and self.policy == "pull":
            others = [o.view(model) for o in self._live(model) if o.id != w.id]
            if others and not tail_take(w.view(model), others, n, len(queue), now):
                soonest = min((o.busy_until_ns for o in others), default=now)
                return max(1e-4, (soonest - now) / 1e9)
        bound = self.latency_bound_ns.get(model)
        if bound is not None and self.policy == "pull":
            others = [o.view(model) for o in self._live(model) if o.id != w.id]
            n = slo_take(w.view(model), others, n, oldest + bound, now)
            if n == 0:
                # Another worker will meet the bound once free: look again when it should be.
                soonest = min((o.busy_until_ns for o in others), default=now)
                return max(1e-4, (soonest - now) / 1e9)
        if queue[0].alone:  # narrowing down an input fault: one query's items per batch
            n = next((k for k in range(1, n) if queue[k].query != queue[0].query), n)
        items = _take(queue, n, grouped=model in self.group_of)
        n = len(items)
        bucket = w.bucket_for(n, model)
        ready = [max(it.enqueued_ns, w.free_since_ns) for it in items]
        start = max(now, w.busy_until_ns) if w.in_flight else now
        w.busy_until_ns = int(start + w.estimate.expected_ns(bucket, model))
        w.in_flight += 1
        if model != w.last_served:
            if w.last_served is not None and len(self.events) < self.max_events:
                self.events.append({"t_ns": now, "event": "serve", "worker": w.name,
                                    "unit": w.unit, "from": w.last_served, "to": model})
            w.last_served = model
        return Batch(model, items, bucket, now, ready)

    def _deadline_take(self, w: WorkerState, model: str, queued: int, oldest_ns: int,
                       now_ns: int, bound_ns: int) -> tuple[int, int]:
        """`deadline_take` for worker `w`: its buckets, estimates and running batch."""
        launch_ns = w.launch_ns

        def expected(bucket: int) -> float:
            return launch_ns + w.estimate.expected_ns(bucket, model)

        idle = not w.in_flight and not any(o.in_flight for o in self._live(model))
        free = w.busy_until_ns if w.in_flight else now_ns
        deadline = oldest_ns + int(bound_ns * self.deadline_share)
        return deadline_take(queued, w.buckets, expected, now_ns, free, deadline, idle=idle,
                             flush=self._flush, arrival_gap_ns=self.arrival_gap_ns.get(model))

    def next_batch(self, w: WorkerState, *, block: bool = True) -> Batch | None:
        """Block until `poll` gives a batch, or None when the worker should exit.

        With `block=False`, return None at once when no batch is ready yet.
        """
        with self.cond:
            while True:
                got = self.poll(w)
                if got is None or isinstance(got, Batch):
                    return got
                if not block:
                    return None
                self.cond.wait(None if got == WAIT_FOREVER else got)

    def take_ahead(self, w: WorkerState) -> Batch | None:
        """A batch for `w` to queue behind the one it runs, else None (at once, never waits).

        `next_batch(w, block=False)`, except that while `w` holds a batch the items are left
        to an idle live worker of its model that would finish them sooner (`finish_ns`: it
        starts now, `w` when its own batch ends), so queueing ahead never takes work from a
        worker waiting for it.
        """
        with self.cond:
            if self.leave_to_idle(w):
                return None
            return self.next_batch(w, block=False)

    def leave_to_idle(self, w: WorkerState) -> bool:
        """Whether an idle worker of `w`'s model would finish what is queued sooner than `w`.

        Only while `w` holds a batch (else False): `w` could start the items after its own.
        Call with `self.cond` held.
        """
        if not w.in_flight:
            return False
        now = self.clock_ns()
        n = max(1, min(self.queued(w.model), w.batch))
        mine = w.view().finish_ns(n, now)
        return any(o.view().finish_ns(n, now) < mine for o in self._live(w.model)
                   if o.id != w.id and not o.in_flight)

    @property
    def closed(self) -> bool:
        """True once workers should exit when their queue is empty."""
        return self._closed

    def finished(self, w: WorkerState, batch: Batch, start_ns: int, end_ns: int,
                 timing: Any = None, outputs: list[np.ndarray] | None = None) -> None:
        """A batch completed: update the estimate, report the samples, free the worker.

        `outputs` (batches with their own inputs) go to `on_outputs` before the completion.
        A batch of an earlier trial (see `begin_trial`) only frees the worker.
        """
        with self.cond:
            w.estimate.update(batch.bucket, end_ns - start_ns, batch.model)
            # From when the batch could start (taken, the previous batch over) to its launch.
            could_start = max(batch.taken_ns, w.last_end_ns)
            if start_ns >= could_start:
                w.launch_ns = _average(w.launch_ns, start_ns - could_start)
            w.last_end_ns = end_ns
            stale = self._stale(batch.items)
            w.in_flight -= 1
            if w.in_flight == 0:
                w.free_since_ns = end_ns
                w.busy_until_ns = end_ns
            self.cond.notify_all()
        if stale:
            return
        if timing is not None:
            batch.device_ns = int(getattr(timing, "device_ns", 0) or 0)
        if self.on_batch_done is not None:
            self.on_batch_done(w, batch, start_ns, end_ns, timing)
        if outputs is not None and self.on_outputs is not None:
            self.on_outputs(batch, outputs)
        self._report(batch.items, ok=True, when_ns=end_ns)

    def _stale(self, items: Sequence[Item]) -> bool:
        return bool(items) and items[0].trial != self.trial

    def failed(self, w: WorkerState, batches: Sequence[Batch], exc: BaseException) -> None:
        """A worker failed: take it out of service and retry or fail every item it held."""
        now = self.clock_ns()
        with self.cond:
            give_up = self._take_out(w, batches, exc, now)
        self._fail_items(give_up, now)
        if self.on_worker_failed is not None:
            self.on_worker_failed(w)

    def rejected(self, w: WorkerState, batches: Sequence[Batch], exc: BaseException) -> None:
        """`batches` raised on `w`, which then ran a batch of its own samples: an input's fault.

        `w` stays in service. A single batch holding one query's items fails that query alone
        (`on_rejected`, then the completion); otherwise each item goes back to the front of its
        queue to run in a batch of its own query's items (`Item.alone`), at most `max_retries`
        more times, so the next failure names the query at fault.
        """
        now = self.clock_ns()
        blamed: list[Item] = []
        with self.cond:
            # The last error it saw, though it serves on: what a front without `on_rejected`
            # (a cluster node's driver) can still tell the client.
            w.error = first_line(exc)
            w.in_flight = max(0, w.in_flight - len(batches))
            if w.in_flight == 0:
                w.free_since_ns = w.busy_until_ns = now
            current = [b for b in batches if not self._stale(b.items)]
            if len(current) == 1 and len({it.query for it in current[0].items}) == 1:
                blamed = list(current[0].items)
            else:
                for item in reversed([it for b in current for it in b.items]):
                    item.attempts += 1
                    item.alone = True
                    if item.attempts > self.max_retries or not self._place(item, front=True):
                        blamed.append(item)
                    else:
                        self.retried += 1
            self.failed_items += len(blamed)
            self.cond.notify_all()
        if not blamed:
            return
        if self.on_rejected is not None:
            self.on_rejected(sorted({it.query for it in blamed}), first_line(exc))
        self._report(blamed, ok=False, when_ns=now)

    def fail_idle(self, w: WorkerState, exc: BaseException) -> bool:
        """Take `w` out of service if it is alive and holds no batch; else False.

        For a worker whose process died between batches; one that holds a batch reports the
        failure from its own thread.
        """
        now = self.clock_ns()
        with self.cond:
            if not w.alive or w.in_flight:
                return False
            give_up = self._take_out(w, [], exc, now)
        self._fail_items(give_up, now)
        if self.on_worker_failed is not None:
            self.on_worker_failed(w)
        return True

    def revive(self, w: WorkerState) -> None:
        """A restarted worker is back in service (it takes batches again)."""
        with self.cond:
            now = self.clock_ns()
            w.alive, w.restarting, w.error, w.failure = True, False, None, None
            w.restarts += 1
            w.in_flight = 0
            w.free_since_ns = w.busy_until_ns = now
            self.events.append({"t_ns": now, "event": "worker_restarted", "worker": w.name,
                                "restarts": w.restarts})
            self.cond.notify_all()

    def give_up(self, w: WorkerState, reason: str) -> None:
        """A worker will not be restarted: fail what waited for it if nothing else serves it."""
        now = self.clock_ns()
        give_up: list[Item] = []
        with self.cond:
            w.restarting = False
            w.error = reason
            for queue in self.queues.values():
                while queue and not self._can_serve(queue[0].model):
                    give_up.append(queue.popleft())
            self.cond.notify_all()
        self._fail_items(give_up, now)

    def _take_out(self, w: WorkerState, batches: Sequence[Batch], exc: BaseException,
                  now: int) -> list[Item]:
        """Mark `w` failed, requeue or give up what it held (called with the lock held)."""
        give_up: list[Item] = []
        w.alive = False
        w.error = first_line(exc)
        w.failure = failure_kind(exc)
        w.in_flight = 0
        self.events.append({"t_ns": now, "event": "worker_failed", "worker": w.name,
                            "error": w.error})
        w.restarting = bool(self.will_restart is not None and self.will_restart(w, exc))
        held = [it for b in batches for it in b.items if it.trial == self.trial]
        held += list(w.own_queue)
        w.own_queue.clear()
        for item in reversed(held):
            item.attempts += 1
            if item.attempts > self.max_retries or not self._place(item, front=True):
                give_up.append(item)
            else:
                self.retried += 1
        # A model left without workers fails whatever is still queued for it.
        for model, queue in self.queues.items():
            if queue and not self._can_serve(model):
                give_up.extend(queue)
                queue.clear()
        self.cond.notify_all()
        return give_up

    def _fail_items(self, items: list[Item], now: int) -> None:
        if items:
            with self.cond:
                self.failed_items += len(items)
            self._report(items, ok=False, when_ns=now)

    def _report(self, items: Sequence[Item], *, ok: bool, when_ns: int) -> None:
        if self._on_complete is None:
            return
        per_query = Counter(it.query for it in items)
        self._on_complete(list(per_query.items()), ok, when_ns)

    # -- placement --------------------------------------------------------------------------

    def move(self, worker_id: int, model: str, reason: str = "") -> None:
        """Serve `model` with this worker from its next batch on (dynamic placement).

        Items of its old model waiting in its own queue (round robin) go back to that model's
        other workers, or fail if it has none left: the worker's next batch is of `model` only.
        """
        now = self.clock_ns()
        give_up: list[Item] = []
        with self.cond:
            w = self.workers[worker_id]
            if model not in w.serves:
                raise ValueError(f"worker {w.name} has no runner for model {model!r}")
            if model == w.model:
                return
            self.events.append({"t_ns": now, "event": "move", "worker": w.name,
                                "unit": w.unit, "from": w.model, "to": model, "reason": reason})
            held = list(w.own_queue)
            w.own_queue.clear()
            w.model = model
            for item in held:
                if not self._place(item):
                    give_up.append(item)
            self.cond.notify_all()
        self._fail_items(give_up, now)


#: Weight of the newest gap in a model's mean gap between arrivals (`Dispatcher._arrived`).
_GAP_ALPHA = 0.1

#: How far past the batch size a grouped take looks for items of the oldest item's group.
_GROUP_WINDOW = 8


def _take(queue: deque[Item], n: int, *, grouped: bool) -> list[Item]:
    """The batch's items: the first `n`, or, `grouped`, the first `n` of the oldest's group.

    Items of other groups keep their place. The look-ahead is bounded (`_GROUP_WINDOW` × n)
    so a long queue costs the take no more than a few batches' worth of items.
    """
    if not grouped or queue[0].alone:
        return [queue.popleft() for _ in range(n)]
    head = queue[0].group
    taken: list[Item] = []
    kept: list[Item] = []
    for _ in range(min(len(queue), _GROUP_WINDOW * n)):
        item = queue.popleft()
        (taken if item.group == head else kept).append(item)
        if len(taken) == n:
            break
    queue.extendleft(reversed(kept))
    return taken


def _average(old: float, new: float, alpha: float = 0.2) -> float:
    return float(new) if old <= 0 else old + alpha * (new - old)
