"""Two Ray nodes on localhost against one runtime on the same cores; a lost node; the simulation.

The simulation's prediction is checked against the real runs, then drawn to 1,000 nodes.

1. One infermux runtime with two replicas, `cpu:0` and `cpu:1` (a pinned worker process each):
   offline throughput, before the cluster starts and after it stops.
2. A local Ray cluster of two nodes (one logical CPU each), node a running a plan on `cpu:0`,
   node b the same on `cpu:1`: offline throughput (twice), the ratio to the single runtime.
3. The same with node b stopped mid-run (its raylet and processes killed): every query must
   complete, none fail, none go missing.
4. Server runs on the cluster at two rates, for the latency prediction.
5. The simulation, with each worker's batch service times from run 1's batch records and the
   driver's costs measured in run 2, predicts runs 2 and 4; then 10–1,000 nodes of two kinds
   (one measured worker per node, or four of them: a larger box of the same cores).

    PYTHONPATH=src python bench/cluster_cpu.py --model mobilenet_v3_small --batch 8 --duration 10
    PYTHONPATH=src python bench/cluster_cpu.py --pairs 4 --duration 10   # the ratio alone, ABAB
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import numpy as np

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


def local_plan(model: str, batch: int, units: list[str]) -> dict[str, Any]:
    return {"name": "cpu", "models": [{"name": "cnn", "model": model, "replicas": [
        {"unit": u, "batch": batch} for u in units]}],
        "dispatcher": {"cpu_workers": "process"}}


def load(duration: float, **more: Any) -> dict[str, Any]:
    return {"scenario": "offline", "min_duration_s": duration, "min_queries": 256, **more}


def single(model: str, batch: int, cores: list[int], duration: float) -> dict[str, Any]:
    from infermux.runtime import parse_plan, run_plan

    plan = parse_plan({**local_plan(model, batch, [f"cpu:{c}" for c in cores]),
                       "load": load(duration)})
    report = run_plan(plan)
    rec = report.final
    if rec is None:
        raise SystemExit(f"the single runtime ran no trial: {report.error}")
    return {"throughput": rec.items_per_s, "completed": rec.completed, "failed": rec.failed,
            "unfinished": rec.unfinished,
            "workers": {w: r.items_per_s for w, r in rec.workers.items()},
            "batch_latency": {w: r.batch_latency.to_dict() if r.batch_latency else {}
                              for w, r in rec.workers.items()}}


def cluster_plan(model: str, batch: int, cores: list[int], lo: dict[str, Any]) -> Any:
    from infermux.cluster import parse_cluster_plan

    return parse_cluster_plan({"name": "two-nodes", "nodes": [
        {"name": f"n{i}", "node": {"resource": f"infermux-local-{i}"},
         "plan": local_plan(model, batch, [f"cpu:{c}"])} for i, c in enumerate(cores)],
        "load": lo})


def _cluster_part(rep: Any) -> Any:
    """The cluster's part of a cluster run's trial (its nodes, routing, events)."""
    if rep.record is None or rep.record.cluster is None:
        raise SystemExit(f"the cluster run gave no trial: {rep.error}")
    return rep.record.cluster


def summary(rep: Any) -> dict[str, Any]:
    r, cluster = rep.record, _cluster_part(rep)
    return {"throughput": r.items_per_s, "issued": r.issued,
            "completed": r.completed, "failed": r.failed, "unfinished": r.unfinished,
            "valid": r.valid, "notes": r.validity_notes,
            "latency": r.latency.to_dict() if r.latency else {},
            "routing": cluster.routing, "start_s": rep.start_s,
            "nodes": [{k: n.get(k) for k in ("node", "status", "completed_items", "share",
                                              "lost_at_s", "rerouted_items", "failed_items")}
                      for n in cluster.nodes],
            "events": cluster.cluster_events}


def pairs(args: argparse.Namespace, cores: list[int], out: dict[str, Any]) -> None:
    """Single runtime and cluster alternated; the ratio of each pair and their median."""
    from infermux.cluster import open_cluster, run_cluster

    rows = []
    with open_cluster("local:2") as handle:
        for i in range(args.pairs):
            one = single(args.model, args.batch, cores, args.duration)["throughput"]
            rep = run_cluster(cluster_plan(args.model, args.batch, cores, load(args.duration)),
                              handle)
            two = rep.record.items_per_s if rep.record else None
            routing = _cluster_part(rep).routing
            batches = max(1, len(rep.batches))
            rows.append({"pair": i, "single": one, "cluster": two, "ratio": two / one,
                         # What the driver spent per batch run, and how full the batches were.
                         "calls_per_batch": routing["node_calls"] / batches,
                         "answers_per_batch": routing["answers"] / batches,
                         "full_batches": sum(b.size == args.batch for b in rep.batches)
                         / batches})
            print(json.dumps(rows[-1]), flush=True)
    finish_pairs(out, rows, args.out)


def finish_pairs(out: dict[str, Any], rows: list[dict[str, Any]], path: str | None) -> None:
    """The pairs' median ratio, printed, and every figure written to `path`."""
    out["pairs"] = rows
    out["median_ratio"] = float(np.median([r["ratio"] for r in rows]))
    print(json.dumps({"median_ratio": out["median_ratio"]}), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v3_small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--out", default=None, help="also write every figure to this JSON file")
    ap.add_argument("--pairs", type=int, default=0,
                    help="only the ratio: this many single-runtime and cluster runs, alternated "
                         "with the cluster up (a loaded machine drifts between distant runs)")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))[:2]
    out: dict[str, Any] = {"machine": platform.processor() or platform.machine(),
                           "cores": len(os.sched_getaffinity(0)), "args": vars(args)}
    if args.pairs:
        pairs(args, cores, out)
        return

    print("single runtime (before the cluster)", flush=True)
    out["single_before"] = single(args.model, args.batch, cores, args.duration)
    print(json.dumps(out["single_before"]["throughput"]), flush=True)

    from infermux.cluster import open_cluster, run_cluster
    from infermux.cluster.sim import DriverCost, kinds_from_records, simulate

    records: list[Any] = []  # the calibration runs' batch records (the simulation's input)
    delays: dict[str, list[int]] = {}  # and the delays measured in the calibration server run
    own: dict[str, Any] = {}  # every run's own batch records and delays (in-situ predictions)
    with open_cluster("local:2") as handle:
        out["cluster_start_s"] = handle.started_s
        runs = []
        for i in range(2):
            print(f"cluster offline {i}", flush=True)
            rep = run_cluster(cluster_plan(args.model, args.batch, cores, load(args.duration)),
                              handle)
            runs.append(summary(rep))
            own[f"offline {i}"] = (rep.batches, rep.delays_ns, _cluster_part(rep).routing)
            if i == 0:
                records += rep.batches
            print(json.dumps(runs[-1]["throughput"]), flush=True)
        out["cluster"] = runs
        capacity = runs[0]["throughput"]
        out["server"] = []
        for frac in (0.3, 0.5, 0.7):
            rate = round(capacity * frac)
            print(f"cluster server {rate} qps", flush=True)
            rep = run_cluster(cluster_plan(args.model, args.batch, cores, load(
                args.duration, scenario="server", rate_qps=rate, min_queries=64)), handle)
            out["server"].append({"rate_qps": rate, **summary(rep)})
            own[f"server {rate}"] = (rep.batches, rep.delays_ns, _cluster_part(rep).routing)
            if frac == 0.3:
                records += rep.batches
                delays = rep.delays_ns
                out["calibration_routing"] = _cluster_part(rep).routing

        def kill(sut: Any) -> None:
            time.sleep(args.duration * 0.4)
            victim = sut.links[1]
            handle.kill_node(victim.node_id)

        print("cluster offline, node n1 killed mid-run", flush=True)
        rep = run_cluster(cluster_plan(args.model, args.batch, cores, load(args.duration)),
                          handle, during=kill)
        out["killed"] = summary(rep)
        out["killed"]["node_timeline"] = _cluster_part(rep).node_timeline
    print("single runtime (after the cluster)", flush=True)
    out["single_after"] = single(args.model, args.batch, cores, args.duration)
    single_tp = (out["single_before"]["throughput"] + out["single_after"]["throughput"]) / 2
    cluster_tp = sum(r["throughput"] for r in out["cluster"]) / len(out["cluster"])
    out["ratio_cluster_over_single"] = cluster_tp / single_tp

    # The simulation: each node's batch service times from the calibration runs (offline run
    # 0 and the lowest server rate); the driver's costs from offline run 1. It then predicts
    # the runs it was not fitted on.
    kinds = kinds_from_records(records)
    out["kinds"] = {k: {"buckets": {b: [float(v.mean() * 1e3), len(v)]
                                    for b, v in kind.service_s.items()}}
                    for k, kind in kinds.items()}
    cost = DriverCost.measured(out["calibration_routing"], delays)
    out["driver_cost"] = {k: (v if not isinstance(v, list) else {
        "n": len(v), "p50_ms": 1e3 * float(np.median(v)), "p99_ms": 1e3 * float(np.percentile(v, 99))})
        for k, v in vars(cost).items()}
    ks = list(kinds.values())
    pred = simulate(ks, [1] * len(ks), duration_s=args.duration, driver=cost)
    out["validation"] = [{"run": "2 nodes offline, run 1 (samples/s)",
                          "measured": out["cluster"][1]["throughput"],
                          "predicted": pred.items_per_s}]
    for s in out["server"][1:]:
        p = simulate(ks, [1] * len(ks), scenario="server", rate_qps=s["rate_qps"],
                     duration_s=args.duration, driver=cost)
        for q in ("p50", "p99"):
            out["validation"].append({"run": f"2 nodes server {s['rate_qps']} qps {q} ms",
                                      "measured": s["latency"].get(f"{q}_ms"),
                                      "predicted": getattr(p, f"{q}_ms")})
    # In situ: each run predicted from its own nodes' service times and delays, which checks
    # the policy model alone (not whether the machine stayed as fast between runs).
    for name, (batches, dl, routing) in own.items():
        own_cost = DriverCost.measured(routing, dl)
        own_kinds = list(kinds_from_records(batches).values())
        if name.startswith("offline"):
            got = simulate(own_kinds, [1] * len(own_kinds), duration_s=args.duration,
                           driver=own_cost)
            run = out["cluster"][int(name.split()[1])]
            out["validation"].append({"run": f"in situ: 2 nodes {name} (samples/s)",
                                      "measured": run["throughput"],
                                      "predicted": got.items_per_s})
        else:
            rate = int(name.split()[1])
            got = simulate(own_kinds, [1] * len(own_kinds), scenario="server", rate_qps=rate,
                           duration_s=args.duration, driver=own_cost)
            run = next(r for r in out["server"] if r["rate_qps"] == rate)
            for q in ("p50", "p99"):
                out["validation"].append({"run": f"in situ: 2 nodes {name} qps {q} ms",
                                          "measured": run["latency"].get(f"{q}_ms"),
                                          "predicted": getattr(got, f"{q}_ms")})
    one = ks[0]
    big = one.scaled("4-core box", workers=4)
    curve = []
    for n in (2, 10, 30, 100, 300, 1000):
        off = simulate([one, big], [n - n // 2, n // 2], duration_s=2.0 if n >= 100 else 5.0,
                       driver=cost)
        cap = sum(k.rate() * c for k, c in ((one, n - n // 2), (big, n // 2)))
        srv = simulate([one, big], [n - n // 2, n // 2], scenario="server",
                       rate_qps=0.5 * off.items_per_s,
                       duration_s=2.0 if n >= 100 else 5.0, driver=cost)
        curve.append({"nodes": n, "offline": off.items_per_s,
                      "sum_of_nodes": cap, "driver_util": off.driver_utilisation,
                      "server_rate": 0.5 * off.items_per_s,
                      "server_p99_ms": srv.p99_ms})
        print(curve[-1], flush=True)
    free = DriverCost(0.0, 0.0, cost.return_s)
    for row in curve:
        n = row["nodes"]
        row["offline_free_driver"] = simulate(
            [one, big], [n - n // 2, n // 2], duration_s=1.0 if n >= 100 else 3.0,
            driver=free).items_per_s
    out["curve"] = curve
    out["calibration_batches"] = [vars(b) for b in records]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(json.dumps({k: out[k] for k in ("ratio_cluster_over_single", "validation", "killed")},
                     indent=1, default=str))


if __name__ == "__main__":
    main()
