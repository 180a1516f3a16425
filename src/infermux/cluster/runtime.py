"""A cluster of node runtimes as one `TrialRuntime`: what a server and a cluster run drive.

`ClusterRuntime` puts the router (`cluster.router.ClusterSUT`) and the nodes' runtimes behind
the protocol of `infermux.runtime.api`, so `infermux serve --cluster` drives it as it drives
this machine's runtime, and `run_cluster` runs its trials and peak search through the same
loop as `run_plan` (`runtime.peak`):

- **Serving** (`serving=True`): one router polls the nodes for the runtime's life; requests go
  to nodes with their rows (`cluster/serve.py`), outputs come back in the poll answers.
- **Trials** (`serving=False`): each trial empties every node's queues and counters, then
  routes through a fresh router over the nodes alive (with those that joined during an earlier
  trial) and a node watcher of its own; at its end the nodes' batch records come back on the
  driver's clock, and the trial's record gets a row per node, the per-node timeline, the
  cluster's events and the routing costs.
- **Readiness.** Every worker of every node appears as a worker state named `node/worker`:
  alive while its node is alive and the node's runtime says it serves (each poll answer
  refreshes them while serving). A model is ready while one of them is.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from infermux.cluster.connect import ClusterHandle
from infermux.cluster.nodes import NodeWatcher, _stop_nodes
from infermux.cluster.plan import ClusterPlan
from infermux.cluster.router import ClusterSUT, NodeLink, ray_errors
from infermux.errors import RunError, UsageError
from infermux.load.base import CompletionFn, Query
from infermux.load.scenarios import ScenarioResult
from infermux.runtime.api import (
    BatchFn,
    FailureFn,
    OutputsFn,
    RejectionFn,
    RuntimeStats,
    Subscription,
    SubscriptionHub,
    TrialCounts,
    TrialRuntime,
)
from infermux.runtime.dispatcher import Batch, Item, WorkerState
from infermux.runtime.metrics import BatchRecord
from infermux.runtime.placement import LatencyEstimate
from infermux.runtime.plan import LoadSettings, Plan
from infermux.runtime.trial import ClusterTrial, TrialSummary

__all__ = ["ClusterRuntime", "ServedNodeSummary", "front_plan"]


class ClusterRuntime:
    """A cluster of node runtimes, as the `TrialRuntime` a server or a cluster run drives.

    `serving` picks the mode (see the module docstring): a serving runtime routes for its
    whole life and runs no trials; a run's routes trial by trial.
    """

    def __init__(self, cluster_plan: ClusterPlan, handle: ClusterHandle, links: list[NodeLink],
                 *, base: Path | None = None, max_restarts: int = 0,
                 take_when_idle: bool = True, serving: bool = True) -> None:
        self.cluster_plan = cluster_plan
        self.handle = handle
        self.serving = serving
        self.base = base
        self._max_restarts, self._take_when_idle = max_restarts, take_when_idle
        self._hub = SubscriptionHub()
        self.sut = self._router(links, cluster_plan)
        self._plan = front_plan(cluster_plan, links)
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
        #: Nodes that join (`count: all` entries) are started and routed to.
        self.watcher = self._watcher(cluster_plan)
        #: Trials begun, the current trial's load, and its nodes' counts (`end_trial`).
        self._trial = 0
        self._load: LoadSettings = cluster_plan.load
        self._node_counts: dict[str, dict[str, Any]] = {}
        #: Called on a thread of its own with the router once the first trial's load begins
        #: (a test or a benchmark stops a node from there).
        self.on_first_trial: Callable[[ClusterSUT], None] | None = None

    def _router(self, links: list[NodeLink], plan: ClusterPlan) -> ClusterSUT:
        sut = ClusterSUT(links, self.handle.ray, plan, serving=self.serving)
        sut.on_outputs = self._hub.outputs
        sut.on_rejected = self._hub.rejections
        if self.serving:
            # Readiness and the server's statistics; a run reads the nodes' records instead.
            sut.on_answer = self._on_answer
        sut.on_node_lost = self._on_node_lost
        return sut

    def _watcher(self, plan: ClusterPlan) -> NodeWatcher:
        return NodeWatcher(plan, self.handle, self.sut, self.base, serving=self.serving,
                           max_restarts=self._max_restarts,
                           take_when_idle=self._take_when_idle,
                           begin_trial=not self.serving, on_join=self._add_node)

    def start(self) -> None:
        """Serving: begin polling the nodes and watching for joiners.

        Answers go to the subscribers. A run's trials start their own (`begin_trial`).
        """
        if not self.serving:
            return
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
        """Receive outputs, completions, the nodes' batch statistics, workers lost, rejections.

        A lost node loses all of its workers; served samples are answered by their outputs,
        so completions tell failures; a request whose input a node's engine rejected is told
        to `rejections` before its failed completion.
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
        return RuntimeStats(self.sut.retried, sum(ln.failed + ln.rejected for ln in self.links),
                            queued)

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

    # -- trials (`TrialRuntime`) --------------------------------------------------------------

    @property
    def trial(self) -> int:
        """The current trial's number."""
        return self._trial

    def begin_trial(self, settings: dict[str, Any] | None = None) -> int:
        """Empty every live node's queues and counters; route the trial through a new router.

        `settings` (the trial's `load:` section) sets how the router coalesces answers. The
        router of the previous trial was stopped by its `end_trial`.
        """
        if self.serving:
            raise RunError("a serving cluster runtime runs no trials: start it with "
                           "serving=False to run a plan's load")
        ray = self.handle.ray
        self._trial += 1
        if settings is not None:
            self._load = LoadSettings.model_validate(settings)
        live = [ln for ln in self.links if ln.alive]
        dropped = sum(int(n or 0) for n in ray.get([ln.actor.begin_trial.remote()
                                                     for ln in live]))
        for ln in self.links:
            ln.out.clear()
            ln.held = ln.completed = ln.failed = ln.rerouted = 0
            ln.window.clear()
        plan = self.cluster_plan.model_copy(update={"load": self._load})
        self.sut = self._router(list(self.links), plan)
        self.watcher = self._watcher(plan)
        self.sut.start(self._hub.completions)
        self.watcher.start()
        if self.on_first_trial is not None and self._trial == 1:
            threading.Thread(target=self.on_first_trial, args=(self.sut,),
                             name="infermux-cluster-during", daemon=True).start()
        return dropped

    def capacity_items(self, model: str) -> int:
        """Items the live nodes hold at once for `model`, plus a batch each on the way."""
        return self.sut.capacity_items(model)

    def sample_counts(self) -> dict[str, int]:
        """Each node's sample library holds the trial's `sample_pool` samples per model."""
        models = sorted({m for ln in self.links if ln.alive for m in ln.models})
        return dict.fromkeys(models, self._load.sample_pool)

    def end(self) -> None:
        """No more queries this trial: nodes flush partial batches."""
        self.sut.end()

    def end_trial(self) -> TrialCounts:
        """Stop the trial's router; every live node's batch records on the driver's clock."""
        self.watcher.stop()
        self.sut.stop()
        ray = self.handle.ray
        records: list[BatchRecord] = []
        states: list[WorkerState] = []
        self._node_counts = {}
        retried = failed = 0
        for ln in self.links:
            if not ln.alive:
                continue
            try:
                got = ray.get(ln.actor.trial_records.remote(), timeout=60)
            except ray_errors(ray) as exc:
                self.sut._lose(ln, f"{type(exc).__name__} while collecting its records")
                continue
            recs, sts = _records(ln, got)
            records.extend(recs)
            states.extend(sts)
            self._node_counts[ln.name] = {"retried_in_node": got["retried_items"],
                                          "failed_in_node": got["failed_items"]}
            retried += int(got["retried_items"])
            failed += int(got["failed_items"])
        return TrialCounts(records, [], retried + self.sut.retried, failed, states)

    def trial_details(self, result: ScenarioResult, record: TrialSummary) -> TrialSummary:
        """A row per node, the per-node timeline, the cluster's events and routing costs."""
        sut = self.sut
        dur = result.duration_s
        total = sum(ln.completed for ln in sut.links) or 1
        nodes = []
        for ln in sut.links:
            nodes.append({
                "node": ln.name, "entry": ln.entry, "node_id": ln.node_id,
                "address": ln.address, "status": "ok" if ln.alive else "lost",
                "lost_reason": ln.lost_reason,
                "lost_at_s": (ln.lost_at_ns - result.start_ns) / 1e9 if ln.lost_at_ns else None,
                "joined_at_s": ((ln.joined_at_ns - result.start_ns) / 1e9 if ln.joined_at_ns
                                else None),
                "completed_items": ln.completed, "share": ln.completed / total,
                "items_per_s": ln.completed / dur if dur else None,
                "rate_estimate": ln.rate, "rate_at_start": ln.start_rate,
                "rerouted_items": ln.rerouted, "failed_items": ln.failed,
                "clock_offset_ns": ln.offset_ns, "build_s": ln.build.get("build_s"),
                "plan": ln.plan.name if ln.plan else None, "models": sorted(ln.models),
                **ln.facts, **self._node_counts.get(ln.name, {})})
        events = [{**e, "t_s": (e["t_ns"] - result.start_ns) / 1e9} for e in sut.events
                  if "t_ns" in e]
        routing = {
            "pieces": sut.routed_pieces, "route_s": sut.route_ns / 1e9,
            "per_piece_us": sut.route_ns / 1e3 / max(1, sut.routed_pieces),
            "node_calls": sut.node_calls,
            "per_call_us": sut.route_ns / 1e3 / max(1, sut.node_calls),
            "answers": sut.answers,
            "per_answer_us": sut.answer_ns / 1e3 / max(1, sut.answers),
            "poll_rtt_p50_ms": float(np.median(sut.rtt_ns)) / 1e6 if sut.rtt_ns else None,
            "return_p50_ms": float(np.median(sut.return_ns)) / 1e6 if sut.return_ns else None,
            "to_node_p50_ms": (float(np.median(sut.to_node_ns)) / 1e6 if sut.to_node_ns
                               else None)}
        return replace(record, cluster=ClusterTrial(
            nodes, _node_timeline(sut, result.start_ns, dur), events, routing))

    def trial_delays_ns(self, result: ScenarioResult) -> dict[str, list[int]]:
        """The trial's measured delays in ns (the simulation's input).

        `to_node`: a submit until queued at its node; `return`: a completion until the driver
        has it; `issue_lag`: a query's due time until issued.
        """
        return {"to_node": list(self.sut.to_node_ns), "return": list(self.sut.return_ns),
                "issue_lag": result.issue_lag_ns()}

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

    def nodes(self) -> list[ServedNodeSummary]:
        """Each node's status and counts, for the stored summary."""
        return [ServedNodeSummary(ln.name, ln.address, "ok" if ln.alive else "lost",
                                  ln.lost_reason, ln.completed, ln.failed, ln.rejected,
                                  ln.rerouted, bool(ln.joined_at_ns))
                for ln in self.links]


