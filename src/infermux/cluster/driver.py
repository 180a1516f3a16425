"""The driver: a plan run on a Ray cluster, one runtime per node, trial after trial.

`run_cluster(plan, handle)` starts every node's runtime (`cluster.nodes`) and runs the plan's
load on them as a `ClusterRuntime` (`cluster.runtime`) through the trial loop `run_plan` uses
(`runtime.peak`): one trial, or the offline trial and the server rates of a peak search, each
routed by `cluster.router.ClusterSUT` and stored, tagged by node, as soon as it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infermux.cluster.connect import ClusterHandle
from infermux.cluster.nodes import _start_nodes, _stop_nodes
from infermux.cluster.plan import ClusterPlan
from infermux.cluster.router import ClusterSUT, NodeLink
from infermux.cluster.runtime import ClusterRuntime
from infermux.errors import InfermuxError, UsageError
from infermux.load.scenarios import ScenarioResult
from infermux.progress import ProgressFn
from infermux.runtime.metrics import BatchRecord
from infermux.runtime.peak import TrialRun, run_load, search_answer
from infermux.runtime.trial import TrialSummary
from infermux.store import Store

__all__ = ["ClusterReport", "run_cluster"]


@dataclass
class ClusterReport:
    """What `run_cluster` returns: the stored run id, status, the trial's record, per node."""

    run_id: int | None
    plan: ClusterPlan
    status: str
    record: TrialSummary | None = None
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
    trials: list[TrialSummary] = field(default_factory=list, repr=False)
    peak: dict[str, Any] | None = None

    @property
    def final(self) -> TrialSummary | None:
        """The trial's record (a runtime trial's, with its `cluster` part)."""
        return self.record

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        out = {"run_id": self.run_id, "status": self.status, "error": self.error,
               "plan": self.plan.to_dict(), "start_s": self.start_s, "nodes": self.nodes,
               "result": self.record.to_dict() if self.record is not None else None}
        if self.peak is not None:
            out["peak"] = self.peak
            out["trials"] = [t.to_dict() for t in self.trials]
        return out


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
            record = report.record.to_dict() if report.record is not None else {}
            report.nodes = record.get("nodes", [])
            rec.status = report.status
            rec.summary = {k: record.get(k) for k in (
                "scenario", "valid", "validity_notes", "duration_s", "items_per_s",
                "completed", "failed", "unfinished", "latency")}
            rec.summary["nodes"] = [{k: n.get(k) for k in ("node", "status", "completed_items",
                                                           "lost_at_s")} for n in report.nodes]
            if report.peak is not None:
                rec.summary["peak"] = {k: v for k, v in report.peak.items() if k != "trials"}
            if report.error:
                rec.summary["error"] = report.error
    return report


def _run(report: ClusterReport, plan: ClusterPlan, handle: ClusterHandle, store: Store | None,
         progress: ProgressFn | None, base: Path | None,
         during: Callable[[ClusterSUT], None] | None) -> None:
    """Start the nodes, then the plan's load through the trial loop every runtime shares."""
    started = time.perf_counter()
    links: list[NodeLink] = []
    runtime: ClusterRuntime | None = None
    #: trial index → its batch records and delays (the search's best is reported)
    kept: dict[int, tuple[list[BatchRecord], dict[str, list[int]]]] = {}
    try:
        links = _start_nodes(plan, handle, base, progress)
        report.start_s = time.perf_counter() - started
        runtime = ClusterRuntime(plan, handle, links, base=base, serving=False)
        runtime.on_first_trial = during
        rt = runtime

        def keep(run: TrialRun) -> None:
            delays = rt.trial_delays_ns(run.result)
            report.record, report.batches, report.delays_ns = run.record, run.batches, delays
            report.trials.append(run.record)
            kept[run.index] = (run.batches, delays)
            if run.result.interrupted:
                report.status = "interrupted"
            if store is not None and report.run_id is not None:
                _store(store, report.run_id, run.record, run.result, run.batches, run.index)

        load = plan.load
        # Each model's share as its nodes' plans give it (1 where none does).
        shares = dict.fromkeys(sorted({m for ln in links for m in ln.models}), 1.0)
        for ln in links:
            for m in ln.plan.models if ln.plan else []:
                shares[m.name] = m.share
        # One run of each rate: a cluster's trials are long and its edge is not confirmed.
        report.peak = run_load(rt, load.model_dump(mode="json"), keep=keep, shares=shares,
                               mix=[p.model_dump() for p in load.mix] if load.mix else None,
                               progress=progress, confirm=False)
        best = search_answer(report.trials, report.peak)
        if best is not None:
            report.record = best
            report.batches, report.delays_ns = kept[best.trial or 0]
    except KeyboardInterrupt:
        report.status = "interrupted"
    finally:
        if runtime is not None:
            runtime.stop(drain=False)
        else:
            _stop_nodes(handle.ray, links)


def _store(store: Store, run_id: int, record: TrialSummary, result: ScenarioResult,
           batches: list[BatchRecord], trial: int = 0) -> None:
    store.add_runtime_trial(run_id, trial, record.to_dict(), result, batches)
    store.add_cluster_nodes(run_id, trial, record.cluster.nodes if record.cluster else [])
