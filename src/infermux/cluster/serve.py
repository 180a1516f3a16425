"""`infermux serve --cluster`: the KServe v2 server's core in front of the cluster driver.

The server (`infermux.serve`) drives a `Runtime` (`infermux.runtime.api`): it submits queries
whose samples carry their input rows, receives outputs through a subscription, and answers
model readiness from the runtime's worker states. `ClusterRuntime` is that runtime for a
cluster:

- **Requests go to nodes.** A request's rows travel with its piece in the node's `submit`
  call (Ray passes large arrays through its object store); pieces are routed as a run routes
  them (`ClusterSUT`: whole batches to the node that would finish first, by measured rate and
  what it holds). Each node runs the rows through its own runtime and sends the outputs, with
  the sample indices they answer, in its poll answers; the server writes them into the
  request's arrays in order.
- **A lost node loses no request.** Its pieces go, rows and all, to another node serving the
  model (at most `route.max_retries` times), else the request is answered with an error; a
  node that fails a piece has it retried the same way. Nothing waits on a dead node.
- **Readiness.** Every worker of every node appears as a worker state named `node/worker`:
  alive while its node is alive and the node's runtime says it serves (each poll answer
  refreshes them). A model is ready while one of them is.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infermux.cluster.connect import ClusterHandle
from infermux.cluster.nodes import NodeWatcher, _start_nodes, _stop_nodes
from infermux.cluster.plan import ClusterPlan
from infermux.cluster.router import ClusterSUT, NodeLink
from infermux.errors import UsageError
from infermux.load.base import CompletionFn, Query
from infermux.runtime.api import (
    BatchFn,
    FailureFn,
    OutputsFn,
    RejectionFn,
    Runtime,
    RuntimeStats,
    Subscription,
    SubscriptionHub,
)
from infermux.runtime.dispatcher import Batch, Item, WorkerState
from infermux.runtime.placement import LatencyEstimate
from infermux.runtime.plan import Plan

__all__ = ["ClusterRuntime", "start_cluster_runtime"]

#: Samples per model each node keeps for its own warm-up (a server's data comes in requests).
SERVE_SAMPLE_POOL = 4


class ClusterRuntime:
    """A cluster of node runtimes, as the `Runtime` protocol the server's core drives."""

    def __init__(self, cluster_plan: ClusterPlan, handle: ClusterHandle, links: list[NodeLink],
                 *, base: Path | None = None, max_restarts: int = 0,
                 take_when_idle: bool = True) -> None:
        self.cluster_plan = cluster_plan
        self.handle = handle
        self.sut = ClusterSUT(links, handle.ray, cluster_plan, serving=True)
        self._plan = front_plan(cluster_plan, links)
        self._hub = SubscriptionHub()
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.states: list[WorkerState] = []
        self._states: dict[str, list[WorkerState]] = {}
        #: Items waiting per model at each node, from its last poll answer.
        self._queued: dict[str, dict[str, int]] = {}
        self._build_info: dict[str, Any] = {
            "build_s": max((ln.build.get("build_s") or 0.0 for ln in links), default=0.0),
            "nodes": []}
        for ln in links:
            self._add_node(ln)
        self.sut.on_outputs = self._hub.outputs
        self.sut.on_answer = self._on_answer
        self.sut.on_node_lost = self._on_node_lost
        #: Nodes that join while serving (`count: all` entries) are started and routed to.
        self.watcher = NodeWatcher(cluster_plan, handle, self.sut, base, serving=True,
                                   max_restarts=max_restarts, take_when_idle=take_when_idle,
                                   begin_trial=False, on_join=self._add_node)

    def start(self) -> None:
        """Begin polling the nodes (answers go to the subscribers) and watching for joiners."""
        self.sut.start(self._hub.completions)
        self.watcher.start()

    @property
    def links(self) -> list[NodeLink]:
        """Every node the server has run on, those that joined included."""
        return self.sut.links

    def _add_node(self, ln: NodeLink) -> None:
        """A node's models and workers, as the server's statistics and readiness see them."""
        for name, shape in ln.started.get("input_shapes", {}).items():
            self._shapes.setdefault(name, tuple(shape))
        own: list[WorkerState] = []
        for w in ln.started.get("workers", []):
            st = WorkerState(len(self.states) + len(own), f"{ln.name}/{w['name']}", w["unit"],
                             w["model"], list(w["buckets"]), set(w["serves"]),
                             LatencyEstimate(0.2), depth=int(w["depth"]))
            st.alive, st.error = bool(w["alive"]), w["error"]
            own.append(st)
        self._states[ln.name] = own
        self.states = [*self.states, *own]  # one assignment: readers see the old or the new
        self._build_info["nodes"] = [*self._build_info["nodes"], {
            "node": ln.name, "address": ln.address, "node_id": ln.node_id,
            "models": sorted(ln.models), **ln.facts}]

    # -- the Runtime protocol ------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """Each model's entry on its first node (`front_plan`)."""
        return self._plan

    @property
    def build_info(self) -> dict[str, Any]:
        """The slowest node's build seconds and every node's facts."""
        return self._build_info

    def input_shape(self, model: str) -> tuple[int, ...]:
        """One item's input shape of `model`, as its nodes loaded it."""
        return self._shapes[model]

    def workers(self) -> list[WorkerState]:
        """Every node's workers, named `node/worker`."""
        return self.states

    def submit(self, queries: Sequence[Query]) -> None:
        """Route the queries' samples, rows and all, to the nodes."""
        self.sut.issue(queries)

    def subscribe(self, *, outputs: OutputsFn | None = None,
                  completions: CompletionFn | None = None, batches: BatchFn | None = None,
                  failures: FailureFn | None = None,
                  rejections: RejectionFn | None = None) -> Subscription:
        """Receive outputs, completions, the nodes' batch statistics and workers lost.

        A lost node loses all of its workers; served samples are answered by their outputs,
        so completions tell failures.
        """
        return self._hub.subscribe(outputs=outputs, completions=completions, batches=batches,
                                   failures=failures, rejections=rejections)

    def ready(self, model: str) -> bool:
        """A live worker of a live node serves `model`."""
        return any(s.alive and (s.model == model or model in s.serves) for s in self.states)

    def stats(self) -> RuntimeStats:
        """Samples sent again to another node, samples failed, items queued at the nodes."""
        queued: dict[str, int] = {}
        for per in list(self._queued.values()):
            for m, n in per.items():
                queued[m] = queued.get(m, 0) + n
        return RuntimeStats(self.sut.retried, sum(ln.failed for ln in self.links), queued)

    def pipeline_stats(self) -> dict[str, list[dict[str, Any]]]:
        """Not gathered from the nodes: empty."""
        return {}

    def worker_pids(self) -> dict[str, int]:
        """Nodes run their workers: no process of this machine hosts one."""
        return {}

    def stop(self, *, drain: bool) -> None:
        """Stop polling and stop every node's runtime (the server answered what it admitted)."""
        self.watcher.stop()
        self.sut.stop()
        _stop_nodes(self.handle.ray, self.links)

    # -- the driver's callbacks (its poll thread) -------------------------------------------

    def _on_answer(self, ln: NodeLink, answer: dict[str, Any]) -> None:
        own = self._states.get(ln.name, [])
        alive = answer.get("alive") or []
        restarting = answer.get("restarting") or []
        errors = answer.get("errors") or []
        self._queued[ln.name] = dict(answer.get("queued") or {})
        for i, st in enumerate(own):
            if i < len(alive):
                st.alive = bool(alive[i]) and ln.alive
                st.restarting = bool(restarting[i]) if i < len(restarting) else False
                st.error = errors[i] if i < len(errors) else None
        now = time.perf_counter_ns()
        for wi, n, queue_ns, compute_ns in answer.get("batches", ()):
            if not 0 <= wi < len(own) or n <= 0:
                continue
            st = own[wi]
            # Only the totals of the batch matter to the statistics: n items whose queue
            # times add up to what the node measured.
            item = Item(0, st.model, 0, now - queue_ns // n)
            self._hub.batches(st, Batch(st.model, [item] * n, n, now, [now] * n), 0, compute_ns,
                              None)

    def _on_node_lost(self, ln: NodeLink) -> None:
        self._queued.pop(ln.name, None)
        lost = self._states.get(ln.name, [])
        for st in lost:
            st.alive = False
            st.restarting = False
            st.error = f"node {ln.name} ({ln.address}) was lost: {ln.lost_reason}"
        for st in lost:
            self._hub.failures(st)

    # -- beyond the protocol ----------------------------------------------------------------

    def nodes(self) -> list[dict[str, Any]]:
        """Each node's status and counts, for the stored summary."""
        return [{"node": ln.name, "address": ln.address, "status": "ok" if ln.alive else "lost",
                 "lost_reason": ln.lost_reason, "completed_samples": ln.completed,
                 "failed_samples": ln.failed, "rerouted_samples": ln.rerouted,
                 "joined": bool(ln.joined_at_ns)}
                for ln in self.links]


if TYPE_CHECKING:
    # mypy checks that the cluster's runtime is a `Runtime` the server's core can drive.
    _IS_RUNTIME: type[Runtime] = ClusterRuntime


def front_plan(cluster_plan: ClusterPlan, links: list[NodeLink]) -> Plan:
    """The plan the server describes its models from: each model's entry on its first node.

    Nodes may run the same model on different units; what the server reports of a model
    (its batch limit, its instances) comes from every node's workers, this entry gives its
    input type and name. Built without the local checks (cores of different nodes may look
    alike), it is only read.
    """
    entries: dict[str, Any] = {}
    first: Plan | None = None
    for ln in links:
        if ln.plan is None:
            continue
        first = first or ln.plan
        for m in ln.plan.models:
            entries.setdefault(m.name, m)
    if first is None or not entries:
        raise UsageError("the cluster plan's nodes serve no model")
    return Plan.model_construct(name=cluster_plan.name, models=list(entries.values()),
                                dispatcher=first.dispatcher, placement="static",
                                placement_interval_s=first.placement_interval_s,
                                load=first.load)


def start_cluster_runtime(cluster_plan: ClusterPlan, handle: ClusterHandle, *,
                          base: Path | None = None, progress: Any = None,
                          max_restarts: int = 0, wait_when_idle: bool = False
                          ) -> ClusterRuntime:
    """Start every node's runtime for serving; the runtime the server's core drives.

    `max_restarts`: each node restarts its own failed workers that many times;
    `wait_when_idle`: idle workers wait out the queue delay for fuller batches (`--wait-when-idle`).
    """
    links = _start_nodes(cluster_plan, handle, base, progress, serving=True,
                         max_restarts=max_restarts, take_when_idle=not wait_when_idle)
    try:
        runtime = ClusterRuntime(cluster_plan, handle, links, base=base,
                                 max_restarts=max_restarts, take_when_idle=not wait_when_idle)
        runtime.start()
        return runtime
    except BaseException:
        with contextlib.suppress(Exception):
            _stop_nodes(handle.ray, links)
        raise
