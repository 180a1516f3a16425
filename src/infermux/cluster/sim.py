"""Planning past the machines at hand: the cluster's policy simulated on measured service times.

A discrete-event simulation of what `run_cluster` does, for 10–1,000 nodes of mixed kinds:
the load generator (offline backlog topped up on completion, or Poisson server arrivals), the
driver routing pieces of a node's batch to the node that would finish them first (what it
holds over its rate), the driver's own cost per routed piece and per completion
answer (a single server: at scale it is the driver that saturates), the way back to the driver,
and inside each node the runtime's pull dispatcher with dynamic batching. Batch service times
are drawn from measured distributions (`NodeKind.from_records`, from a real run's batch
records); nothing is assumed about a unit that was not measured.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["DriverCost", "NodeKind", "SimResult", "kinds_from_records", "simulate"]


@dataclass
class NodeKind:
    """A kind of node: how many workers, their batch, and measured batch service times (s)."""

    name: str
    workers: int
    batch: int
    #: Measured service times in seconds per batch bucket (items the runner was built for).
    service_s: dict[int, np.ndarray]
    max_queue_delay_s: float = 0.001

    def __post_init__(self) -> None:
        self.service_s = {b: np.asarray(v, dtype=np.float64) for b, v in self.service_s.items()
                          if len(v)}
        if not self.service_s:
            raise ValueError(f"node kind {self.name!r} has no measured service times")
        buckets = sorted(self.service_s)
        means = [float(self.service_s[b].mean()) for b in buckets]
        if len(buckets) > 1:
            self._slope, self._icept = np.polyfit(buckets, means, 1)
        else:  # one bucket: time proportional to the batch
            self._slope, self._icept = means[0] / buckets[0], 0.0

    def bucket(self, n: int) -> int:
        """The smallest power-of-two bucket holding `n` items (the runtime's `pow2`)."""
        b = 1
        while b < n and b < self.batch:
            b *= 2
        return min(b, self.batch)

    def draw(self, bucket: int, rng: np.random.Generator) -> float:
        """One batch's service time: a measured one of the bucket, else of the nearest, scaled."""
        got = self.service_s.get(bucket)
        if got is not None:
            return float(got[rng.integers(len(got))])
        near = min(self.service_s, key=lambda b: abs(b - bucket))
        base = self.service_s[near]
        want = max(1e-6, self._icept + self._slope * bucket)
        return float(base[rng.integers(len(base))] * want / base.mean())

    def rate(self) -> float:
        """Items/s of the node at full batches (what the driver's estimate starts from)."""
        return self.workers * self.batch / self.draw_mean(self.batch)

    def draw_mean(self, bucket: int) -> float:
        """The mean service time of a bucket."""
        got = self.service_s.get(bucket)
        if got is not None:
            return float(got.mean())
        return max(1e-6, self._icept + self._slope * bucket)

    def scaled(self, name: str, *, workers: int) -> NodeKind:
        """The same measured workers, `workers` of them in one node (a larger box of that unit)."""
        return NodeKind(name, workers, self.batch, dict(self.service_s), self.max_queue_delay_s)


def kinds_from_records(batches: Sequence[Any], *, max_queue_delay_s: float = 0.001
                       ) -> dict[str, NodeKind]:
    """A NodeKind per worker from a run's batch records (`BatchRecord`s or their dicts)."""
    per: dict[str, dict[int, list[float]]] = {}
    for b in batches:
        row: dict[str, Any] = b if isinstance(b, dict) else vars(b)
        per.setdefault(str(row["worker"]), {}).setdefault(int(row["bucket"]), []).append(
            (row["end_ns"] - row["start_ns"]) / 1e9)
    return {w: NodeKind(w, 1, max(d), {k: np.asarray(v) for k, v in d.items()},
                        max_queue_delay_s) for w, d in per.items()}


@dataclass
class DriverCost:
    """The driver's own time per call to a node and per completion answer, and the way back.

    A query's pieces for one node go in one call (`ClusterSUT.issue`), so routing costs
    `route_s` per node a query touches.
    """

    route_s: float = 100e-6
    answer_s: float = 100e-6
    #: From a node's completion to the driver's receipt.
    return_s: float = 0.5e-3
    #: Measured distributions (s) drawn from instead of fixed figures, where given: a submit
    #: until queued at its node, a completion until the driver has it, a query's issue lag.
    to_node_samples: Sequence[float] | None = None
    return_samples: Sequence[float] | None = None
    issue_lag_samples: Sequence[float] | None = None

    @classmethod
    def measured(cls, routing: dict[str, Any], delays_ns: dict[str, Sequence[int]]) -> DriverCost:
        """From a real run: its record's `routing` and the report's `delays_ns`."""
        def seconds(key: str) -> list[float] | None:
            got = [v / 1e9 for v in delays_ns.get(key, []) if v >= 0]
            return got or None

        return cls(route_s=routing["per_call_us"] / 1e6, answer_s=routing["per_answer_us"] / 1e6,
                   return_s=(routing.get("return_p50_ms") or 0.5) / 1e3,
                   to_node_samples=seconds("to_node"), return_samples=seconds("return"),
                   issue_lag_samples=seconds("issue_lag"))


@dataclass
class SimResult:
    """Predicted figures of one simulated run."""

    nodes: int
    scenario: str
    duration_s: float
    completed_items: int
    items_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    driver_utilisation: float
    node_utilisation: float
    per_kind: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return dict(self.__dict__)


class _Node:
    def __init__(self, idx: int, kind: NodeKind) -> None:
        self.idx = idx
        self.kind = kind
        self.queue: deque[list[Any]] = deque()  # [query, count, enqueued_s]
        self.queued = 0
        self.free = kind.workers
        self.held = 0  # the driver's view: routed and not yet answered
        self.rate = kind.rate()
        self.busy_s = 0.0
        self.done = 0
        self.timer = False


def simulate(kinds: Sequence[NodeKind], counts: Sequence[int], *, scenario: str = "offline",
             rate_qps: float | None = None, duration_s: float = 5.0, warmup_s: float = 0.5,
             driver: DriverCost | None = None, seed: int = 0) -> SimResult:
    """Simulate `counts[i]` nodes of `kinds[i]` under offline or server load for `duration_s`.

    Throughput counts completions after `warmup_s`; latency runs from a query's arrival (server)
    or issue (offline) to the driver's receipt of its last sample, as the runtime measures it.
    """
    if scenario not in ("offline", "server"):
        raise ValueError(f"scenario {scenario!r}: simulate offline or server")
    if scenario == "server" and not rate_qps:
        raise ValueError("the server scenario needs rate_qps")
    cost = driver or DriverCost()
    rng = np.random.default_rng(seed)
    arrays = {k: np.asarray(v, dtype=np.float64) if v else None for k, v in (
        ("to", cost.to_node_samples), ("back", cost.return_samples),
        ("lag", cost.issue_lag_samples))}

    def delay(key: str, fixed: float) -> float:
        got = arrays[key]
        return fixed if got is None else float(got[rng.integers(len(got))])

    nodes = [_Node(i, k) for i, (k, c) in enumerate(zip(kinds, counts, strict=True))
             for _ in range(c)]
    for i, n in enumerate(nodes):
        n.idx = i
    if not nodes:
        raise ValueError("no nodes to simulate")
    events: list[tuple[float, int, str, Any]] = []
    seq = [0]

    def push(t: float, kind: str, data: Any) -> None:
        seq[0] += 1
        heapq.heappush(events, (t, seq[0], kind, data))

    # What `ClusterSUT.capacity_items` says: each node's holding plus a batch on the way.
    hold = {n.idx: n.kind.workers * n.kind.batch + n.kind.batch for n in nodes}
    backlog = max(16, 2 * sum(hold.values()))
    chunk = max(1, backlog // 4)
    remaining: dict[int, int] = {}
    due: dict[int, float] = {}
    outstanding = [0]
    next_q = [0]
    driver_free = [0.0]
    driver_busy = [0.0]
    latencies: list[float] = []
    done_after = [0]
    end = warmup_s + duration_s

    def drive(t: float, cost_s: float) -> float:
        start = max(t, driver_free[0])
        driver_free[0] = start + cost_s
        driver_busy[0] += cost_s
        return driver_free[0]

    # The node that would finish a piece first: a heap of (held / rate, version, node), with
    # stale entries skipped (a node's key changes whenever it takes or returns items).
    version = [0] * len(nodes)
    ready: list[tuple[float, int, int]] = [(0.0, 0, nd.idx) for nd in nodes]
    heapq.heapify(ready)

    def rekey(nd: _Node) -> None:
        version[nd.idx] += 1
        heapq.heappush(ready, (nd.held / nd.rate, version[nd.idx], nd.idx))

    def route(t: float, qid: int, n: int) -> None:
        left = n
        calls: dict[int, int] = {}
        while left > 0:
            while ready[0][1] != version[ready[0][2]]:
                heapq.heappop(ready)
            best = nodes[ready[0][2]]
            k = min(best.kind.batch, left)
            left -= k
            best.held += k
            rekey(best)
            calls[best.idx] = calls.get(best.idx, 0) + k
        for idx, k in calls.items():
            push(drive(t, cost.route_s) + delay("to", 0.0), "arrive", (idx, qid, k))

    def issue_offline(t: float) -> None:
        while outstanding[0] < backlog:
            n = min(chunk, backlog - outstanding[0])
            qid = next_q[0]
            next_q[0] += 1
            remaining[qid], due[qid] = n, t
            outstanding[0] += n
            route(t, qid, n)

    def try_start(nd: _Node, t: float) -> None:
        while nd.free and nd.queued:
            oldest = nd.queue[0][2]
            if nd.queued < nd.kind.batch and t < oldest + nd.kind.max_queue_delay_s:
                if not nd.timer:
                    nd.timer = True
                    push(oldest + nd.kind.max_queue_delay_s, "timer", nd.idx)
                return
            take, parts = min(nd.kind.batch, nd.queued), []
            want = take
            while want:
                head = nd.queue[0]
                k = min(want, head[1])
                parts.append((head[0], k))
                head[1] -= k
                want -= k
                if head[1] == 0:
                    nd.queue.popleft()
            nd.queued -= take
            nd.free -= 1
            service = nd.kind.draw(nd.kind.bucket(take), rng)
            nd.busy_s += service
            push(t + service, "done", (nd.idx, parts, take))

    if scenario == "offline":
        issue_offline(0.0)
    else:
        assert rate_qps is not None
        count = math.ceil(rate_qps * end * 1.05) + 1
        for i, at in enumerate(np.cumsum(rng.exponential(1.0 / rate_qps, count))):
            if at > end:
                break
            push(float(at), "query", i)
    while events:
        t, _, kind, data = heapq.heappop(events)
        if t > end:
            break
        if kind == "query":
            remaining[data], due[data] = 1, t
            push(t + delay("lag", 0.0), "issue", data)
        elif kind == "issue":
            route(t, data, 1)
        elif kind == "arrive":
            idx, qid, k = data
            nd = nodes[idx]
            nd.queue.append([qid, k, t])
            nd.queued += k
            try_start(nd, t)
        elif kind == "timer":
            nd = nodes[data]
            nd.timer = False
            try_start(nd, t)
        elif kind == "done":
            idx, parts, take = data
            nd = nodes[idx]
            nd.free += 1
            nd.done += take
            push(t + delay("back", cost.return_s), "answer", (idx, parts, take))
            try_start(nd, t)
        elif kind == "answer":
            idx, parts, take = data
            at = drive(t, cost.answer_s)
            nd = nodes[idx]
            nd.held -= take
            rekey(nd)
            for qid, k in parts:
                remaining[qid] -= k
                outstanding[0] -= k
                if at >= warmup_s:
                    done_after[0] += k
                if remaining[qid] == 0:
                    del remaining[qid]
                    if due[qid] >= warmup_s:
                        latencies.append(at - due.pop(qid))
                    else:
                        due.pop(qid)
            if scenario == "offline":
                issue_offline(at)
    lat = np.asarray(latencies) * 1e3
    per_kind: dict[str, float] = {}
    for nd in nodes:
        per_kind[nd.kind.name] = per_kind.get(nd.kind.name, 0.0) + nd.done / end
    return SimResult(
        len(nodes), scenario, duration_s, done_after[0], done_after[0] / duration_s,
        float(np.percentile(lat, 50)) if len(lat) else None,
        float(np.percentile(lat, 99)) if len(lat) else None,
        min(1.0, driver_busy[0] / end),
        float(np.mean([min(1.0, nd.busy_s / (end * nd.kind.workers)) for nd in nodes])),
        per_kind)
