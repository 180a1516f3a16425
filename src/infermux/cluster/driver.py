"""The driver: a plan run on a Ray cluster, one runtime per node, trial after trial.

`run_cluster(plan, handle)` starts every node's runtime (`cluster.nodes`), then drives the
plan's LoadGen scenario through the router (`cluster.router.ClusterSUT`), trial after trial on
the same nodes, and stores each trial's record tagged by node.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from infermux.cluster.connect import ClusterHandle
from infermux.cluster.nodes import NodeWatcher, _start_nodes, _stop_nodes
from infermux.cluster.plan import ClusterPlan
from infermux.cluster.router import ClusterSUT, NodeLink, ray_errors
from infermux.errors import InfermuxError, UsageError
from infermux.load.scenarios import LoadGenerator, ScenarioResult, find_peak
from infermux.progress import ProgressFn
from infermux.runtime.dispatcher import WorkerState
from infermux.runtime.metrics import BatchRecord, summarise
from infermux.runtime.placement import LatencyEstimate
from infermux.store import Store

__all__ = ["ClusterReport", "run_cluster"]


@dataclass
class ClusterReport:
    """What `run_cluster` returns: the stored run id, status, the trial's record, per node."""

    run_id: int | None
    plan: ClusterPlan
    status: str
    record: dict[str, Any] | None = None
    nodes: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    start_s: float = 0.0
    #: Every node's batch records of the trial, on the driver's clock (`node/worker` names).
    batches: list[BatchRecord] = field(default_factory=list, repr=False)
    #: Measured delays in ns (the simulation's input): `to_node` (a submit until queued at its
    #: node), `return` (a completion until the driver has it), `issue_lag` (due until issued).
    delays_ns: dict[str, list[int]] = field(default_factory=dict, repr=False)
    #: Every trial's record in order (one, or with `load.find_peak` the offline trial and the
    #: server trials of the search), and the search's result.
    trials: list[dict[str, Any]] = field(default_factory=list, repr=False)
    peak: dict[str, Any] | None = None

    @property
    def final(self) -> dict[str, Any] | None:
        """The trial's record (the same shape as a runtime trial's, plus `nodes`)."""
        return self.record

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        out = {"run_id": self.run_id, "status": self.status, "error": self.error,
               "plan": self.plan.to_dict(), "start_s": self.start_s, "nodes": self.nodes,
               "result": self.record}
        if self.peak is not None:
            out["peak"] = self.peak
            out["trials"] = self.trials
        return out


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


def run_cluster(
    plan: ClusterPlan,
    handle: ClusterHandle,
    *,
    store: Store | None = None,
    progress: ProgressFn | None = None,
    command: str = "",
    base: Path | None = None,
    during: Callable[[ClusterSUT], None] | None = None,
) -> ClusterReport:
    """Run `plan` on the connected cluster under its load; the trial is stored, tagged by node.

    `during(sut)` is called on a thread of its own once the load begins (a test or a benchmark
    stops a node from there). Ctrl-C ends the run with what was measured.
    """
    from infermux.store import recording

    report = ClusterReport(None, plan, "complete")
    load = plan.load
    if load.find_peak and load.p99_bound_ms is None:
        raise UsageError("--find-peak needs a latency bound: set the cluster plan's "
                         "load.p99_bound_ms or pass --p99")
    if load.scenario == "server" and load.rate_qps is None and not load.find_peak:
        raise UsageError("cluster plan field load.rate_qps is required by the server scenario: "
                         "set it or pass --qps, or use --find-peak")
    config = {"cluster_plan": plan.to_dict(), "model": plan.name,
              "models": sorted({m.name for m in plan.models}), "cluster": handle.address}
    with recording(store, "cluster", config, command) as rec:
        report.run_id = rec.run_id
        try:
            _run(report, plan, handle, store, progress, base, during)
        except Exception as exc:
            report.status = "failed"
            report.error = (str(exc) if isinstance(exc, InfermuxError)
                            else f"{type(exc).__name__}: {exc}")
            raise
        finally:
            record = report.record or {}
            report.nodes = record.get("nodes", [])
            rec.status = report.status
            rec.summary = {k: record.get(k) for k in (
                "scenario", "valid", "validity_notes", "duration_s", "items_per_s",
                "completed", "failed", "unfinished", "latency")}
            rec.summary["nodes"] = [{k: n.get(k) for k in ("node", "status", "completed_samples",
                                                           "lost_at_s")} for n in report.nodes]
            if report.peak is not None:
                rec.summary["peak"] = {k: v for k, v in report.peak.items() if k != "trials"}
            if report.error:
                rec.summary["error"] = report.error
    return report


