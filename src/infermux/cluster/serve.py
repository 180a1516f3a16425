"""`infermux serve --cluster`: the KServe v2 server's core in front of the cluster driver.

The server (`infermux.serve`) talks to one runtime: it submits queries whose samples carry
their input rows to a dispatcher, reads outputs back through `on_outputs`, and answers model
readiness from the runtime's worker states. `ClusterRuntime` is that runtime for a cluster:

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
from pathlib import Path
from typing import Any

from infermux.cluster.connect import ClusterHandle
from infermux.cluster.driver import ClusterSUT, NodeLink, NodeWatcher, _start_nodes, _stop_nodes
from infermux.cluster.plan import ClusterPlan
from infermux.errors import UsageError
from infermux.load.base import CompletionFn, Query
from infermux.runtime.dispatcher import Batch, Item, WorkerState
from infermux.runtime.placement import LatencyEstimate
from infermux.runtime.plan import Plan

__all__ = ["ClusterDispatcher", "ClusterRuntime", "start_cluster_runtime"]

#: Samples per model each node keeps for its own warm-up (a server's data comes in requests).
SERVE_SAMPLE_POOL = 4


class _Shape:
    """What the server reads of a loaded model: its input shape."""

    def __init__(self, input_shape: tuple[int, ...]) -> None:
        self.input_shape = input_shape


class ClusterDispatcher:
    """The part of a dispatcher the server uses, on the cluster driver."""

    def __init__(self, sut: ClusterSUT) -> None:
        self.sut = sut
        #: Called per batch a node ran, with the node worker's state (the server's statistics).
        self.on_batch_done: Any = None
        #: Read by nobody here: each node's dispatcher has its own, set when it starts.
        self.take_when_idle = True
        #: No local workers: nodes run them (`ready_info` lists process ids from here).
        self.workers: dict[int, WorkerState] = {}

    @property
    def on_outputs(self) -> Any:
        """Where served outputs go: (Batch of the samples answered, output arrays)."""
        return self.sut.on_outputs

    @on_outputs.setter
    def on_outputs(self, fn: Any) -> None:
        self.sut.on_outputs = fn

    @property
    def retried(self) -> int:
        """Samples sent again to another node after theirs was lost or failed them."""
        return self.sut.retried

    def set_completion(self, on_complete: CompletionFn) -> None:
        """Begin polling the nodes; failures (and completions) go to `on_complete`."""
        self.sut.start(on_complete)

    def submit(self, queries: list[Query]) -> None:
        """Route the queries' samples, rows and all, to the nodes."""
        self.sut.issue(queries)


class ClusterRuntime:
    """A cluster of node runtimes that the server's core drives as it drives one runtime."""

    def __init__(self, cluster_plan: ClusterPlan, handle: ClusterHandle, links: list[NodeLink],
                 *, base: Path | None = None, max_restarts: int = 0,
                 take_when_idle: bool = True) -> None:
        self.cluster_plan = cluster_plan
        self.handle = handle
        self.sut = ClusterSUT(links, handle.ray, cluster_plan, serving=True)
        self.dispatcher = ClusterDispatcher(self.sut)
        self.plan = front_plan(cluster_plan, links)
        self.models: dict[str, _Shape] = {}
        self.states: list[WorkerState] = []
        self._states: dict[str, list[WorkerState]] = {}
        self.build_info: dict[str, Any] = {
            "build_s": max((ln.build.get("build_s") or 0.0 for ln in links), default=0.0),
            "nodes": []}
        for ln in links:
            self._add_node(ln)
        self.host_by_id: dict[int, Any] = {}
        self.pipelines: list[Any] = []
        self.sut.on_answer = self._on_answer
        self.sut.on_node_lost = self._on_node_lost
        #: Nodes that join while serving (`count: all` entries) are started and routed to.
        self.watcher = NodeWatcher(cluster_plan, handle, self.sut, base, serving=True,
                                   max_restarts=max_restarts, take_when_idle=take_when_idle,
                                   begin_trial=False, on_join=self._add_node)

    @property
    def links(self) -> list[NodeLink]:
        """Every node the server has run on, those that joined included."""
        return self.sut.links

    def _add_node(self, ln: NodeLink) -> None:
        """A node's models and workers, as the server's statistics and readiness see them."""
        for name, shape in ln.started.get("input_shapes", {}).items():
            self.models.setdefault(name, _Shape(tuple(shape)))
        own: list[WorkerState] = []
        for w in ln.started.get("workers", []):
            st = WorkerState(len(self.states) + len(own), f"{ln.name}/{w['name']}", w["unit"],
                             w["model"], list(w["buckets"]), set(w["serves"]),
                             LatencyEstimate(0.2), depth=int(w["depth"]))
            st.alive, st.error = bool(w["alive"]), w["error"]
            own.append(st)
        self._states[ln.name] = own
        self.states = [*self.states, *own]  # one assignment: readers see the old or the new
        self.build_info["nodes"] = [*self.build_info["nodes"], {
            "node": ln.name, "address": ln.address, "node_id": ln.node_id,
            "models": sorted(ln.models), **ln.facts}]

    # -- the driver's callbacks (its poll thread) -------------------------------------------

    def _on_answer(self, ln: NodeLink, answer: dict[str, Any]) -> None:
        own = self._states.get(ln.name, [])
        alive = answer.get("alive") or []
        restarting = answer.get("restarting") or []
        errors = answer.get("errors") or []
        for i, st in enumerate(own):
            if i < len(alive):
                st.alive = bool(alive[i]) and ln.alive
                st.restarting = bool(restarting[i]) if i < len(restarting) else False
                st.error = errors[i] if i < len(errors) else None
        hook = self.dispatcher.on_batch_done
        if hook is None:
            return
        now = time.perf_counter_ns()
        for wi, n, queue_ns, compute_ns in answer.get("batches", ()):
            if not 0 <= wi < len(own) or n <= 0:
                continue
            st = own[wi]
            # Only the totals of the batch matter to the statistics: n items whose queue
            # times add up to what the node measured.
            item = Item(0, st.model, 0, now - queue_ns // n)
            hook(st, Batch(st.model, [item] * n, n, now, [now] * n), 0, compute_ns, None)

    def _on_node_lost(self, ln: NodeLink) -> None:
        for st in self._states.get(ln.name, []):
            st.alive = False
            st.restarting = False
            st.error = f"node {ln.name} ({ln.address}) was lost: {ln.lost_reason}"

    # -- what the server calls --------------------------------------------------------------

    def shutdown(self, *, now: bool) -> None:
        """Stop polling and stop every node's runtime (the server answered what it admitted)."""
        self.watcher.stop()
        self.sut.stop()
        _stop_nodes(self.handle.ray, self.links)

    def nodes(self) -> list[dict[str, Any]]:
        """Each node's status and counts, for the stored summary."""
        return [{"node": ln.name, "address": ln.address, "status": "ok" if ln.alive else "lost",
                 "lost_reason": ln.lost_reason, "completed_samples": ln.completed,
                 "failed_samples": ln.failed, "rerouted_samples": ln.rerouted,
                 "joined": bool(ln.joined_at_ns)}
                for ln in self.links]


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
        runtime.watcher.start()
        return runtime
    except BaseException:
        with contextlib.suppress(Exception):
            _stop_nodes(handle.ray, links)
        raise
