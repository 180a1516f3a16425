"""`infermux serve` on the CPU: perf_analyzer over HTTP and gRPC beside `infermux run` offline.

One plan (mobilenet_v3_small, random weights) is run three ways on this machine:
1. `infermux run PLAN --scenario offline`: the runtime alone, the ceiling;
2. `infermux serve PLAN` driven by Triton's perf_analyzer (`make perf-analyzer`) at each
   concurrency, over HTTP (binary tensors, its default) and gRPC, CSVs kept (`-f`);
3. the same server driven by bench/serve_load.py at the same concurrencies, to check that
   the plain v2 client agrees with perf_analyzer (it is the one that can also drive servers
   without Triton's /config route);
4. with `--peer-python`, KServe's ModelServer (bench/serve_kserve_peer.py, in its own venv)
   on the same unit and engine session, driven by bench/serve_load.py at the same levels.

The comparison with the peer: the peer's best throughput and its p99 there, against the best
infermux throughput whose p99 is no higher (same client, same protocol).

    python bench/serve_cpu.py --out /tmp/serve-cpu --peer-python /tmp/kserve-venv/bin/python
    python bench/serve_cpu.py --engine torch --concurrency 1,4,16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infermux.load.v2client import perf_analyzer_figures

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
#: `infermux` from this interpreter, with this checkout's source first on the path.
INFERMUX = [sys.executable, "-m", "infermux"]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))


def write_plan(out: Path, args: argparse.Namespace) -> Path:
    plan = {
        "name": "serve-cpu",
        "models": [{"name": "mobilenet", "model": args.model, "replicas": [
            {"unit": args.unit, "engine": args.engine, "instances": 1, "batch": args.batch}]}],
        "dispatcher": {"max_queue_delay_ms": args.queue_delay_ms},
        "load": {"scenario": "offline", "min_duration_s": args.duration, "min_queries": 256},
    }
    path = out / "plan.yaml"
    path.write_text(json.dumps(plan, indent=2))
    return path


def offline(plan: Path) -> dict[str, Any]:
    done = subprocess.run([*INFERMUX, "run", str(plan), "--scenario", "offline", "--json",
                           "--no-store"], capture_output=True, text=True, check=True, env=ENV)
    result = json.loads(done.stdout)["result"]
    return {"items_per_s": result["items_per_s"],
            "p99_ms": result["latency"]["p99_ms"]}


def start_server(plan: Path, out: Path, extra: Sequence[str] = (),
                 ) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen([*INFERMUX, "serve", str(plan), "--http-port", "0",
                             "--grpc-port", "0", "--metrics-port", "0", "--json",
                             "--db", str(out / "serve.db"), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    assert proc.stdout is not None
    ready = json.loads(proc.stdout.readline())
    return proc, ready


def perf_analyzer(url: str, protocol: str, concurrency: int, csv_file: Path,
                  interval_ms: int) -> dict[str, Any] | None:
    exe = shutil.which("perf_analyzer", path=str(VENV_BIN)) or shutil.which("perf_analyzer")
    if exe is None:
        raise SystemExit("perf_analyzer is not installed: run `make perf-analyzer`")
    cmd = [exe, "-m", "mobilenet", "-u", url, "-i", protocol,
           "--concurrency-range", f"{concurrency}:{concurrency}",
           "--measurement-interval", str(interval_ms), "--stability-percentage", "20",
           "--max-trials", "8", "-f", str(csv_file)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not csv_file.exists():
        print(f"  perf_analyzer {protocol} c{concurrency} failed: {done.stdout[-300:]}",
              file=sys.stderr)
        return None
    row = perf_analyzer_figures(csv_file)
    return {"command": " ".join(cmd), "throughput": row["requests_per_s"],
            "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"]}


def load_client(url: str, protocol: str, concurrency: int, duration: float) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "bench" / "serve_load.py"), "--url", url, "--protocol",
           protocol, "--model", "mobilenet", "--input-shape", "3x224x224",
           "--concurrency", str(concurrency), "--duration", str(duration), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    row = json.loads(done.stdout)[0]
    return {"command": " ".join(cmd), "throughput": row["throughput_rps"],
            "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"], "rejected": row["rejected"]}


def start_peer(python: str, args: argparse.Namespace, out: Path) -> subprocess.Popen[str]:
    import socket
    import urllib.request

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    log = (out / "peer.log").open("w")
    proc = subprocess.Popen([python, str(ROOT / "bench" / "serve_kserve_peer.py"), "--unit",
                             args.unit, "--engine", args.engine, "--batch", str(args.batch),
                             "--model", args.model, "--http-port", str(ports[0]),
                             "--grpc-port", str(ports[1])], stdout=log, stderr=log, text=True,
                            env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/health/ready",
                                        timeout=2) as r:
                if r.status == 200:
                    proc.ports = ports  # type: ignore[attr-defined]
                    return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"the KServe peer did not start; see {out / 'peer.log'}")


def at_bound(rows: list[dict[str, Any]], bound_ms: float) -> dict[str, Any] | None:
    held = [r for r in rows if r and r["p99_ms"] <= bound_ms]
    return max(held, key=lambda r: r["throughput"]) if held else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="serve-cpu-results")
    p.add_argument("--model", default="mobilenet_v3_small")
    p.add_argument("--unit", default="cpu:1", help="the worker's unit (leave a core to the front)")
    p.add_argument("--engine", default="onnxruntime")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--queue-delay-ms", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=10.0, help="offline run's minimum seconds")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--peer-python", help="python of a venv with kserve: run the KServe peer too")
    p.add_argument("--interval-ms", type=int, default=4000)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = write_plan(out, args)
    report: dict[str, Any] = {"plan": json.loads(plan.read_text()), "machine": os.uname().nodename,
                              "cpus": os.cpu_count()}
    print("offline (infermux run) ...", flush=True)
    report["offline"] = offline(plan)
    print(f"  {report['offline']['items_per_s']:.1f} samples/s", flush=True)
    proc, ready = start_server(plan, out)
    levels = [int(c) for c in args.concurrency.split(",")]
    try:
        urls = {"http": f"127.0.0.1:{ready['http_port']}", "grpc": f"127.0.0.1:{ready['grpc_port']}"}
        rows = []
        for protocol, url in urls.items():
            for c in levels:
                pa = perf_analyzer(url, protocol, c, out / f"perf_analyzer-{protocol}-c{c}.csv",
                                   args.interval_ms)
                rows.append({"protocol": protocol, "concurrency": c, "perf_analyzer": pa})
                if pa:
                    print(f"  perf_analyzer {protocol} c{c}: {pa['throughput']:.1f}/s, "
                          f"p99 {pa['p99_ms']:.1f} ms", flush=True)
        for c in levels:
            for protocol, url in urls.items():
                lc = load_client(url, protocol, c, 10.0)
                row = next(r for r in rows if r["protocol"] == protocol and r["concurrency"] == c)
                row["load_client"] = lc
                print(f"  serve_load {protocol} c{c}: {lc['throughput']:.1f}/s, "
                      f"p99 {lc['p99_ms']:.1f} ms", flush=True)
        report["served"] = rows
    finally:
        proc.send_signal(signal.SIGTERM)
        stopped = proc.communicate(timeout=120)[0]
        report["server_exit_code"] = proc.returncode
        report["server_summary"] = json.loads(stopped[stopped.index("{"):]) if "{" in stopped else None
    best = max((r["perf_analyzer"]["throughput"] for r in rows if r["perf_analyzer"]), default=0)
    report["best_served_over_offline"] = best / report["offline"]["items_per_s"]
    if args.peer_python:
        peer = start_peer(args.peer_python, args, out)
        try:
            ports = peer.ports  # type: ignore[attr-defined]
            peer_rows = []
            for c in levels:
                for protocol, port in (("http", ports[0]), ("grpc", ports[1])):
                    lc = load_client(f"127.0.0.1:{port}", protocol, c, 10.0)
                    peer_rows.append({"protocol": protocol, "concurrency": c, "load_client": lc})
                    print(f"  KServe peer {protocol} c{c}: {lc['throughput']:.1f}/s, "
                          f"p99 {lc['p99_ms']:.1f} ms", flush=True)
        finally:
            peer.send_signal(signal.SIGTERM)
            peer.wait(60)
        report["peer"] = peer_rows
        report["versus_peer"] = {}
        for protocol in ("http", "grpc"):
            theirs = [r["load_client"] for r in peer_rows if r["protocol"] == protocol]
            peak = max(theirs, key=lambda r: r["throughput"])
            ours = at_bound([r.get("load_client") for r in rows if r["protocol"] == protocol],
                            peak["p99_ms"])
            report["versus_peer"][protocol] = {
                "peer_best": peak, "infermux_at_peer_p99": ours,
                "ratio": ours["throughput"] / peak["throughput"] if ours else None}
            print(f"{protocol}: peer best {peak['throughput']:.1f}/s at p99 "
                  f"{peak['p99_ms']:.1f} ms; infermux at that p99: "
                  f"{ours['throughput'] if ours else 0:.1f}/s", flush=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"best served / offline: {report['best_served_over_offline']:.2f}; "
          f"report in {out / 'report.json'}")


if __name__ == "__main__":
    main()