def _run(report: ClusterReport, plan: ClusterPlan, handle: ClusterHandle, store: Store | None,
         progress: ProgressFn | None, base: Path | None,
         during: Callable[[ClusterSUT], None] | None) -> None:
    started = time.perf_counter()
    links: list[NodeLink] = []
    trial: _Trials | None = None
    try:
        links = _start_nodes(plan, handle, base, progress)
        report.start_s = time.perf_counter() - started
        load = plan.load
        trial = _Trials(report, plan, handle, store, progress, base, links, during)
        if load.scenario == "server" and load.find_peak:
            offline = trial.run(load.model_copy(update={"scenario": "offline",
                                                        "find_peak": False}))
            if offline is None or offline.interrupted:
                return
            upper = float(trial.last.get("items_per_s") or 0.0)

            def server(rate: float) -> ScenarioResult:
                got = trial.run(load.model_copy(update={"scenario": "server", "rate_qps": rate,
                                                        "find_peak": False}))
                assert got is not None
                return got

            bound = float(load.p99_bound_ms or 0.0)
            peak = find_peak(server, upper_qps=upper, bound_ms=bound)
            report.peak = peak.record()
            valid = [t for t in report.trials if t.get("scenario") == "server" and t.get("valid")]
            if peak.peak_qps is not None and valid:
                best = max(valid, key=lambda t: t.get("rate_qps") or 0.0)
                report.record = best
                report.batches, report.delays_ns = trial.kept[best["trial"]]
        else:
            trial.run(load)
    except KeyboardInterrupt:
        report.status = "interrupted"
    finally:
        _stop_nodes(handle.ray, trial.links if trial is not None else links)


class _Trials:
    """One LoadGen trial after another on the same started nodes, each stored as it ends.

    Every trial empties the nodes' queues and counters (`begin_trial`) and drives a fresh
    `ClusterSUT` over the nodes alive (with those that joined during an earlier trial); the
    report's `record` is the last trial's (the search's best valid one once it ends).
    """

    def __init__(self, report: ClusterReport, plan: ClusterPlan, handle: ClusterHandle,
                 store: Store | None, progress: ProgressFn | None, base: Path | None,
                 links: list[NodeLink], during: Callable[[ClusterSUT], None] | None) -> None:
        self.report, self.plan, self.handle, self.store = report, plan, handle, store
        self.progress, self.base, self.links, self.during = progress, base, links, during
        self.last: dict[str, Any] = {}
        #: trial index → its batch records and delays (the search's best is reported)
        self.kept: dict[int, tuple[list[BatchRecord], dict[str, list[int]]]] = {}

    def run(self, load: Any) -> ScenarioResult | None:
        ray = self.handle.ray
        index = len(self.report.trials)
        live = [ln for ln in self.links if ln.alive]
        ray.get([ln.actor.begin_trial.remote() for ln in live])
        for ln in self.links:
            ln.out.clear()
            ln.held = ln.completed = ln.failed = ln.rerouted = 0
            ln.window.clear()
        plan = self.plan.model_copy(update={"load": load})
        sut = ClusterSUT(list(self.links), ray, plan)
        models = sorted({m for ln in live for m in ln.models})
        shares = dict.fromkeys(models, 1.0)
        for ln in live:
            for m in ln.plan.models if ln.plan else []:
                shares[m.name] = m.share
        gen = LoadGenerator(load.model_dump(mode="json"), shares,
                            mix=[p.model_dump() for p in load.mix] if load.mix else None,
                            progress=self.progress)
        watcher = NodeWatcher(plan, self.handle, sut, self.base)
        watcher.start()
        if self.during is not None and index == 0:
            threading.Thread(target=self.during, args=(sut,), name="infermux-cluster-during",
                             daemon=True).start()
        try:
            result = gen.run(sut, dict.fromkeys(models, load.sample_pool))
        finally:
            watcher.stop()
            sut.stop()
            self.links = sut.links  # with the nodes that joined: every one is stopped at the end
        record, batches = _summarise(sut, result, ray)
        record["trial"] = index
        delays = {"to_node": list(sut.to_node_ns), "return": list(sut.return_ns),
                  "issue_lag": result.issue_lag_ns()}
        self.report.record, self.report.batches, self.report.delays_ns = record, batches, delays
        self.report.trials.append(record)
        self.kept[index] = (batches, delays)
        self.last = record
        if result.interrupted:
            self.report.status = "interrupted"
        if self.store is not None and self.report.run_id is not None:
            _store(self.store, self.report.run_id, record, result, batches, index)
        return result


