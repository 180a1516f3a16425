r"""`infermux serve` against KServe's ModelServer at KServe's own best settings, one client.

KServe's advice for CPU-bound models is several REST worker processes (`--workers`); its gRPC
server stays one process with a thread pool. This runs, on the same plan entry and engine
session (bench/serve_kserve_peer.py, in a venv of its own):
- `infermux serve` (worker pinned to cpu:1, fronts on core 0);
- KServe pinned to the unit's core (how bench/serve_cpu.py runs it), 1 worker;
- KServe on every core, 1 worker; and on every core with 2 workers (one per core);
each driven by bench/serve_load.py over HTTP (binary) and gRPC at the same concurrencies.
Per peer setting: its best throughput and the p99 there, and the best infermux throughput
whose p99 is no higher (same client, same protocol), with the ratio.

    python3 -m venv /tmp/kserve-venv && /tmp/kserve-venv/bin/pip install kserve torch==2.14.1 \
        torchvision==0.29.1 onnx onnxruntime typer rich pydantic pyyaml psutil
    .venv/bin/python bench/serve_kserve_workers.py --peer-python /tmp/kserve-venv/bin/python \
        --out /tmp/skw
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from serve_cpu import at_bound, load_client, start_server, write_plan  # noqa: E402

#: name → (--workers, --cores)
PEERS = {"KServe 1 worker, pinned to cpu:1": (1, "unit"),
         "KServe 1 worker, all cores": (1, "all"),
         "KServe 2 workers, all cores": (2, "all")}


def free_ports(n: int) -> list[int]:
    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


def start_peer(python: str, args: argparse.Namespace, out: Path, workers: int,
               cores: str) -> tuple[subprocess.Popen[str], list[int]]:
    http, grpc = free_ports(2)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    log = (out / f"peer-w{workers}-{cores}.log").open("w")
    proc = subprocess.Popen([python, str(ROOT / "bench" / "serve_kserve_peer.py"), "--unit",
                             args.unit, "--engine", args.engine, "--batch", str(args.batch),
                             "--model", args.model, "--http-port", str(http), "--grpc-port",
                             str(grpc), "--workers", str(workers), "--cores", cores],
                            stdout=log, stderr=log, text=True, env=env)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready",
                                        timeout=2) as r:
                if r.status == 200:
                    return proc, [http, grpc]
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"the KServe peer did not start; see {log.name}")


def sweep(ports: dict[str, int], levels: list[int], seconds: float,
          label: str) -> list[dict[str, Any]]:
    rows = []
    for protocol, port in ports.items():
        for c in levels:
            # serve_load warms up first (2 s): a spawned worker builds its session then.
            row = load_client(f"127.0.0.1:{port}", protocol, c, seconds)
            rows.append({"protocol": protocol, "concurrency": c, **row})
            print(f"  {label} {protocol} c{c}: {row['throughput']:.1f}/s, p99 "
                  f"{row['p99_ms']:.1f} ms", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="serve-kserve-workers-results")
    p.add_argument("--peer-python", required=True, help="python of a venv with kserve")
    p.add_argument("--model", default="mobilenet_v3_small")
    p.add_argument("--unit", default="cpu:1")
    p.add_argument("--engine", default="onnxruntime")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--queue-delay-ms", type=float, default=2.0)
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--peers", default=",".join(str(i) for i in range(len(PEERS))),
                   help="which peer settings to run, by index: " + "; ".join(
                       f"{i}: {n}" for i, n in enumerate(PEERS)))
    args = p.parse_args()
    peers = {n: v for i, (n, v) in enumerate(PEERS.items())
             if str(i) in args.peers.split(",")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.duration = 10.0  # the plan's offline duration (not run here)
    plan = write_plan(out, args)
    levels = [int(c) for c in args.concurrency.split(",")]
    report: dict[str, Any] = {"plan": json.loads(plan.read_text()),
                              "machine": os.uname().nodename, "runs": {}}
    proc, ready = start_server(plan, out)
    try:
        report["runs"]["infermux serve"] = sweep(
            {"http": ready["http_port"], "grpc": ready["grpc_port"]}, levels, args.seconds,
            "infermux")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    for name, (workers, cores) in peers.items():
        peer, ports = start_peer(args.peer_python, args, out, workers, cores)
        try:
            report["runs"][name] = sweep({"http": ports[0], "grpc": ports[1]}, levels,
                                         args.seconds, name)
        finally:
            peer.send_signal(signal.SIGTERM)
            try:
                peer.wait(60)
            except subprocess.TimeoutExpired:
                peer.kill()
    ours = report["runs"]["infermux serve"]
    report["versus"] = {}
    for name in peers:
        for protocol in ("http", "grpc"):
            theirs = [r for r in report["runs"][name] if r["protocol"] == protocol]
            best = max(theirs, key=lambda r: r["throughput"])
            held = at_bound([r for r in ours if r["protocol"] == protocol], best["p99_ms"])
            ratio = held["throughput"] / best["throughput"] if held else None
            report["versus"][f"{name} / {protocol}"] = {"peer_best": best, "infermux": held,
                                                        "ratio": ratio}
            print(f"{name} {protocol}: best {best['throughput']:.1f}/s at p99 "
                  f"{best['p99_ms']:.1f} ms (c{best['concurrency']}); infermux at that p99: "
                  f"{held['throughput'] if held else 0:.1f}/s"
                  + (f" ({ratio:.2f}x)" if ratio else ""), flush=True)
    report["load_average_after"] = os.getloadavg()
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"report in {out / 'report.json'}")


if __name__ == "__main__":
    main()
