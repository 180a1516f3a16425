"""The cluster on a real multi-node Ray cluster on localhost: start/stop, a run, a lost node.

One local cluster of three nodes (one logical CPU each) serves the module; the test that stops
a node runs last. Each node runs a real infermux runtime (a tiny CNN on one core) in a Ray
actor pinned to that node.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from infermux.errors import UsageError
from tests.conftest import ROOT

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
pytest.importorskip("ray", reason="the cluster needs Ray: pip install 'infermux[cluster]'")

from infermux.cluster import open_cluster, parse_cluster_plan, run_cluster
from infermux.store import Store

#: Asserts on timing or on processes coming and going: `make test` runs it in its serial pass.
pytestmark = pytest.mark.exclusive

MODEL = f"{ROOT / 'tests' / 'tiny_models.py'}:tiny_cnn"
CORES = sorted(os.sched_getaffinity(0))


def node(name: str, local: int, unit: str, **plan: object) -> dict[str, object]:
    return {"name": name, "node": {"resource": f"infermux-local-{local}"},
            "plan": {"models": [{"name": "cnn", "model": MODEL,
                                 "replicas": [{"unit": unit, "batch": 4}]}],
                     "dispatcher": {"cpu_workers": "thread"}, **plan}}


def two_nodes(seconds: float) -> dict[str, object]:
    return {"name": "two", "nodes": [node("a", 1, f"cpu:{CORES[0]}"),
                                      node("b", 2, f"cpu:{CORES[-1]}")],
            "load": {"scenario": "offline", "min_duration_s": seconds, "min_queries": 64}}


@pytest.fixture(scope="module")
def cluster():
    handle = open_cluster("local:3")
    yield handle
    handle.close()


def test_local_cluster_starts_with_its_nodes(cluster) -> None:
    nodes = cluster.nodes()
    assert len(nodes) == 3
    assert {f"infermux-local-{i}" for i in range(3)} <= {
        r for n in nodes for r in n["Resources"]}
    assert cluster.ray.is_initialized()


def test_run_across_two_nodes_stored_by_node(cluster, tmp_path) -> None:
    store = Store(tmp_path / "c.db")
    report = run_cluster(parse_cluster_plan(two_nodes(2.0)), cluster, store=store,
                         command="test")
    rec = report.record
    assert report.status == "complete", report.error
    assert rec.valid, rec.validity_notes
    assert rec.failed == 0 and rec.unfinished == 0 and rec.completed > 0
    rows = {n["node"]: n for n in rec.cluster.nodes}
    assert set(rows) == {"a", "b"}
    assert all(r["status"] == "ok" and r["completed_items"] > 0 for r in rows.values())
    # Every completed sample is credited to one node, and the nodes ran on distinct Ray nodes.
    assert sum(r["completed_items"] for r in rows.values()) == rec.completed_items
    assert rows["a"]["node_id"] != rows["b"]["node_id"]
    assert rows["a"]["cores"] != [] and rows["a"]["pid"] != rows["b"]["pid"]
    # Nodes get whole batches (pieces of half a batch made half batches), and the driver
    # makes fewer calls and takes fewer answers than the nodes run batches.
    sizes = [b.size for b in report.batches]
    assert sum(s == 4 for s in sizes) >= 0.9 * len(sizes), sorted(set(sizes))
    routing = rec.cluster.routing
    assert routing["node_calls"] < len(sizes) and routing["answers"] < len(sizes), routing
    # Workers are tagged by node, in the record and in the store.
    assert {w.split("/")[0] for w in rec.workers} == {"a", "b"}
    run = store.run(report.run_id)
    assert run["kind"] == "cluster" and run["status"] == "complete"
    db = store.connection
    stored = db.execute("SELECT node, status, completed_samples FROM cluster_nodes "
                        "WHERE run_id = ?", (report.run_id,)).fetchall()
    assert sorted(r[0] for r in stored) == ["a", "b"]
    workers = db.execute("SELECT worker FROM run_workers WHERE run_id = ?",
                         (report.run_id,)).fetchall()
    assert {w[0].split("/")[0] for w in workers} == {"a", "b"}
    batches = db.execute("SELECT count(*) FROM run_batches WHERE run_id = ?",
                         (report.run_id,)).fetchone()[0]
    assert batches > 0


def test_a_plan_naming_a_unit_the_node_lacks_is_one_clear_error(cluster) -> None:
    missing = max(CORES) + 8
    plan = parse_cluster_plan({"nodes": [node("a", 1, f"cpu:{CORES[0]}"),
                                         node("big", 2, f"cpu:{missing}")],
                               "load": {"min_duration_s": 1, "min_queries": 8}})
    with pytest.raises(UsageError) as exc:
        run_cluster(plan, cluster)
    msg = str(exc.value)
    assert "\n" not in msg
    assert "node big" in msg and f"cpu:{missing}" in msg and "models[0].replicas[0].unit" in msg
    gpu = parse_cluster_plan({"nodes": [node("g", 1, "cuda:0/fp16")],
                              "load": {"min_duration_s": 1, "min_queries": 8}})
    from infermux.units import discover

    if discover(with_runtimes=False).get("cuda:0/fp16") is None:
        with pytest.raises(UsageError, match=r"node g .*'cuda:0/fp16' is not a unit of that node"):
            run_cluster(gpu, cluster)


def test_find_peak_searches_the_cluster_s_highest_rate_within_the_bound(cluster,
                                                                      tmp_path) -> None:
    plan = parse_cluster_plan({**two_nodes(1.0), "load": {
        "scenario": "server", "find_peak": True, "p99_bound_ms": 250, "min_duration_s": 0.5,
        "min_queries": 32}})
    store = Store(tmp_path / "peak.db")
    report = run_cluster(plan, cluster, store=store, command="test")
    peak = report.peak
    assert peak is not None and peak["peak_qps"] is not None, peak
    # An offline trial gives the upper bound, then the server trials of the bisection, then
    # the offline trial again (the host's speed after the search).
    assert [t.scenario for t in report.trials] == (
        ["offline"] + ["server"] * len(peak["trials"]) + ["offline"])
    assert peak["offline_after_items_per_s"] == report.trials[-1].items_per_s
    assert 0 < peak["peak_qps"] < peak["offline_items_per_s"] == report.trials[0].items_per_s
    best = max((t for t in report.trials[1:-1] if t.valid), key=lambda t: t.rate_qps)
    assert report.record is best and best.rate_qps == peak["peak_qps"]
    assert best.latency.p99_ms <= 250
    # Each trial starts from empty nodes: its per-node counts are its own.
    for t in report.trials[1:-1]:  # server queries are of one sample
        assert sum(n["completed_items"] for n in t.cluster.nodes) == t.completed
    rows = store.connection.execute(
        "SELECT COUNT(DISTINCT trial) FROM cluster_nodes WHERE run_id = ?",
        (report.run_id,)).fetchone()[0]
    assert rows == len(report.trials)
    summary = store.run(report.run_id)["summary"]
    assert summary["peak"]["peak_qps"] == peak["peak_qps"]
    store.close()


def test_a_node_that_joins_mid_run_is_used_once_it_has_measured_itself(cluster) -> None:
    """`count: all` takes every node, those that join while the plan runs as well."""
    plan = parse_cluster_plan({
        "name": "grow", "nodes": [{**node("w", 0, f"cpu:{CORES[0]}"), "count": "all",
                                   "node": {}}],
        "route": {"join_check_s": 0.5},
        # A node's start takes 5-8 s here (its worker, imports, build and measurement; it
        # joined 7.2 s into the run on the quiet 2-core machine): the run lasts twice that.
        "load": {"scenario": "offline", "min_duration_s": 15.0, "min_queries": 64}})
    got: dict[str, object] = {}
    running = threading.Event()

    def during(sut) -> None:
        got["sut"] = sut
        running.set()

    # Ray starts a node's processes from the main thread only: the run goes on a thread.
    thread = threading.Thread(target=lambda: got.update(
        report=run_cluster(plan, cluster, during=during)), daemon=True)
    thread.start()
    assert running.wait(120)
    time.sleep(0.2)
    before = len(got["sut"].links)  # type: ignore[attr-defined]
    new_id = cluster.add_node()
    thread.join(120)
    assert not thread.is_alive()
    rec = got["report"].record  # type: ignore[attr-defined]
    assert before == len(cluster.nodes()) - 1
    rows = {n["node_id"]: n for n in rec.cluster.nodes}
    assert new_id in rows, (rec.cluster.cluster_events, list(rows))
    joined = rows[new_id]
    assert joined["joined_at_s"] is not None and joined["status"] == "ok"
    # It joined only once started and measured (its build's estimate seeds its rate) ...
    assert joined["rate_at_start"].get("cnn", 0) > 0
    events = [e for e in rec.cluster.cluster_events if e["event"] == "node_joined"]
    assert [e["node_id"] for e in events] == [new_id] and events[0]["start_s"] > 0
    # ... and then took its share of the load, with nothing lost.
    assert joined["completed_items"] > 0, rec.cluster.nodes
    assert rec.failed == 0 and rec.unfinished == 0
    assert all(n["joined_at_s"] is None for i, n in rows.items() if i != new_id)
    bin_s = rec.cluster.node_timeline["bin_s"]
    early = [r["items"] for r in rec.cluster.node_timeline["rows"]
             if r["node"] == joined["node"] and r["t_s"] + bin_s <= joined["joined_at_s"]]
    assert early and not any(early)  # nothing routed to it before it joined


def test_a_node_killed_mid_run_loses_no_query(cluster) -> None:
    plan = parse_cluster_plan(two_nodes(4.0))
    killed: dict[str, float] = {}

    def kill(sut) -> None:
        time.sleep(1.5)
        victim = next(ln for ln in sut.links if ln.name == "b")
        killed["at"] = time.perf_counter()
        cluster.kill_node(victim.node_id)

    started = time.perf_counter()
    report = run_cluster(plan, cluster, during=kill)
    rec = report.record
    assert "at" in killed
    assert time.perf_counter() - started < 60  # never hangs on the lost node
    # Every issued query completed: what the lost node held went to the other one.
    assert rec.failed == 0 and rec.unfinished == 0, rec.validity_notes
    assert rec.completed == rec.issued > 0
    rows = {n["node"]: n for n in rec.cluster.nodes}
    assert rows["b"]["status"] == "lost" and rows["b"]["lost_at_s"] is not None
    assert rows["a"]["status"] == "ok"
    lost = [e for e in rec.cluster.cluster_events if e["event"] == "node_lost"]
    assert len(lost) == 1 and lost[0]["node"] == "b"
    assert lost[0]["rerouted_items"] == lost[0]["held_items"]
    # The gap shows: after the loss only node a completes samples.
    lost_at = rows["b"]["lost_at_s"]
    bin_s = rec.cluster.node_timeline["bin_s"]
    late_b = [r["items"] for r in rec.cluster.node_timeline["rows"]
              if r["node"] == "b" and r["t_s"] > lost_at + bin_s]
    assert late_b and not any(late_b)
    assert threading.active_count() < 200