@dataclass(frozen=True, slots=True)
class ServedNodeSummary:
    """One node of a cluster over a server's life (an entry of the summary's `nodes`)."""

    node: str
    address: str
    status: str  # ok | lost
    lost_reason: str | None
    completed_items: int
    failed_items: int
    #: Items failed here for their own input (the node's engine rejected it): not retried.
    rejected_items: int
    #: Items sent on to another node from this one.
    rerouted_items: int
    #: Joined while the server ran (not one of the nodes it started with).
    joined: bool

    def to_dict(self) -> dict[str, Any]:
        """The stored and printed form."""
        return {"node": self.node, "address": self.address, "status": self.status,
                "lost_reason": self.lost_reason, "completed_items": self.completed_items,
                "failed_items": self.failed_items, "rejected_items": self.rejected_items,
                "rerouted_items": self.rerouted_items, "joined": self.joined}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServedNodeSummary:
        """A stored entry as the type (rows from before nodes could join read as not joined)."""
        return cls(str(data["node"]), str(data.get("address") or ""), str(data["status"]),
                   data.get("lost_reason"), int(data.get("completed_items") or 0),
                   int(data.get("failed_items") or 0), int(data.get("rejected_items") or 0),
                   int(data.get("rerouted_items") or 0), bool(data.get("joined")))


