"""One plan served by one runtime process, or split over several sharing the same ports.

A served rate that levels where the runtime process's interpreter lock is busy (its event loop
reading the fronts' frames and writing answers, its GPU worker threads gathering and
reporting batches) may rise when the plan's instances are spread over several runtime
processes, each with its own lock, its own fronts and its own CUDA context. This measures it
on one host: for each layout `N` (`--layouts 1,2`), N `infermux serve` processes of the plan
with its instances divided by N (every replica's `instances` must divide) and `--fronts`
divided by N each, all bound to the same HTTP and gRPC ports (the fronts listen with
SO_REUSEPORT, so the kernel spreads the clients' connections over every front of every
server); perf_analyzer over gRPC at each `--concurrency`, then the servers are stopped and the
next layout starts. The plan's own offline figure (`infermux run --scenario offline`, the
whole plan in one process) is measured first, for the served/offline ratio. `--rounds 2`
repeats the layouts in reverse order (A B B A).

    python bench/serve_split.py --plan resnet50 \
        --perf-analyzer PA --layouts 1,2 --fronts 8 --concurrency 64,128,256 --json split.json
    python bench/serve_split.py --model hf:bert-base --served-outputs pooler_output \
        --batch 256 --instances 2 --options compile=default,precision=fp8 --buckets 64,128,256 \
        --perf-analyzer PA --layouts 1,2 --fronts 8 --concurrency 128,256,384 --json split.json

`--model hf:NAME` writes the plan itself (sequence 128; perf_analyzer sends ids and masks of
ones); `--plan` takes any plan file. The rows: requests/s, p50/p99 ms, and the served rate
over the offline figure, per layout and concurrency. `--shared-memory system` runs with one
server only: a region a client registers is known to the fronts of the server it reached.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_gpu
import transformers_gpu

SEQ = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bert_plan(args: argparse.Namespace) -> dict[str, Any]:
    _, _, options = transformers_gpu._serve_plan(f"b{args.batch}:{args.options}")
    model = (transformers_gpu._outputs_factory(args.model, args.served_outputs.split(","))
             if args.served_outputs else args.model)
    buckets: str | list[int] = args.buckets
    if args.buckets not in ("pow2", "fine", "none"):
        buckets = [int(b) for b in args.buckets.split(",")]
    return {"name": "split", "models": [{"name": "m", "model": model, "seq_buckets": [SEQ],
            "replicas": [{"unit": args.unit, "engine": "torch", "instances": args.instances,
                          "batch": args.batch, "batch_buckets": buckets,
                          "options": options}]}]}


def _share(plan: dict[str, Any], n: int) -> dict[str, Any]:
    """The plan with every replica's instances divided by `n`."""
    part = copy.deepcopy(plan)
    for model in part["models"]:
        for replica in model["replicas"]:
            count = int(replica.get("instances", 1))
            if count % n:
                raise SystemExit(f"layout {n}: replica {replica.get('unit')} has {count} "
                                 f"instances, not divisible by {n}")
            replica["instances"] = count // n
    return part


def _start(plan: Path, out: Path, fronts: int, http: int, grpc: int, tag: str,
           ) -> subprocess.Popen[str]:
    log = (out / f"serve-{tag}.log").open("w")
    return subprocess.Popen([*serve_gpu.INFERMUX, "serve", str(plan), "--http-port", str(http),
                             "--grpc-port", str(grpc), "--metrics-port", "0", "--json",
                             "--fronts", str(fronts), "--no-store", "--telemetry", "off"],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=serve_gpu.ENV)


def _ready(proc: subprocess.Popen[str], out: Path, tag: str) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"server {tag} did not start (exit code {proc.wait()}): see "
                           f"{out / f'serve-{tag}.log'}")
    return json.loads(line)


def _client_args(ready: dict[str, Any], folder: Path) -> list[str]:
    """perf_analyzer's shapes and data for a model with a sequence dim (token inputs)."""
    inputs = ready["models"][0]["inputs"]
    if not any(-1 in spec["shape"][1:] for spec in inputs):
        return []
    extra = []
    for spec in inputs:
        extra += ["--shape", f"{spec['name']}:{SEQ}"]
    if all(spec["datatype"].startswith(("INT", "UINT")) for spec in inputs):
        extra += ["--input-data", transformers_gpu.pa_input_data(inputs, SEQ, "tokens", folder)]
    return extra


