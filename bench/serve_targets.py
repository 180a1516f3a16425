r"""The 2-core serving targets in one command: served/offline, and infermux against KServe.

Both figures of the CPU targets, side by side in one run of a few minutes:
1. `infermux run PLAN --scenario offline`: the plan's own figure (the runtime alone);
2. `infermux serve PLAN` and, with `--peer-python`, KServe's ModelServer
   (bench/serve_kserve_peer.py in its own venv, pinned to the plan's unit, the same engine
   session) are started together and take turns level by level (the order rotating each
   level), each driven by bench/serve_load.py over gRPC (and infermux over HTTP too), so the
   machine's slow seconds fall on both;
3. the ratios: the best served throughput over the offline figure (target ≥ 0.9), and
   infermux's best throughput within KServe's p99 at KServe's best throughput over gRPC
   against that best (target ≥ 1.5).

`--plan FILE` serves a plan of your own instead (a tuned one: `infermux tune --served grpc`);
`--peer-cores all` lets KServe use every core, as such a plan may.

`--loop asyncio,auto` serves the plan twice, on asyncio's loop and on uvloop, in turns too.
The plan is bench/serve_cpu.py's (mobilenet_v3_small, ONNX Runtime on `cpu:1` at batch 4, a
2 ms queue delay; the server's fronts on core 0). The load average before and after is in the
report: on a shared machine the figures move with it.

    python3 -m venv /tmp/kserve-venv && /tmp/kserve-venv/bin/pip install kserve torch==2.14.1 \
        torchvision==0.29.1 onnx onnxruntime typer rich pydantic pyyaml psutil
    .venv/bin/python bench/serve_targets.py --peer-python /tmp/kserve-venv/bin/python \
        --json /tmp/serve-targets.json

Without `--peer-python` only the served/offline ratio is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from serve_cpu import at_bound, load_client, offline, start_server, write_plan  # noqa: E402
from serve_kserve_workers import start_peer, stop  # noqa: E402


def given_plan(path: Path, out: Path) -> Path:
    """A copy of a plan file for the run: its one model named `mobilenet`, as the clients ask.

    Its load becomes the offline figure's (the served levels are the clients').
    """
    import yaml

    plan = yaml.safe_load(path.read_text())
    plan["models"][0]["name"] = "mobilenet"
    plan["load"] = {"scenario": "offline", "min_duration_s": 8.0, "min_queries": 256}
    copy = out / "plan.yaml"
    copy.write_text(json.dumps(plan, indent=2))
    return copy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="where to write the report")
    p.add_argument("--peer-python", help="python of a venv with kserve: measure the peer too")
    p.add_argument("--model", default="mobilenet_v3_small")
    p.add_argument("--unit", default="cpu:1")
    p.add_argument("--engine", default="onnxruntime")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--queue-delay-ms", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=8.0, help="offline run's minimum seconds")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per level")
    p.add_argument("--front", default="own",
                   help="infermux's front: own, triton, or own,triton (each served, in turns)")
    p.add_argument("--triton-python-path", help="--front triton: a numpy<2 install")
    p.add_argument("--loop", default="auto",
                   help="serve's --loop: auto, asyncio, or a list (each served, in turns)")
    p.add_argument("--plan", type=Path,
                   help="serve this plan (e.g. one `infermux tune --served` wrote) instead of "
                        "the one-replica plan above; its model is served as `mobilenet`")
    p.add_argument("--peer-cores", choices=("unit", "all"), default="unit",
                   help="KServe pinned to --unit's cores, or free on all of them (with --unit "
                        "cpu: its session on every core, as a plan of both cores)")
    args = p.parse_args()
    started = time.monotonic()
    out = Path(tempfile.mkdtemp(prefix="serve-targets-"))
    plan = write_plan(out, args) if args.plan is None else given_plan(args.plan, out)
    levels = [int(c) for c in args.concurrency.split(",")]
    report: dict[str, Any] = {"plan": json.loads(plan.read_text()), "machine": os.uname().nodename,
                              "cpus": os.cpu_count(), "load_average_before": os.getloadavg()}
    print(f"load average {report['load_average_before']}; offline (infermux run) ...",
          flush=True)
    report["offline"] = offline(plan)
    print(f"  {report['offline']['items_per_s']:.1f} items/s", flush=True)
    servers: dict[str, tuple[Any, dict[str, int]]] = {}
    try:
        for front in args.front.split(","):
            for loop in args.loop.split(","):
                extra = ["--front", front, "--loop", loop]
                if front == "triton" and args.triton_python_path:
                    extra += ["--triton-python-path", args.triton_python_path]
                proc, ready = start_server(plan, out, extra)
                name = "-".join(["infermux", *([front] if front != "own" else []),
                                 *([loop] if loop != "auto" else [])])
                servers[name] = (proc, {pr: ready[f"{pr}_port"] for pr in ("http", "grpc")})
        if args.peer_python:
            peer, ports = start_peer(args.peer_python, args, out, 1, args.peer_cores)
            servers["kserve"] = (peer, {"http": ports[0], "grpc": ports[1]})
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
        for k, c in enumerate(levels):
            turns = [(name, "grpc") for name in servers] + [
                (name, "http") for name in servers if name.startswith("infermux")]
            turns = turns[k % len(turns):] + turns[:k % len(turns)]
            for name, protocol in turns:
                row = load_client(f"127.0.0.1:{servers[name][1][protocol]}", protocol, c,
                                  args.seconds)
                rows[name].append({"protocol": protocol, "concurrency": c, **row})
                print(f"  {name} {protocol} c{c}: {row['throughput']:.1f}/s, p99 "
                      f"{row['p99_ms']:.1f} ms", flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    report["served"] = rows
    offline_rate = report["offline"]["items_per_s"]
    ratios: dict[str, Any] = {}
    ours = [name for name in servers if name.startswith("infermux")]
    for name in ours:
        tag = "" if name == "infermux" else f"_{name.split('-', 1)[1]}"
        for protocol in ("grpc", "http"):
            best = max((r for r in rows[name] if r["protocol"] == protocol),
                       key=lambda r: r["throughput"])
            ratios[f"served_over_offline_{protocol}{tag}"] = best["throughput"] / offline_rate
            print(f"{name} served/offline {protocol}: {best['throughput']:.1f} / "
                  f"{offline_rate:.1f} = {best['throughput'] / offline_rate:.2f} "
                  f"(c{best['concurrency']}, p99 {best['p99_ms']:.1f} ms; target >= 0.9)",
                  flush=True)
    if "kserve" in rows:
        peak = max(rows["kserve"], key=lambda r: r["throughput"])
        report["kserve_best"] = peak
        for name in ours:
            tag = "" if name == "infermux" else f"_{name.split('-', 1)[1]}"
            held = at_bound([r for r in rows[name] if r["protocol"] == "grpc"],
                            peak["p99_ms"])
            ratio = held["throughput"] / peak["throughput"] if held else None
            ratios[f"versus_kserve_grpc{tag}"] = ratio
            report[f"infermux_at_kserve_p99{tag}"] = held
            print(f"KServe gRPC best {peak['throughput']:.1f}/s at p99 {peak['p99_ms']:.1f} ms "
                  f"(c{peak['concurrency']}); {name} within that p99: "
                  f"{held['throughput'] if held else 0:.1f}/s = "
                  f"{ratio if ratio is not None else 0:.2f}x (target >= 1.5)", flush=True)
    else:
        print("KServe not measured: pass --peer-python (a venv with kserve)", flush=True)
    report["ratios"] = ratios
    report["load_average_after"] = os.getloadavg()
    report["wall_s"] = time.monotonic() - started
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"load average after {report['load_average_after']}; {report['wall_s']:.0f} s; "
          f"report in {args.json}", flush=True)


if __name__ == "__main__":
    main()
