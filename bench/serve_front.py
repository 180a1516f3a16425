"""How many bytes of input `infermux serve`'s front takes in: large requests, a model that costs nothing.

The plan serves `probe` (below): a module that reads a few pixels of each 3x224x224 item, so
what is measured is the server's own path for the bytes (body read, parse, admission, batching,
the runner's gather) and not the model. Each request carries `--items` images as fp32 (8 items:
4.8 MB) with the binary tensor extension; a closed loop of `--concurrency` streams (the
`bench/serve_load.py` client) drives it, HTTP and gRPC. Printed per level: requests/s, items/s,
MB/s of input taken in, p50/p99.

Before and after in one run: `--baseline-src DIR` serves the same plan from another source
tree (e.g. `git archive COMMIT src | tar -x -C /tmp/before`) and the two servers take turns,
level by level, so the machine's load falls on both alike.

    python bench/serve_front.py --baseline-src /tmp/before/src --concurrency 1,2,4,8
    python bench/serve_front.py --protocols http --fp16     # also send FP16 items (half the bytes)
    python bench/serve_front.py --client perf_analyzer      # Triton's perf_analyzer as the client
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from infermux.load.v2client import perf_analyzer_figures

ROOT = Path(__file__).resolve().parents[1]


class Probe(nn.Module):
    """Reads 4 pixels per channel of each item: next to nothing to compute."""

    input_shape = (3, 224, 224)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The mean of 4 pixels per channel, `(n, 3)`."""
        return x[:, :, 0, :4].float().mean(-1)


def probe() -> nn.Module:
    return Probe()


def _client_module() -> Any:
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "bench" / "serve_load.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = mod
    spec.loader.exec_module(mod)
    return mod


def write_plan(out: Path, args: argparse.Namespace) -> Path:
    plan = {
        "name": "serve-front",
        "models": [{"name": "probe", "model": f"{ROOT / 'bench' / 'serve_front.py'}:probe",
                    "replicas": [{"unit": args.unit, "engine": "torch",
                                  "instances": args.instances, "batch": args.batch}]}],
        # Threads: in the server's process, as a GPU unit's workers are.
        "dispatcher": {"max_queue_delay_ms": 2.0, "cpu_workers": "thread"},
        "load": {"scenario": "server", "min_duration_s": 1, "min_queries": 64},
    }
    path = out / "plan.yaml"
    path.write_text(json.dumps(plan, indent=2))
    return path


def start_server(src: Path, plan: Path, out: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(src))
    proc = subprocess.Popen([sys.executable, "-m", "infermux", "serve", str(plan),
                             "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
                             "--json", "--db", str(out / f"serve-{os.getpid()}-{time.time()}.db")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                            cwd=str(ROOT))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise SystemExit(f"the server from {src} did not start (exit {proc.returncode})")
    return proc, json.loads(line)


def stop_server(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(load: Any, host: str, port: int, protocol: str, concurrency: int, items: int,
            dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    x = np.random.default_rng(0).standard_normal((items, 3, 224, 224), dtype=np.float32)
    x = x.astype(dtype)
    client = (load._Grpc(f"{host}:{port}", "probe", "input", x) if protocol == "grpc"
              else load._Http(host, port, "probe", "input", x))
    if dtype == "float16":  # the clients above label every tensor FP32
        if protocol == "grpc":
            client.request.inputs[0].datatype = "FP16"
        else:
            client.request = client.request.replace(b'"FP32"', b'"FP16"', 1)
    res = asyncio.run(load.run_level(client, concurrency=concurrency, rate_qps=None,
                                     duration_s=args.duration, warmup_s=args.warmup,
                                     protocol=protocol))
    row = res.summary()
    rps = row["throughput_rps"]
    return {"protocol": protocol, "dtype": "FP16" if dtype == "float16" else "FP32",
            "concurrency": concurrency, "requests_per_s": rps, "items_per_s": rps * items,
            "input_mb_per_s": rps * x.nbytes / 1e6, "p50_ms": row["p50_ms"],
            "p99_ms": row["p99_ms"], "errors": row["errors"] + row["rejected"]}


def measure_pa(host: str, port: int, protocol: str, concurrency: int, items: int,
               out: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    exe = shutil.which("perf_analyzer", path=str(ROOT / ".venv" / "bin")) \
        or shutil.which("perf_analyzer")
    if exe is None:
        raise SystemExit("perf_analyzer is not installed: run `make perf-analyzer`")
    csv_file = out / f"pa-{protocol}-{concurrency}-{time.time()}.csv"
    cmd = [exe, "-m", "probe", "-u", f"{host}:{port}", "-i", protocol, "-b", str(items),
           "--concurrency-range", f"{concurrency}:{concurrency}",
           "--measurement-interval", str(int(args.duration * 1000)),
           "--stability-percentage", "50", "--max-trials", "8", "-f", str(csv_file)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not csv_file.exists():
        print(f"  perf_analyzer {protocol} c{concurrency} did not settle: "
              f"{done.stdout.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    row = perf_analyzer_figures(csv_file)
    ips = row["requests_per_s"]
    return {"protocol": protocol, "dtype": "FP32", "concurrency": concurrency,
            "requests_per_s": ips / items, "items_per_s": ips,
            "input_mb_per_s": ips * 3 * 224 * 224 * 4 / 1e6,
            "p50_ms": float(row["p50 latency"]) / 1e3, "p99_ms": float(row["p99 latency"]) / 1e3,
            "errors": 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-src", type=Path, help="another source tree to serve side by side")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--protocols", default="http,grpc")
    p.add_argument("--items", type=int, default=8, help="3x224x224 items per request")
    p.add_argument("--fp16", action="store_true", help="also measure FP16 requests")
    p.add_argument("--unit", default="cpu")
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--client", choices=("python", "perf_analyzer"), default="python",
                   help="bench/serve_load.py's client, or Triton's perf_analyzer (FP32 only)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    load = _client_module()
    sources = [("after", ROOT / "src")]
    if args.baseline_src is not None:
        sources.insert(0, ("before", args.baseline_src.resolve()))
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        plan = write_plan(out, args)
        servers = {label: start_server(src, plan, out) for label, src in sources}
        try:
            for protocol in args.protocols.split(","):
                fp16 = args.fp16 and args.client == "python"
                for dtype in ["float32", *(["float16"] if fp16 else [])]:
                    for c in levels:
                        for label, (_, ready) in servers.items():
                            if dtype == "float16" and label == "before":
                                continue
                            port = ready["http_port"] if protocol == "http" else ready["grpc_port"]
                            if args.client == "perf_analyzer":
                                pa = measure_pa(ready["host"], port, protocol, c, args.items,
                                                out, args)
                                if pa is None:
                                    continue
                                got = pa
                            else:
                                got = measure(load, ready["host"], port, protocol, c,
                                              args.items, dtype, args)
                            row = {"server": label, **got}
                            rows.append(row)
                            if not args.json:
                                print(f"{label:6} {protocol:4} {row['dtype']} c{c:<2} "
                                      f"{row['requests_per_s']:7.1f} req/s "
                                      f"{row['items_per_s']:8.1f} items/s "
                                      f"{row['input_mb_per_s']:7.1f} MB/s  p50 "
                                      f"{row['p50_ms']:6.1f} p99 {row['p99_ms']:6.1f} ms  "
                                      f"errors {row['errors']}", flush=True)
        finally:
            for proc, _ in servers.values():
                stop_server(proc)
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