def _layout(plan: dict[str, Any], n: int, args: argparse.Namespace, out: Path,
            ) -> list[dict[str, Any]]:
    part = out / f"plan-{n}.json"
    part.write_text(json.dumps(_share(plan, n)))
    http, grpc = _free_port(), _free_port()
    fronts = args.fronts // n
    if fronts < 2:  # one front is served in the server's own process, on a port of its own
        raise SystemExit(f"layout {n}: --fronts {args.fronts} leaves {fronts} per server; "
                         "each needs at least 2 to share the ports")
    if n > 1 and args.shared_memory != "none":
        # A region a client registers through one front is known to that server's fronts only.
        raise SystemExit(f"layout {n}: --shared-memory {args.shared_memory} needs one server "
                         "(the servers do not share their registered regions): use none")
    rows: list[dict[str, Any]] = []
    # Started together (each builds its runners, then its fronts listen on the shared ports).
    servers = [_start(part, out, fronts, http, grpc, f"{n}-{k}") for k in range(n)]
    try:
        ready = [_ready(proc, out, f"{n}-{k}") for k, proc in enumerate(servers)]
        name = ready[0]["models"][0]["name"]
        extra = _client_args(ready[0], out)
        for c in args.concurrency:
            row = serve_gpu.perf_analyzer(args.perf_analyzer, f"127.0.0.1:{grpc}", "grpc", name,
                                          c, args.shared_memory, out / f"pa-{n}-{c}.csv",
                                          args.interval_ms, extra=extra)
            row.update(layout=n, fronts_each=fronts)
            rows.append(row)
            print(f"layout {n} (fronts {fronts} each) c{c}: "
                  f"{row.get('requests_per_s', 0):,.0f} requests/s, p99 "
                  f"{row.get('p99_ms', float('nan')):.1f} ms {row.get('error', '')}", flush=True)
    finally:
        # Each server's share of the requests: the kernel spread the connections over all.
        shares = []
        for proc in servers:
            summary = serve_gpu.stop_server(proc)["summary"]
            shares.append(sum(m.get("requests_ok", 0)
                              for m in summary.get("models", {}).values()))
        for row in rows:
            row["answered_per_server"] = shares
        if rows:
            print(f"layout {n}: requests answered per server {shares}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", help="a plan file (YAML or JSON), or resnet50 / digits "
                   "(bench/serve_gpu.py's plans)")
    p.add_argument("--model", help="instead of --plan: an hf: network served at sequence 128")
    p.add_argument("--served-outputs", default="", help="with --model: the outputs served")
    p.add_argument("--unit", default="cuda:0/fp16")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--options", default="compile=default")
    p.add_argument("--buckets", default="pow2")
    p.add_argument("--layouts", default="1,2", help="runtime processes to split the plan over")
    p.add_argument("--fronts", type=int, default=8, help="front processes in all")
    p.add_argument("--concurrency", default="64,128,256")
    p.add_argument("--shared-memory", default="none", choices=("none", "system"))
    p.add_argument("--interval-ms", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=1, help="2: the layouts again, reversed")
    p.add_argument("--perf-analyzer", required=True)
    p.add_argument("--json", help="where the report goes")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if bool(args.plan) == bool(args.model):
        raise SystemExit("give --plan FILE or --model hf:NAME")
    serve_gpu.perf_analyzer_env(args.perf_analyzer)
    out = Path(tempfile.mkdtemp(prefix="infermux-split-"))
    if args.plan in serve_gpu.plans("cuda"):
        plan = serve_gpu.plans(args.unit.partition(":")[0])[args.plan]
    else:
        plan = yaml.safe_load(Path(args.plan).read_text()) if args.plan else _bert_plan(args)
    plan["load"] = {"scenario": "offline", "min_duration_s": 5, "min_queries": 2048}
    whole = out / "plan.json"
    whole.write_text(json.dumps(plan))
    started = time.perf_counter()
    offline = serve_gpu.offline(whole)
    print(f"offline (the whole plan, one process): {offline}", flush=True)
    layouts = [int(n) for n in args.layouts.split(",")]
    order = [layouts if r % 2 == 0 else layouts[::-1] for r in range(args.rounds)]
    rows = []
    for r, ns in enumerate(order):
        for n in ns:
            for row in _layout(plan, n, args, out):
                row["round"] = r + 1
                if offline.get("items_per_s") and row.get("requests_per_s"):
                    row["served_over_offline"] = round(row["requests_per_s"]
                                                       / offline["items_per_s"], 3)
                rows.append(row)
    report = {"command": "python " + " ".join(sys.argv), "plan": plan, "offline": offline,
              "rows": rows, "wall_s": round(time.perf_counter() - started, 1),
              "host_cores": os.cpu_count()}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