def _summarise(sut: ClusterSUT, result: ScenarioResult, ray: Any
               ) -> tuple[dict[str, Any], list[BatchRecord]]:
    records: list[BatchRecord] = []
    states: list[WorkerState] = []
    extra: dict[str, dict[str, Any]] = {}
    for ln in sut.links:
        if not ln.alive:
            continue
        try:
            got = ray.get(ln.actor.trial_records.remote(), timeout=60)
        except ray_errors(ray) as exc:
            sut._lose(ln, f"{type(exc).__name__} while collecting its records")
            continue
        recs, sts = _records(ln, got)
        records.extend(recs)
        states.extend(sts)
        extra[ln.name] = {"retried_in_node": got["retried_items"],
                          "failed_in_node": got["failed_items"]}
    record = summarise(result, records, states, {})
    dur = result.duration_s
    total = sum(ln.completed for ln in sut.links) or 1
    nodes = []
    for ln in sut.links:
        nodes.append({
            "node": ln.name, "entry": ln.entry, "node_id": ln.node_id, "address": ln.address,
            "status": "ok" if ln.alive else "lost", "lost_reason": ln.lost_reason,
            "lost_at_s": (ln.lost_at_ns - result.start_ns) / 1e9 if ln.lost_at_ns else None,
            "joined_at_s": ((ln.joined_at_ns - result.start_ns) / 1e9 if ln.joined_at_ns
                            else None),
            "completed_samples": ln.completed, "share": ln.completed / total,
            "items_per_s": ln.completed / dur if dur else None,
            "rate_estimate": ln.rate, "rate_at_start": ln.start_rate,
            "rerouted_samples": ln.rerouted, "failed_samples": ln.failed,
            "clock_offset_ns": ln.offset_ns, "build_s": ln.build.get("build_s"),
            "plan": ln.plan.name if ln.plan else None, "models": sorted(ln.models), **ln.facts,
            **extra.get(ln.name, {})})
    record["nodes"] = nodes
    record["node_timeline"] = _node_timeline(sut, result.start_ns, dur)
    record["cluster_events"] = [{**e, "t_s": (e["t_ns"] - result.start_ns) / 1e9}
                                for e in sut.events if "t_ns" in e]
    record["routing"] = {"pieces": sut.routed_pieces, "route_s": sut.route_ns / 1e9,
                         "per_piece_us": sut.route_ns / 1e3 / max(1, sut.routed_pieces),
                         "node_calls": sut.node_calls,
                         "per_call_us": sut.route_ns / 1e3 / max(1, sut.node_calls),
                         "answers": sut.answers,
                         "per_answer_us": sut.answer_ns / 1e3 / max(1, sut.answers),
                         "poll_rtt_p50_ms": (float(np.median(sut.rtt_ns)) / 1e6
                                             if sut.rtt_ns else None),
                         "return_p50_ms": (float(np.median(sut.return_ns)) / 1e6
                                           if sut.return_ns else None),
                         "to_node_p50_ms": (float(np.median(sut.to_node_ns)) / 1e6
                                            if sut.to_node_ns else None)}
    return record, records


def _store(store: Store, run_id: int, record: dict[str, Any], result: ScenarioResult,
           batches: list[BatchRecord], trial: int = 0) -> None:
    store.add_runtime_trial(run_id, trial, record, result, batches)
    store.add_cluster_nodes(run_id, trial, record["nodes"])
