"""Placement decisions as pure functions: latency estimates, SLO-aware takes, dynamic moves.

Kept free of threads and clocks so they can be tested deterministically; the dispatcher and the
placement controller call them with the current time.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "LatencyEstimate", "ModelLoad", "Move", "WorkerView", "rebalance", "slo_take", "tail_take",
]


class LatencyEstimate:
    """A moving average of one worker's batch latency per (model, batch size), in ns.

    A worker under dynamic placement runs several networks: each model keeps its own averages.
    `alpha` weighs the newest batch; a bucket never measured is estimated from the nearest
    measured bucket of the same model, scaled by the batch size (an upper bound for a larger
    bucket). Figures recorded without a model stand for any model that has none of its own.
    Thread-safe: workers update it while the dispatcher and the placement controller read it.
    """

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._ns: dict[str | None, dict[int, float]] = {}
        self._lock = threading.Lock()

    def update(self, bucket: int, latency_ns: float, model: str | None = None) -> None:
        """Fold one measured batch of `model` into the bucket's average."""
        with self._lock:
            table = self._ns.setdefault(model, {})
            old = table.get(bucket)
            table[bucket] = latency_ns if old is None else old + self.alpha * (latency_ns - old)

    def expected_ns(self, bucket: int, model: str | None = None) -> float:
        """The expected latency of a batch of `model` run at `bucket`; 0 when nothing is known."""
        with self._lock:
            table = self._ns.get(model) or self._ns.get(None)
            if not table:
                return 0.0
            if bucket in table:
                return table[bucket]
            nearest = min(table, key=lambda b: abs(b - bucket))
            return table[nearest] * max(1.0, bucket / nearest)

    def snapshot(self, model: str | None = None) -> dict[int, float]:
        """The current averages of `model` (or the model-less ones), ns per bucket."""
        with self._lock:
            return dict(self._ns.get(model) or self._ns.get(None) or {})

    def models(self) -> list[str]:
        """The models with averages of their own."""
        with self._lock:
            return sorted(m for m in self._ns if m is not None)


#: A GPU worker takes a larger bucket for a batch only where its measured latency is under this
#: share of the smallest holding bucket's (a measurement's noise must not retire a bucket).
FASTER_SHARE = 0.75


def bucket_holding(buckets: Sequence[int], n: int, estimate: LatencyEstimate | None = None,
                   model: str | None = None) -> int:
    """The bucket a batch of `n` items runs at.

    The smallest that holds them (the largest if none does), or, given `estimate` (a GPU
    worker's), a larger one measured well under its latency. A bucket can run slower than a
    larger one: a compiled plan compiles only its largest buckets (`plan.options_for_bucket`),
    and BERT-base's FP8 batch of 64 uncompiled took 10 ms on an H100 where the compiled 128
    took 5.8; 44 items went to the 64 and ran at a quarter of the rate. Only buckets with
    measured latencies (the build's warm-up primes every one) are compared. CPU workers are
    not given an estimate: two warm-up runs of a small CPU batch differ by more than the
    margin, and a bucket passed over is not measured again.
    """
    first = next((b for b in buckets if b >= n), buckets[-1])
    if estimate is None:
        return first
    measured = estimate.snapshot(model)
    if first not in measured:
        return first
    best = first
    for b in buckets:
        if b > first and b in measured and measured[b] < FASTER_SHARE * measured[best]:
            best = b
    return best


@dataclass
class WorkerView:
    """What a placement decision knows of a worker."""

    id: int
    buckets: Sequence[int]
    estimate: LatencyEstimate
    busy_until_ns: int = 0
    alive: bool = True
    #: The model whose batches are in question (its own latency estimates are used).
    model: str | None = None
    #: The worker's unit (`cuda:0/fp16`, `cpu:1`, ...): a GPU's buckets are chosen by latency.
    unit: str = ""

    def bucket_for(self, n: int) -> int:
        """The bucket a batch of `n` items runs at (`bucket_holding`)."""
        on_gpu = self.unit.startswith("cuda")
        return bucket_holding(self.buckets, n, self.estimate if on_gpu else None, self.model)

    def expected_ns(self, bucket: int) -> float:
        """The expected latency of a batch of this view's model at `bucket`."""
        return self.estimate.expected_ns(bucket, self.model)

    def finish_ns(self, n: int, now_ns: int) -> float:
        """When a batch of `n` items taken now (or when it frees up) would complete."""
        return max(now_ns, self.busy_until_ns) + self.expected_ns(self.bucket_for(n))


