"""The cluster's nodes: which node each plan entry claims, starting their runtimes, joiners.

`resolve_nodes` maps a cluster plan's entries to the cluster's alive nodes; `_start_nodes`
places a `NodeRuntime` actor on each (pinned with Ray's node affinity, holding the CPUs and
GPUs its local plan uses), tunes where an entry asks and builds each node's runtime;
`NodeWatcher` starts nodes that join while a plan runs or serves; `_stop_nodes` ends them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infermux.cluster.connect import ClusterHandle
from infermux.cluster.node import NodeRuntime
from infermux.cluster.plan import ClusterPlan, NodeEntry
from infermux.cluster.router import ClusterSUT, NodeLink
from infermux.errors import RunError, UsageError, first_line
from infermux.progress import ProgressFn
from infermux.runtime.plan import Plan, parse_plan

__all__ = ["NodeWatcher", "resolve_nodes"]


def resolve_nodes(plan: ClusterPlan, nodes: list[dict[str, Any]]
                  ) -> list[tuple[NodeEntry, str, dict[str, Any]]]:
    """(entry, node name, ray node row) for every node a plan entry claims; errors name the entry.

    Entries claim nodes in order; a node serves one entry. `count: all` takes every match left
    (none yet is allowed where another entry has a node: matching nodes that join later are
    taken then, `NodeWatcher`).
    """
    taken: set[str] = set()
    out = []
    for i, entry in enumerate(plan.nodes):
        free = [n for n in nodes if n["NodeID"] not in taken and entry.node.matches(n)]
        want = len(free) if entry.count == "all" else int(entry.count)
        if entry.count == "all" and not free and any(
                e.count != "all" or any(e.node.matches(n) for n in nodes) for e in plan.nodes):
            continue
        if not free or len(free) < want:
            seen = ", ".join(f"{n['NodeID'][:8]} ({n.get('NodeManagerAddress')})" for n in nodes)
            raise UsageError(
                f"cluster plan field nodes[{i}] ({entry.name}): {want if want else 'a'} node(s) "
                f"matching {entry.node.describe()} wanted, {len(free)} free; the cluster has "
                f"{len(nodes)} alive: {seen}")
        for k, node in enumerate(free[:want]):
            taken.add(node["NodeID"])
            name = entry.name if want == 1 and entry.count == 1 else f"{entry.name}-{k}"
            out.append((entry, name, node))
    return out


def _resources(plan: Plan, node: dict[str, Any]) -> dict[str, Any]:
    """The CPUs and GPUs a node's plan uses, within what the node offers (Ray pins them).

    Ray chooses which of the node's GPUs an actor gets and shows it only those
    (`CUDA_VISIBLE_DEVICES`), so a node plan's `cuda:N` is the N-th GPU it was given.
    """
    res = node.get("Resources") or {}
    cores: set[int] = set()
    whole_cpu = False
    gpus: set[str] = set()
    for m in plan.models:
        units = [r.unit for r in m.replicas] + [u for s in m.stages or [] for u in s.units]
        for u in units:
            if u == "cpu":
                whole_cpu = True
            elif u.startswith("cpu:"):
                from infermux.units import parse_core_set

                cores.update(parse_core_set(u[4:]))
            elif u.startswith("cuda:"):
                gpus.add(u.split("/")[0])
    have_cpu = float(res.get("CPU", 0))
    cpus = have_cpu if whole_cpu else min(have_cpu, float(len(cores)))
    return {"num_cpus": cpus, "num_gpus": min(float(res.get("GPU", 0)), float(len(gpus)))}


def _check_units(name: str, node: dict[str, Any], plan: Plan, facts: dict[str, Any]) -> None:
    """One clear line when the plan names a unit the node lacks (before anything is built)."""
    from infermux.units import parse_core_set

    have = set(facts.get("units", []))
    cores = set(facts.get("cores", []))
    where = f"node {name} ({node.get('NodeManagerAddress')}, id {node['NodeID'][:8]})"
    for mi, m in enumerate(plan.models):
        for ri, r in enumerate(m.replicas):
            field_ = f"models[{mi}].replicas[{ri}].unit"
            if r.unit.startswith("cpu:"):
                missing = sorted(set(parse_core_set(r.unit[4:])) - cores)
                if missing:
                    raise UsageError(
                        f"{where}: plan field {field_} {r.unit!r} names cores {missing} it lacks; "
                        f"its cores are {sorted(cores)}: give that node a plan for its own units")
            # Other kinds (openvino:, dla:) need the node's runtimes probed: its runtime's own
            # layout names them, with the node, when it starts.
            elif r.unit.startswith("cuda:") and r.unit not in have:
                raise UsageError(
                    f"{where}: plan field {field_} {r.unit!r} is not a unit of that node; it has "
                    f"{', '.join(sorted(have)) or 'none'}: give that node a plan for its own units")


def _start_nodes(plan: ClusterPlan, handle: ClusterHandle, base: Path | None,
                 progress: ProgressFn | None, *, serving: bool = False,
                 max_restarts: int = 0, take_when_idle: bool = True) -> list[NodeLink]:
    """Place, tune where asked, and build every node's runtime; their links (or the error)."""
    return _start_claims(plan, handle, resolve_nodes(plan, handle.nodes()), base, progress,
                         serving=serving, max_restarts=max_restarts,
                         take_when_idle=take_when_idle)


