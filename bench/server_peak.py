"""Server peak vs offline for plan variants of one model on one unit, each through `infermux run`.

Each variant (batch × instances × queue delay × take rule) is written as a plan and run as
`infermux run PLAN --find-peak --p99 BOUND` in a fresh process: the offline trial first, then the
bisection of server rates. The table gives each variant's offline images/s, its peak within the
bound, their ratio, and the latency phases (batching wait, compute) at the peak's first invalid
rate, which say where the tail comes from.

    python bench/server_peak.py --model resnet50 --unit cuda:0/fp16 --compile default \
        --variants b64x2,b64x1,b32x2,b128x1 --delays 2 --takes just_in_time --json peak.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml


def _plan(model: str, unit: str, batch: int, instances: int, delay_ms: float, take: str,
          compile_mode: str | None, p99: float, duration: float) -> dict[str, Any]:
    options = {"compile": compile_mode} if compile_mode else {}
    return {
        "name": f"{model}-b{batch}x{instances}-d{delay_ms:g}-{take}",
        "models": [{"name": model, "model": model, "replicas": [
            {"unit": unit, "engine": "torch", "instances": instances, "batch": batch,
             "batch_buckets": "pow2", "options": options}]}],
        "dispatcher": {"max_queue_delay_ms": delay_ms, "gpu_take": take},
        "load": {"scenario": "server", "p99_bound_ms": p99, "min_duration_s": duration,
                 "min_queries": 1024},
    }


def _phase(trial: dict[str, Any], name: str) -> float | None:
    for model in (trial.get("models") or {}).values():
        value = ((model.get("phases") or {}).get(name) or {}).get("p99_ms")
        if value is not None:
            return float(value)
    return None


def _model_value(trial: dict[str, Any], key: str) -> float | None:
    for model in (trial.get("models") or {}).values():
        if model.get(key) is not None:
            return float(model[key])
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--unit", default="cuda:0/fp16")
    parser.add_argument("--compile", default="default", help="torch.compile mode, or 'none'")
    parser.add_argument("--variants", default="b64x2,b64x1,b32x2,b128x1",
                        help="comma-separated bBATCHxINSTANCES")
    parser.add_argument("--delays", default="2", help="max_queue_delay_ms values")
    parser.add_argument("--takes", default="just_in_time", help="gpu_take values")
    parser.add_argument("--p99", type=float, default=15.0)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    compile_mode = None if args.compile == "none" else args.compile
    rows = []
    work = Path(tempfile.mkdtemp(prefix="server-peak-"))
    combos = itertools.product(args.variants.split(","), [float(d) for d in args.delays.split(",")],
                               args.takes.split(","))
    for variant, delay, take in combos:
        batch, instances = (int(v) for v in variant.lstrip("b").split("x"))
        plan = _plan(args.model, args.unit, batch, instances, delay, take, compile_mode, args.p99,
                     args.duration)
        path = work / f"{plan['name']}.yaml"
        path.write_text(yaml.safe_dump(plan, sort_keys=False))
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "infermux", "run", str(path), "--find-peak",
                               "--p99", str(args.p99), "--duration", f"{args.duration}s", "--json",
                               "--db", str(work / "runs.db")],
                              capture_output=True, text=True, env=os.environ.copy())
        took = time.perf_counter() - start
        if proc.returncode != 0:
            rows.append({"variant": variant, "delay_ms": delay, "take": take, "error":
                         (proc.stderr or proc.stdout).strip().splitlines()[-1:], "seconds": took})
            print(json.dumps(rows[-1]), flush=True)
            continue
        report = json.loads(proc.stdout)
        trials = report["trials"]
        offline = trials[0].get("items_per_s") or 0.0
        peak = (report.get("peak") or {}).get("peak_qps")
        # The server trials (the offline trial runs before the search and after it).
        servers = [t for t in trials if t.get("scenario") == "server"]
        invalid = [t for t in servers if not t.get("valid")]
        first_bad = min(invalid, key=lambda t: t.get("rate_qps") or 0) if invalid else None
        row = {"variant": variant, "delay_ms": delay, "take": take, "offline": offline,
               "peak": peak, "ratio": (report.get("peak") or {}).get("peak_fraction_of_offline"),
               "seconds": took, "trials": [
                   {"rate": t.get("rate_qps"), "valid": t.get("valid"),
                    "p99_ms": (t.get("latency") or {}).get("p99_ms"),
                    "queueing_p99_ms": _phase(t, "queueing"),
                    "batching_p99_ms": _phase(t, "batching_wait"),
                    "compute_p99_ms": _phase(t, "compute"),
                    "mean_batch": _model_value(t, "mean_batch")}
                   for t in servers],
               "first_invalid": None if first_bad is None else first_bad.get("rate_qps"),
               "reason": (report.get("peak") or {}).get("reason")}
        rows.append(row)
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        print(f"{variant:>8} delay {delay:g} ms {take:>12}: offline {offline:8.0f}  peak "
              f"{peak or 0:8.0f}  ratio {ratio}  ({took:.0f} s)", flush=True)
        for t in row["trials"]:
            print(f"          rate {t['rate']:8.0f} valid {t['valid']!s:5} p99 {t['p99_ms']}  "
                  f"queueing {t['queueing_p99_ms']} batching {t['batching_p99_ms']} compute "
                  f"{t['compute_p99_ms']} (p99 ms) mean batch {t['mean_batch']}",
                  flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
