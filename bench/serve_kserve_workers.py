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

With `--rounds N` every server runs at once and they take turns, level by level, round after
round (each level's figure the median of its rounds), so the machine's drift falls on all of
them; `--queue-delay-ms 0.5,2` serves one infermux plan per queue delay beside the peers:

    .venv/bin/python bench/serve_kserve_workers.py --peer-python /tmp/kserve-venv/bin/python \
        --out /tmp/skw-r3 --seconds 6 --rounds 3 --concurrency 1,2,4,8,16 --protocols grpc \
        --queue-delay-ms 0.5,2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
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


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (protocol, concurrency): the medians of its rounds.

    Throughput and p99 are separate medians (the server's level, not one round's pair).
    """
    keys = sorted({(r["protocol"], r["concurrency"]) for r in rows})
    out = []
    for protocol, c in keys:
        mine = [r for r in rows if r["protocol"] == protocol and r["concurrency"] == c]
        out.append({"protocol": protocol, "concurrency": c, "rounds": len(mine),
                    "throughput": statistics.median(r["throughput"] for r in mine),
                    "p99_ms": statistics.median(r["p99_ms"] for r in mine),
                    "each": [(round(r["throughput"], 1), round(r["p99_ms"], 2)) for r in mine]})
    return out


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="serve-kserve-workers-results")
    p.add_argument("--peer-python", required=True, help="python of a venv with kserve")
    p.add_argument("--model", default="mobilenet_v3_small")
    p.add_argument("--unit", default="cpu:1")
    p.add_argument("--engine", default="onnxruntime")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--queue-delay-ms", default="2",
                   help="the plan's max_queue_delay_ms; a comma list serves one infermux "
                        "server per value")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--protocols", default="http,grpc")
    p.add_argument("--rounds", type=int, default=1,
                   help="with more than one, every server is started at once and they take "
                        "turns level by level, round after round; each level's figure is the "
                        "median of its rounds (the machine's drift falls on all of them)")
    p.add_argument("--peers", default=",".join(str(i) for i in range(len(PEERS))),
                   help="which peer settings to run, by index: " + "; ".join(
                       f"{i}: {n}" for i, n in enumerate(PEERS)))
    args = p.parse_args()
    peers = {n: v for i, (n, v) in enumerate(PEERS.items())
             if str(i) in args.peers.split(",")}
    protocols = args.protocols.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.duration = 10.0  # the plan's offline duration (not run here)
    delays = [float(d) for d in args.queue_delay_ms.split(",")]
    plans = {}
    for delay in delays:
        name = "infermux serve" if len(delays) == 1 else f"infermux serve ({delay:g} ms delay)"
        args.queue_delay_ms = delay
        (out / f"delay-{delay:g}").mkdir(exist_ok=True)
        plans[name] = write_plan(out / f"delay-{delay:g}", args)
    levels = [int(c) for c in args.concurrency.split(",")]
    report: dict[str, Any] = {"plans": {n: json.loads(pl.read_text()) for n, pl in plans.items()},
                              "rounds": args.rounds,
                              "machine": os.uname().nodename,
                              "load_average_before": os.getloadavg(), "runs": {}}
    if args.rounds > 1:
        report["runs"] = interleaved(args, plans, peers, protocols, levels)
    else:
        for name, plan in plans.items():
            proc, ready = start_server(plan, plan.parent)
            try:
                report["runs"][name] = sweep({pr: ready[f"{pr}_port"] for pr in protocols},
                                             levels, args.seconds, name)
            finally:
                stop(proc)
        for name, (workers, cores) in peers.items():
            peer, ports = start_peer(args.peer_python, args, out, workers, cores)
            try:
                report["runs"][name] = sweep({pr: ports[["http", "grpc"].index(pr)]
                                              for pr in protocols}, levels, args.seconds, name)
            finally:
                stop(peer)
    report["versus"] = {}
    for ours_name in plans:
        ours = report["runs"][ours_name]
        for name in peers:
            for protocol in protocols:
                theirs = [r for r in report["runs"][name] if r["protocol"] == protocol]
                best = max(theirs, key=lambda r: r["throughput"])
                held = at_bound([r for r in ours if r["protocol"] == protocol], best["p99_ms"])
                ratio = held["throughput"] / best["throughput"] if held else None
                report["versus"][f"{ours_name} / {name} / {protocol}"] = {
                    "peer_best": best, "infermux": held, "ratio": ratio}
                print(f"{name} {protocol}: best {best['throughput']:.1f}/s at p99 "
                      f"{best['p99_ms']:.1f} ms (c{best['concurrency']}); {ours_name} at that "
                      f"p99: {held['throughput'] if held else 0:.1f}/s"
                      + (f" ({ratio:.2f}x)" if ratio else ""), flush=True)
    report["load_average_after"] = os.getloadavg()
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"report in {out / 'report.json'}")


def interleaved(args: argparse.Namespace, plans: dict[str, Path],
                peers: dict[str, tuple[int, str]], protocols: list[str],
                levels: list[int]) -> dict[str, list[dict[str, Any]]]:
    """Every server up at once; each level is measured on each server in turn, every round.

    An idle server costs next to nothing (no request, the sampler's tick), and taking turns
    spreads the machine's slow minutes over every server instead of over whichever ran then;
    the order of the turns rotates by one server each round.
    """
    out = Path(args.out)
    servers: dict[str, tuple[subprocess.Popen[str], dict[str, int]]] = {}
    try:
        for name, plan in plans.items():
            proc, ready = start_server(plan, plan.parent)
            servers[name] = (proc, {pr: ready[f"{pr}_port"] for pr in ("http", "grpc")})
        for name, (workers, cores) in peers.items():
            peer, ports = start_peer(args.peer_python, args, out, workers, cores)
            servers[name] = (peer, {"http": ports[0], "grpc": ports[1]})
        raw: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
        for k in range(args.rounds):
            for c in levels:
                for protocol in protocols:
                    names = list(servers)
                    shift = k % len(names)
                    for name in names[shift:] + names[:shift]:
                        ports = servers[name][1]
                        row = load_client(f"127.0.0.1:{ports[protocol]}", protocol, c,
                                          args.seconds)
                        raw[name].append({"protocol": protocol, "concurrency": c,
                                          "round": k + 1, **row})
                        print(f"  round {k + 1} {name} {protocol} c{c}: "
                              f"{row['throughput']:.1f}/s, p99 {row['p99_ms']:.1f} ms",
                              flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    (out / "rounds.json").write_text(json.dumps(raw, indent=2))
    return {name: medians(rows) for name, rows in raw.items()}


if __name__ == "__main__":
    main()