def _start_claims(plan: ClusterPlan, handle: ClusterHandle,
                  claims: list[tuple[NodeEntry, str, dict[str, Any]]], base: Path | None,
                  progress: ProgressFn | None, *, serving: bool = False,
                  max_restarts: int = 0, take_when_idle: bool = True) -> list[NodeLink]:
    ray = handle.ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(max_concurrency=8)(NodeRuntime)
    links: list[NodeLink] = []
    try:
        actors = []
        for entry, name, node in claims:
            local = plan.local_plan(entry, base)
            res = _resources(local, node) if local is not None else {"num_cpus": 0}
            actor = remote.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
                name=None, **res).remote(name)
            actors.append((entry, name, node, local, actor))
            links.append(NodeLink(name, entry.name, node["NodeID"],
                                  str(node.get("NodeManagerAddress")), actor, local, set()))
        facts = ray.get([a[4].facts.remote() for a in actors], timeout=300)
        for (entry, name, node, local, actor), fact, ln in zip(actors, facts, links, strict=True):
            ln.facts = fact
            if local is None:
                if progress:
                    progress(f"{name}: tuning", 0.0)
                spec = entry.tune_spec()
                got = ray.get(actor.tune.remote([m.model_dump(mode="json") for m in plan.models],
                                                spec.model_dump(mode="json") if spec else {},
                                                plan.load.model_dump(mode="json")))
                if "error" in got:
                    cls = UsageError if got.get("usage") else RunError
                    raise cls(f"node {name}: {got['error']}")
                local = parse_plan(got["plan"], source=f"node {name}'s tuned plan")
            ln.plan = local
            ln.models = {m.name for m in local.models}
            _check_units(name, node, local, fact)
        if progress:
            progress("building the nodes' runtimes", 0.0)
        built = ray.get([ln.actor.start.remote(ln.plan.to_dict() if ln.plan else {},
                                               serving, max_restarts, take_when_idle)
                         for ln in links], timeout=900)
        for ln, got in zip(links, built, strict=True):
            if "error" in got:
                cls = UsageError if got.get("usage") else RunError
                raise cls(f"node {ln.name} ({ln.address}, id {ln.node_id[:8]}): {got['error']}")
            ln.build = got["build"]
            ln.rate = dict(got["capacity"])
            ln.start_rate = dict(got["capacity"])
            ln.hold = dict(got["hold"])
            ln.batch = dict(got["batch"])
            ln.started = got
        return links
    except BaseException:
        _stop_nodes(ray, links)
        raise


