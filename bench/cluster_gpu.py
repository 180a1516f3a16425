"""Two GPUs as two Ray nodes against one infermux runtime over both, alternated.

The cluster is started as a real one is, with `ray start`: a head node that sees GPU 0 and a
worker node that sees GPU 1 (`CUDA_VISIBLE_DEVICES` per raylet, `--num-gpus 1` each), each with
a resource naming it. Node i runs the one-GPU plan (ResNet50 fp16, two instances at batch 64)
on its GPU; the one runtime runs the two-GPU plan (the same replica on each GPU). Each pair is
a single-runtime run and a cluster run, offline, with the cluster up in both.

    python3 bench/cluster_gpu.py --pairs 2 --duration 10 --out cluster-gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
PLANS = Path(__file__).parent / "plans"


def ray_cli(*args: str, gpu: str, extra_env: dict[str, str] | None = None) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, **(extra_env or {})}
    exe = shutil.which("ray")
    cmd = [exe] if exe else [sys.executable, "-c",
                             "import sys; from ray.scripts.scripts import main; "
                             "sys.argv[0] = 'ray'; main()"]
    subprocess.run([*cmd, *args], env=env, check=True, stdout=subprocess.DEVNULL)


def start_cluster(port: int, cpus: int) -> str:
    ray_cli("start", "--head", f"--port={port}", "--num-gpus=1", f"--num-cpus={cpus}",
            "--include-dashboard=false", '--resources={"infermux-gpu-node-0": 1}', gpu="0")
    ray_cli("start", f"--address=127.0.0.1:{port}", "--num-gpus=1", f"--num-cpus={cpus}",
            '--resources={"infermux-gpu-node-1": 1}', gpu="1")
    return f"127.0.0.1:{port}"


def stop_cluster() -> None:
    ray_cli("stop", "--force", gpu="")


def load(duration: float) -> dict[str, Any]:
    return {"scenario": "offline", "min_duration_s": duration, "min_queries": 4096}


def single(duration: float) -> dict[str, Any]:
    import yaml

    from infermux.runtime import parse_plan, run_plan

    spec = yaml.safe_load((PLANS / "resnet50_2gpu.yaml").read_text())
    report = run_plan(parse_plan({**spec, "load": load(duration)}))
    rec = report.final
    if rec is None:
        return {"throughput": None, "completed": None, "failed": None, "workers": {}}
    return {"throughput": rec.items_per_s, "completed": rec.completed, "failed": rec.failed,
            "workers": {w: r.items_per_s for w, r in rec.workers.items()}}


def cluster_plan(duration: float) -> Any:
    import yaml

    from infermux.cluster import parse_cluster_plan

    one = yaml.safe_load((PLANS / "resnet50_1gpu.yaml").read_text())
    one.pop("load", None)
    return parse_cluster_plan({"name": "two-gpu-nodes", "nodes": [
        {"name": f"g{i}", "node": {"resource": f"infermux-gpu-node-{i}"}, "plan": one}
        for i in range(2)], "load": load(duration)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--port", type=int, default=6390)
    ap.add_argument("--cpus-per-node", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--out", default=None, help="also write every figure to this JSON file")
    args = ap.parse_args()
    import torch

    out: dict[str, Any] = {"machine": platform.processor() or platform.machine(),
                           "gpus": [torch.cuda.get_device_name(i)
                                    for i in range(torch.cuda.device_count())],
                           "args": vars(args)}
    from cluster_cpu import finish_pairs
    from infermux.cluster import open_cluster, run_cluster

    t0 = time.perf_counter()
    address = start_cluster(args.port, args.cpus_per_node)
    rows = []
    try:
        with open_cluster(address) as handle:
            out["cluster_start_s"] = time.perf_counter() - t0
            out["nodes"] = [{"id": n["NodeID"][:8], "resources": n.get("Resources")}
                            for n in handle.nodes()]
            print(json.dumps(out["nodes"]), flush=True)
            for i in range(args.pairs):
                one = single(args.duration)
                rep = run_cluster(cluster_plan(args.duration), handle)
                rec = rep.record
                if rec is None or rec.cluster is None:
                    raise SystemExit(f"the cluster run gave no trial: {rep.error}")
                rows.append({
                    "pair": i, "single": one["throughput"], "single_workers": one["workers"],
                    "cluster": rec.items_per_s,
                    "ratio": (rec.items_per_s or 0.0) / one["throughput"],
                    "cluster_failed": rec.failed, "cluster_unfinished": rec.unfinished,
                    "cluster_valid": rec.valid, "cluster_notes": rec.validity_notes,
                    "cluster_nodes": [{k: n.get(k) for k in ("node", "status", "items_per_s",
                                                             "share", "rate_at_start")}
                                      for n in rec.cluster.nodes],
                    "routing": rec.cluster.routing, "cluster_build_s": rep.start_s})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stop_cluster()
    finish_pairs(out, rows, args.out)


if __name__ == "__main__":
    main()