if TYPE_CHECKING:
    # mypy checks that the cluster's runtime is a `TrialRuntime`: a server's core drives it,
    # and the trial loop of `runtime.peak` runs a plan's load on it.
    _IS_RUNTIME: type[TrialRuntime] = ClusterRuntime


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


def _records(ln: NodeLink, got: dict[str, Any]) -> tuple[list[BatchRecord], list[WorkerState]]:
    """A node's batch records on the driver's clock, its workers named `node/worker`."""
    off = ln.offset_ns
    recs = []
    for b in got["batches"]:
        recs.append(BatchRecord(
            f"{ln.name}/{b['worker']}", b["unit"], b["model"], b["size"], b["bucket"],
            b["taken_ns"] - off, b["start_ns"] - off, b["end_ns"] - off,
            [t - off for t in b["enqueued_ns"]], [t - off for t in b["ready_ns"]],
            b.get("device_compute_ns", 0)))
    states = []
    for i, w in enumerate(got["workers"]):
        st = WorkerState(i, f"{ln.name}/{w['name']}", w["unit"], w["model"], w["buckets"],
                         {w["model"]}, LatencyEstimate(0.2))
        st.alive, st.error, st.failure = w["alive"], w["error"], w["failure"]
        states.append(st)
    return recs, states


def _node_timeline(sut: ClusterSUT, start_ns: int, duration_s: float, bins: int = 20
                   ) -> dict[str, Any]:
    """Samples each node completed per time bin, as the driver received them."""
    if duration_s <= 0:
        return {"bin_s": 0.0, "rows": []}
    bin_s = duration_s / bins
    table: dict[tuple[int, str], int] = defaultdict(int)
    for t, node, n in sut.log:
        table[(min(bins - 1, max(0, int((t - start_ns) / 1e9 / bin_s))), node)] += n
    rows = [{"t_s": round(i * bin_s, 4), "node": node, "items": table.get((i, node), 0)}
            for i in range(bins) for node in sorted({ln.name for ln in sut.links})]
    return {"bin_s": bin_s, "rows": rows}