class NodeWatcher:
    """Nodes that join while a plan runs or serves: started, measured, then routed to.

    Every `route.join_check_s` the cluster's alive nodes are listed; a node the driver does not
    run yet and that matches an entry with `count: all` gets that entry's runtime like the
    nodes at the start (placed, tuned where the entry says `tune: auto`, built: its build
    measures its latency, which seeds its rate) and only then joins the routing, so no query
    waits on a node still building. A node whose start fails is left out (an event says why)
    and not tried again.
    """

    def __init__(self, plan: ClusterPlan, handle: ClusterHandle, sut: ClusterSUT,
                 base: Path | None, *, serving: bool = False, max_restarts: int = 0,
                 take_when_idle: bool = True, begin_trial: bool = True,
                 on_join: Callable[[NodeLink], None] | None = None) -> None:
        self.plan, self.handle, self.sut, self.base = plan, handle, sut, base
        self.serving, self.max_restarts, self.take_when_idle = (serving, max_restarts,
                                                                take_when_idle)
        self.begin_trial = begin_trial
        self.on_join = on_join
        self._tried: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin watching (nothing to watch when no entry takes `count: all` or joining is off)."""
        if self.plan.route.join_check_s <= 0 or not any(
                e.count == "all" for e in self.plan.nodes):
            return
        self._tried = {ln.node_id for ln in self.sut.links}
        self._thread = threading.Thread(target=self._loop, name="infermux-cluster-join",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching; a node being started finishes (or fails) first."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def _loop(self) -> None:
        while not self._stop.wait(self.plan.route.join_check_s):
            try:
                nodes = self.handle.nodes()
            except Exception:  # noqa: BLE001  (the cluster's state is read again next time)
                continue
            for node in nodes:
                if self._stop.is_set():
                    return
                # A node that matches no entry yet is looked at again next time (its row may
                # list its resources and labels later than the node itself).
                if node["NodeID"] not in self._tried and self._entry(node) is not None:
                    self._tried.add(node["NodeID"])
                    self.join(node)

    def _entry(self, node: dict[str, Any]) -> NodeEntry | None:
        return next((e for e in self.plan.nodes if e.count == "all" and e.node.matches(node)),
                    None)

    def join(self, node: dict[str, Any]) -> NodeLink | None:
        """Start `node` under the first `count: all` entry it matches and route to it."""
        entry = self._entry(node)
        if entry is None:
            return None
        taken = {ln.name for ln in self.sut.links}
        k = sum(ln.entry == entry.name for ln in self.sut.links)
        while f"{entry.name}-{k}" in taken:
            k += 1
        name = f"{entry.name}-{k}"
        t0 = time.perf_counter_ns()
        try:
            ln = _start_claims(self.plan, self.handle, [(entry, name, node)], self.base, None,
                               serving=self.serving, max_restarts=self.max_restarts,
                               take_when_idle=self.take_when_idle)[0]
            if self.begin_trial:
                self.handle.ray.get(ln.actor.begin_trial.remote(), timeout=60)
        except Exception as exc:  # noqa: BLE001  (the running nodes go on; the event says why)
            self.sut.events.append({"t_ns": time.perf_counter_ns(), "event": "node_join_failed",
                                    "node": name, "node_id": node["NodeID"],
                                    "error": first_line(exc, limit=300)})
            return None
        if self._stop.is_set():  # the run ended while it started: nobody would stop it
            _stop_nodes(self.handle.ray, [ln])
            self.sut.events.append({"t_ns": time.perf_counter_ns(), "event": "node_join_late",
                                    "node": name, "node_id": node["NodeID"],
                                    "start_s": (time.perf_counter_ns() - t0) / 1e9})
            return None
        ln.joined_at_ns = time.perf_counter_ns()
        self.sut.add_link(ln)
        self.sut.events.append({"t_ns": ln.joined_at_ns, "event": "node_joined", "node": name,
                                "node_id": node["NodeID"], "entry": entry.name,
                                "start_s": (ln.joined_at_ns - t0) / 1e9,
                                "rate_at_start": dict(ln.start_rate)})
        if self.on_join is not None:
            self.on_join(ln)
        return ln


def _stop_nodes(ray: Any, links: list[NodeLink]) -> None:
    refs = []
    for ln in links:
        with contextlib.suppress(Exception):
            refs.append(ln.actor.shutdown.remote())
    with contextlib.suppress(Exception):
        ray.wait(refs, num_returns=len(refs), timeout=30)
    for ln in links:
        with contextlib.suppress(Exception):
            ray.kill(ln.actor)