def slo_take(
    me: WorkerView,
    others: Sequence[WorkerView],
    available: int,
    deadline_ns: int,
    now_ns: int,
) -> int:
    """How many of the `available` oldest items `me` should take under a latency bound.

    The oldest item must complete by `deadline_ns`. `me` takes the largest batch it can finish
    in time, counting from when it frees up (a worker may take its next batch while one runs).
    If it cannot finish even one item in time but another live worker of the model can (once
    it frees up), `me` declines (0) and leaves the items to it. If no worker can meet the
    bound, `me` takes the items anyway: late is better than never.
    """
    n = min(available, me.buckets[-1])
    sizes = [n] + [b for b in reversed(me.buckets) if b < n]
    for size in sizes:
        if me.finish_ns(size, now_ns) <= deadline_ns:
            return size
    for other in others:
        if other.alive and other.id != me.id and other.finish_ns(1, now_ns) <= deadline_ns:
            return 0
    return n


def tail_take(me: WorkerView, others: Sequence[WorkerView], n: int, queued: int,
              now_ns: int) -> bool:
    """Whether `me` should take `n` of the last `queued` items (no more will come).

    At the end of a run a slow unit that takes a batch can finish after every fast unit has
    drained the rest, stretching the run. It takes the batch only if it finishes no later than
    the others would clear the whole queue without it (from their estimated rates).
    """
    live = [o for o in others if o.alive and o.id != me.id]
    rate_per_ns = 0.0
    for other in live:
        est = other.expected_ns(other.buckets[-1])
        if est > 0:
            rate_per_ns += other.buckets[-1] / est
    if rate_per_ns <= 0:
        return True
    # The others cannot be done before the best of them finishes this batch, nor before
    # their combined rate clears the queue. The worker that would finish the batch first
    # always takes it, so the queue never stalls.
    best_single = min(o.finish_ns(n, now_ns) for o in live)
    others_done = max(best_single, now_ns + queued / rate_per_ns)
    return me.finish_ns(n, now_ns) <= others_done


@dataclass
class ModelLoad:
    """One model's state for the placement controller."""

    name: str
    queued: int
    workers: list[int] = field(default_factory=list)
    #: Items per second its current workers can serve (from their estimates).
    capacity_per_s: float = 0.0


@dataclass(frozen=True)
class Move:
    """Worker `worker` stops serving `src` and serves `dst`."""

    worker: int
    src: str
    dst: str


def rebalance(
    loads: Sequence[ModelLoad],
    idle_s: dict[int, float],
    can_serve: dict[int, set[str]],
    *,
    backlog_s: float = 0.05,
    min_workers: int = 1,
) -> Move | None:
    """At most one move of an idle worker to the model with the longest backlog.

    An idle worker of a model with an empty queue goes to the model whose backlog would take its
    workers longest to clear, if that is more than `backlog_s` seconds.

    `idle_s` is how long each worker has waited for work; `can_serve` the models each has a
    runner for. A model keeps at least `min_workers` workers.
    """
    def backlog(load: ModelLoad) -> float:
        if load.queued == 0:
            return 0.0
        return load.queued / load.capacity_per_s if load.capacity_per_s > 0 else float("inf")

    needy = sorted((m for m in loads if backlog(m) > backlog_s), key=backlog, reverse=True)
    for target in needy:
        donors = [m for m in loads
                  if m.name != target.name and m.queued == 0 and len(m.workers) > min_workers]
        candidates = [
            (idle_s.get(w, 0.0), w, donor.name) for donor in donors for w in donor.workers
            if target.name in can_serve.get(w, set()) and idle_s.get(w, 0.0) > 0
        ]
        if candidates:
            _, worker, src = max(candidates)
            return Move(worker, src, target.name)
    return None
