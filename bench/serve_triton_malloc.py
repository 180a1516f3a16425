"""Triton's CPU per request with the tensors in the request: glibc's defaults against the heap.

`$INFERMUX_TRITON_MALLOC=heap` starts `serve --front triton`'s `tritonserver` with glibc's
allocator kept on its heap (`triton_front.TRITON_MALLOC`); otherwise glibc's own settings.
This serves one model whose input is large and whose compute is next to nothing (the mean of
each channel of a 3×224×224 image, FP32: 602 KB a request), so Triton's own work per request
is most of what is measured, behind Triton's front with the native backend, and drives it
with perf_analyzer over gRPC (tensors in the request) at `--concurrency`, the two settings
alternated in `--pairs` pairs (each pair's order flipped). Per run: requests/s, p99, and
`tritonserver`'s CPU (user + system, from /proc) divided by the requests it answered.

    python bench/serve_triton_malloc.py --perf-analyzer PA --json malloc.json
    python bench/serve_triton_malloc.py --perf-analyzer PA --unit cuda:0 --concurrency 128 --json m.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_gpu import ENV, answered, cpu_s, pa_figures, perf_analyzer_env, start_server, stop_server

_MODEL = '''
from torch import nn


class ChannelMean(nn.Module):
    input_shape = (3, 224, 224)

    def forward(self, x):
        return x.mean(dim=(2, 3))


def build():
    return ChannelMean()
'''
SETTINGS = ("heap", "default")


def one_run(args: argparse.Namespace, plan: Path, work: Path, setting: str, tag: str,
            ) -> dict[str, Any]:
    """Serve the plan with one allocator setting, load it, and read Triton's CPU per request."""
    env = {**ENV, "INFERMUX_TRITON_MALLOC": setting}
    proc, ready = start_server(plan, work, 1, env=env, tag=tag, extra=[
        "--front", "triton", "--triton-backend", "native"])
    try:
        pids = ready.get("front_pids") or []
        csv_file = work / f"pa-{tag}.csv"
        before = (cpu_s(pids), answered(ready, "mean"))
        done = subprocess.run(
            [args.perf_analyzer, "-m", "mean", "-u", f"127.0.0.1:{ready['grpc_port']}", "-i",
             "grpc", "--concurrency-range", f"{args.concurrency}:{args.concurrency}",
             "--measurement-interval", str(args.interval_ms), "--stability-percentage",
             str(args.stability), "--max-trials", "10", "-f", str(csv_file)],
            capture_output=True, text=True)
        served = answered(ready, "mean") - before[1]
        row: dict[str, Any] = {"setting": setting}
        if done.returncode != 0 or not csv_file.exists():
            row["error"] = (done.stdout + done.stderr)[-400:]
        else:
            row.update(pa_figures(csv_file))
        if served > 0:
            row["triton_cpu_ms_per_request"] = round(1e3 * (cpu_s(pids) - before[0]) / served, 4)
        row["requests"] = served
        return row
    finally:
        stop_server(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--perf-analyzer", required=True, help="path of perf_analyzer")
    p.add_argument("--json", required=True, help="where the report goes")
    p.add_argument("--unit", default="cpu:0")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--interval-ms", type=int, default=3000)
    p.add_argument("--stability", type=int, default=50,
                   help="perf_analyzer's --stability-percentage (high: a 2-core machine)")
    args = p.parse_args()
    perf_analyzer_env(args.perf_analyzer)
    work = Path(tempfile.mkdtemp(prefix="infermux-triton-malloc-"))
    (work / "mean.py").write_text(_MODEL)
    plan = work / "mean.json"
    plan.write_text(json.dumps({"name": "mean", "models": [{
        "name": "mean", "model": f"{work / 'mean.py'}:build", "replicas": [{
            "unit": args.unit, "engine": "torch", "instances": 1, "batch": args.batch,
            "batch_buckets": "pow2"}]}]}))
    began = time.monotonic()
    rows = []
    for pair in range(args.pairs):
        order = SETTINGS if pair % 2 == 0 else SETTINGS[::-1]
        for setting in order:
            row = one_run(args, plan, work, setting, f"{pair}-{setting}")
            row["pair"] = pair
            rows.append(row)
            print(f"pair {pair} {setting:8s} {row.get('requests_per_s') or 0:9.1f} req/s "
                  f"p99 {row.get('p99_ms') or 0:6.2f} ms, Triton "
                  f"{row.get('triton_cpu_ms_per_request') or 0:.4f} ms CPU/request "
                  f"{row.get('error', '')}", flush=True)
    summary = {}
    for setting in SETTINGS:
        mine = [r for r in rows if r["setting"] == setting and "error" not in r]
        summary[setting] = {
            key: statistics.median(r[key] for r in mine) if mine else None
            for key in ("requests_per_s", "p99_ms", "triton_cpu_ms_per_request")}
    heap, default = summary["heap"], summary["default"]
    if heap["triton_cpu_ms_per_request"] and default["triton_cpu_ms_per_request"]:
        summary["cpu_heap_over_default"] = round(
            heap["triton_cpu_ms_per_request"] / default["triton_cpu_ms_per_request"], 3)
    if heap["requests_per_s"] and default["requests_per_s"]:
        summary["rate_heap_over_default"] = round(
            heap["requests_per_s"] / default["requests_per_s"], 3)
    report = {"command": "python " + " ".join(sys.argv), "cores": len(os.sched_getaffinity(0)),
              "unit": args.unit, "concurrency": args.concurrency, "rows": rows,
              "median": summary, "wall_s": round(time.monotonic() - began, 1)}
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
