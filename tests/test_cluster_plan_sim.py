"""The cluster plan's checks and the cluster simulation (no Ray needed)."""

from __future__ import annotations

import numpy as np
import pytest

from infermux.cluster.connect import parse_address
from infermux.cluster.plan import parse_cluster_plan
from infermux.cluster.sim import DriverCost, NodeKind, kinds_from_records, simulate
from infermux.errors import UsageError

LOCAL = {"models": [{"name": "cnn", "model": "mobilenet_v3_small",
                     "replicas": [{"unit": "cpu:0", "batch": 8}]}]}


def test_cluster_plan_takes_the_cluster_load_and_checks_local_plans() -> None:
    plan = parse_cluster_plan({"nodes": [{"name": "a", "node": {"resource": "x"}, "plan": LOCAL}],
                               "load": {"scenario": "server", "rate_qps": 50}})
    local = plan.local_plan(plan.nodes[0])
    assert local is not None and local.load.scenario == "server" and local.load.rate_qps == 50
    bad = {"nodes": [{"name": "a", "plan": {**LOCAL, "models": [
        {"name": "cnn", "model": "m", "replicas": [{"unit": "gpu0"}]}]}}]}
    with pytest.raises(UsageError, match=r"nodes\[0\]\.plan: field models\[0\]\.replicas\[0\]\.unit"):
        parse_cluster_plan(bad)


@pytest.mark.parametrize(("data", "needle"), [
    ({"nodes": [{"name": "a"}]}, "exactly one of plan"),
    ({"nodes": [{"name": "a", "plan": LOCAL, "tune": "auto"}]}, "exactly one of plan"),
    ({"nodes": [{"name": "a", "tune": "auto"}]}, "tunes the cluster's models"),
    ({"nodes": [{"name": "a", "plan": LOCAL}, {"name": "a", "plan": LOCAL}]}, "appear twice"),
    ({"nodes": [{"name": "a", "plan": LOCAL, "count": 0}]}, "at least 1"),
    ({"nodes": [{"name": "a", "plan": LOCAL, "where": 1}]}, "nodes[0].where is not"),
    (LOCAL, "this is a local plan"),
])
def test_bad_cluster_plans_get_one_line(data: dict, needle: str) -> None:
    with pytest.raises(UsageError) as exc:
        parse_cluster_plan(data)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def _ray_node(i: int, *resources: str) -> dict:
    return {"NodeID": f"{i:02d}" * 14, "NodeManagerAddress": "10.0.0.1", "Alive": True,
            "Resources": {"CPU": 1.0, **dict.fromkeys(resources, 1.0)}}


def test_nodes_are_claimed_in_order_and_count_all_may_wait_for_nodes_to_join() -> None:
    from infermux.cluster.nodes import resolve_nodes

    nodes = [_ray_node(0, "box-a"), _ray_node(1, "box-b"), _ray_node(2, "box-b")]
    plan = parse_cluster_plan({"nodes": [
        {"name": "a", "node": {"resource": "box-a"}, "plan": LOCAL},
        {"name": "b", "node": {"resource": "box-b"}, "count": "all", "plan": LOCAL},
        {"name": "gpu", "node": {"resource": "gpu-box"}, "count": "all", "plan": LOCAL}]})
    claims = resolve_nodes(plan, nodes)
    # `b` takes every box-b node; `gpu` matches none yet: nodes that join are taken then.
    assert [(e.name, name, n["NodeID"][:2]) for e, name, n in claims] == [
        ("a", "a", "00"), ("b", "b-0", "01"), ("b", "b-1", "02")]
    # A plan whose every entry waits on nodes that are not there is an error, as is a fixed
    # count that the cluster cannot meet.
    alone = parse_cluster_plan({"nodes": [{"name": "gpu", "node": {"resource": "gpu-box"},
                                           "count": "all", "plan": LOCAL}]})
    with pytest.raises(UsageError, match=r"nodes\[0\] \(gpu\).*0 free"):
        resolve_nodes(alone, nodes)
    two = parse_cluster_plan({"nodes": [{"name": "a", "node": {"resource": "box-a"},
                                         "count": 2, "plan": LOCAL}]})
    with pytest.raises(UsageError, match=r"2 node\(s\) matching resource=box-a wanted, 1 free"):
        resolve_nodes(two, nodes)


def test_cluster_addresses() -> None:
    assert parse_address("local:3") == ("local", 3)
    assert parse_address("ray://10.0.0.1:10001") == ("ray", 0)
    assert parse_address("auto") == ("ray", 0)
    for bad in ("local:0", "local:99", "http://x", "somewhere"):
        with pytest.raises(UsageError, match="--cluster"):
            parse_address(bad)


def _kind(name: str = "k", workers: int = 1, mean_s: float = 0.02) -> NodeKind:
    rng = np.random.default_rng(1)
    return NodeKind(name, workers, 8, {8: rng.normal(mean_s, mean_s / 10, 300).clip(mean_s / 2),
                                       1: rng.normal(mean_s / 4, mean_s / 40, 100)})


def test_simulation_matches_capacity_when_the_driver_is_free() -> None:
    kind = _kind()
    one = simulate([kind], [1], duration_s=4, driver=DriverCost(0, 0, 0))
    assert one.items_per_s == pytest.approx(8 / 0.02, rel=0.05)
    mixed = simulate([kind, kind.scaled("four", workers=4)], [5, 5], duration_s=4,
                     driver=DriverCost(0, 0, 0))
    assert mixed.items_per_s == pytest.approx(25 * 8 / 0.02, rel=0.05)
    assert mixed.per_kind["four"] > 3 * mixed.per_kind["k"]
    # Deterministic for a seed.
    again = simulate([kind], [1], duration_s=4, driver=DriverCost(0, 0, 0))
    assert again.completed_items == one.completed_items


def test_simulation_shows_the_driver_saturating_and_latency_growing_with_load() -> None:
    kind = _kind()
    cost = DriverCost(route_s=100e-6, answer_s=100e-6, return_s=0.5e-3)
    small = simulate([kind], [10], duration_s=2, driver=cost)
    big = simulate([kind], [400], duration_s=1, driver=cost)
    assert small.driver_utilisation < 0.8
    assert big.driver_utilisation > 0.95
    assert big.items_per_s < 400 * 400 * 0.5  # the driver, not the nodes, limits
    low = simulate([kind], [2], scenario="server", rate_qps=200, duration_s=5, driver=cost)
    high = simulate([kind], [2], scenario="server", rate_qps=700, duration_s=5, driver=cost)
    assert low.p99_ms is not None and high.p99_ms is not None and high.p99_ms > low.p99_ms
    assert low.items_per_s == pytest.approx(200, rel=0.15)


def test_kinds_from_batch_records() -> None:
    recs = [{"worker": "a/w", "bucket": 8, "start_ns": 0, "end_ns": 20_000_000}] * 5 + [
        {"worker": "b/w", "bucket": 4, "start_ns": 0, "end_ns": 5_000_000}]
    kinds = kinds_from_records(recs)
    assert kinds["a/w"].batch == 8 and kinds["a/w"].rate() == pytest.approx(400)
    assert kinds["b/w"].draw_mean(4) == pytest.approx(0.005)
