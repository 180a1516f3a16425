"""Does the plain v2 load client agree with Triton's perf_analyzer? Same server, side by side.

One `infermux serve` of the plan (bench/serve_cpu.py's: mobilenet_v3_small, one ONNX Runtime
worker on cpu:1); at each concurrency, perf_analyzer and bench/serve_load.py take turns on it
(perf_analyzer, plain, perf_analyzer, plain, ... for `--rounds` rounds), so both see the same
server and, as far as a shared machine allows, the same background. Throughput is answered
requests per second (one item each); the agreement is plain / perf_analyzer of the medians.

    make perf-analyzer
    .venv/bin/python bench/serve_agreement.py --out /tmp/sagree
    .venv/bin/python bench/serve_agreement.py --protocol grpc --concurrency 1,4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from serve_cpu import load_client, perf_analyzer, start_server, write_plan  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="serve-agreement-results")
    p.add_argument("--model", default="mobilenet_v3_small")
    p.add_argument("--unit", default="cpu:1")
    p.add_argument("--engine", default="onnxruntime")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--queue-delay-ms", type=float, default=2.0)
    p.add_argument("--protocol", choices=("http", "grpc"), default="http")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=6.0,
                   help="perf_analyzer's measurement interval and the plain client's window")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.duration = 10.0  # the plan's offline duration (not run here)
    plan = write_plan(out, args)
    proc, ready = start_server(plan, out)
    port = ready["http_port"] if args.protocol == "http" else ready["grpc_port"]
    url = f"127.0.0.1:{port}"
    levels = [int(c) for c in args.concurrency.split(",")]
    table: list[dict[str, Any]] = []
    try:
        for c in levels:
            pa_runs, plain_runs = [], []
            for rnd in range(args.rounds):
                pa = perf_analyzer(url, args.protocol, c,
                                   out / f"perf_analyzer-{args.protocol}-c{c}-r{rnd}.csv",
                                   int(args.seconds * 1000))
                if pa:
                    pa_runs.append(pa)
                plain = load_client(url, args.protocol, c, args.seconds)
                plain_runs.append(plain)
                print(f"c{c} round {rnd}: perf_analyzer "
                      f"{pa['throughput'] if pa else float('nan'):.1f}/s "
                      f"p99 {pa['p99_ms'] if pa else float('nan'):.1f} ms | plain "
                      f"{plain['throughput']:.1f}/s p99 {plain['p99_ms']:.1f} ms", flush=True)
            med = {k: {m: statistics.median(r[m] for r in runs) for m in ("throughput", "p99_ms")}
                   for k, runs in (("perf_analyzer", pa_runs), ("plain", plain_runs)) if runs}
            row = {"concurrency": c, **med, "runs": {"perf_analyzer": pa_runs,
                                                     "plain": plain_runs}}
            if "perf_analyzer" in med:
                row["plain_over_pa"] = med["plain"]["throughput"] / med["perf_analyzer"]["throughput"]
                print(f"c{c}: plain / perf_analyzer = {row['plain_over_pa']:.3f}", flush=True)
            table.append(row)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    report = {"protocol": args.protocol, "plan": json.loads(plan.read_text()),
              "machine": os.uname().nodename, "load_average_after": os.getloadavg(),
              "levels": table}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"report in {out / 'report.json'}")


if __name__ == "__main__":
    main()
