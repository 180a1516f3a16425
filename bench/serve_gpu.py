"""`infermux serve` on a GPU: ResNet50 with the tuned server plan, throughput at p99 ≤ 15 ms.

Beside `infermux run --find-peak` on the same plan (the runtime alone). The load comes from
perf_analyzer when it is installed (`make perf-analyzer`, or `--perf-analyzer PATH`), else from
bench/serve_load.py; both are on the same machine as the server. Each protocol gets a
concurrency sweep; the figure is the highest throughput whose p99 holds the bound.

    python bench/serve_gpu.py --out /tmp/serve-gpu                 # the tuned plan, fp16 b64 ×2
    python bench/serve_gpu.py --plan server.yaml --items-per-request 8
    python bench/serve_gpu.py --wheels /path/to/wheels             # install the serve extra offline

The default plan is what `infermux tune -m resnet50 --units cuda:0/fp16 --scenario server
--p99 15ms` chose on an H100 (docs/benchmarks.md): torch b64 ×2, `compile: default`, pow2
buckets.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_cpu import ENV, INFERMUX, VENV_BIN, start_server

ROOT = Path(__file__).resolve().parents[1]
PLAN = {
    "name": "resnet50-server",
    "models": [{"name": "resnet50", "model": "resnet50", "replicas": [
        {"unit": "cuda:0/fp16", "engine": "torch", "instances": 2, "batch": 64,
         "batch_buckets": "pow2", "options": {"compile": "default"}}]}],
    "dispatcher": {"max_queue_delay_ms": 2.0},
    "load": {"scenario": "server", "p99_bound_ms": 15, "min_duration_s": 4, "min_queries": 1024},
}


#: Where `--wheels` installs the serve extra when this interpreter lacks it (torch and the
#: rest stay the system's: the venv sees the system site-packages).
SERVE_VENV = Path("/tmp/infermux-serve-venv")


def ensure_serve_extra(wheels: str | None) -> None:
    """Re-run this script in a venv with the serve extra when this interpreter lacks it."""
    missing = [m for m in ("uvicorn", "grpc", "tritonclient", "prometheus_client")
               if importlib.util.find_spec(m) is None]
    if not missing:
        return
    if wheels is None:
        raise SystemExit(f"missing {missing}: pip install -e '.[serve]', or pass --wheels DIR")
    python = SERVE_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(SERVE_VENV)],
                       check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links",
                    wheels, "uvicorn", "httptools", "uvloop", "grpcio",
                    "tritonclient[grpc,http]", "prometheus-client"], check=True)
    os.execv(str(python), [str(python), *sys.argv])


def perf_analyzer_env(exe: str) -> None:
    """Put the libraries shipped beside perf_analyzer (lib/) on the loader's path."""
    lib = Path(exe).resolve().parent / "lib"
    if lib.is_dir():
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(lib), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])


def find_peak(plan: Path, bound_ms: float) -> dict[str, Any]:
    done = subprocess.run([*INFERMUX, "run", str(plan), "--find-peak", "--p99", str(bound_ms),
                           "--duration", "4s", "--json", "--no-store"],
                          capture_output=True, text=True, check=True, env=ENV)
    peak = json.loads(done.stdout)["peak"]
    return {"peak_qps": peak.get("peak_qps"), "offline": peak.get("offline_items_per_s")}


def sweep_perf_analyzer(exe: str, url: str, protocol: str, model: str, levels: list[int],
                        out: Path, items: int) -> list[dict[str, Any]]:
    import csv

    rows = []
    for c in levels:
        csv_file = out / f"perf_analyzer-{protocol}-c{c}.csv"
        cmd = [exe, "-m", model, "-u", url, "-i", protocol, "-b", str(items),
               "--concurrency-range", f"{c}:{c}", "--measurement-interval", "4000",
               "--stability-percentage", "20", "--max-trials", "8", "-f", str(csv_file)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not csv_file.exists():
            print(f"  perf_analyzer {protocol} c{c} failed: {done.stdout[-300:]}", flush=True)
            continue
        with csv_file.open() as f:
            row = next(csv.DictReader(f))
        rows.append({"concurrency": c, "items_per_s": float(row["Inferences/Second"]),
                     "p99_ms": float(row["p99 latency"]) / 1e3, "command": " ".join(cmd)})
        print(f"  perf_analyzer {protocol} c{c}: {rows[-1]['items_per_s']:.0f} items/s, "
              f"p99 {rows[-1]['p99_ms']:.1f} ms", flush=True)
    return rows


def sweep_load_client(url: str, protocol: str, model: str, levels: list[int],
                      items: int) -> list[dict[str, Any]]:
    rows = []
    for c in levels:
        cmd = [sys.executable, str(ROOT / "bench" / "serve_load.py"), "--url", url, "--protocol",
               protocol, "--model", model, "--input-shape", "3x224x224", "--batch", str(items),
               "--concurrency", str(c), "--duration", "8", "--json"]
        row = json.loads(subprocess.run(cmd, capture_output=True, text=True,
                                        check=True).stdout)[0]
        rows.append({"concurrency": c, "items_per_s": row["throughput_rps"] * items,
                     "p99_ms": row["p99_ms"], "command": " ".join(cmd)})
        print(f"  serve_load {protocol} c{c}: {rows[-1]['items_per_s']:.0f} items/s, "
              f"p99 {rows[-1]['p99_ms']:.1f} ms", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="serve-gpu-results")
    p.add_argument("--plan", help="plan file (default: the tuned ResNet50 server plan)")
    p.add_argument("--p99", type=float, default=15.0, help="latency bound, ms")
    p.add_argument("--items-per-request", type=int, default=1)
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128")
    p.add_argument("--perf-analyzer", help="path of perf_analyzer (default: PATH, the venv)")
    p.add_argument("--wheels", help="folder of wheels to install the serve extra from, offline")
    p.add_argument("--skip-peak", action="store_true", help="do not run `infermux run --find-peak`")
    args = p.parse_args()
    ensure_serve_extra(args.wheels)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = Path(args.plan) if args.plan else out / "plan.yaml"
    if not args.plan:
        plan.write_text(json.dumps(PLAN, indent=2))
    import yaml

    model = yaml.safe_load(plan.read_text())["models"][0]["name"]
    report: dict[str, Any] = {"plan": str(plan), "bound_ms": args.p99}
    if not args.skip_peak:
        print("infermux run --find-peak ...", flush=True)
        report["runtime"] = find_peak(plan, args.p99)
        print(f"  {report['runtime']}", flush=True)
    exe = args.perf_analyzer or shutil.which("perf_analyzer", path=str(VENV_BIN)) \
        or shutil.which("perf_analyzer")
    if exe:
        perf_analyzer_env(exe)
    levels = [int(c) for c in args.concurrency.split(",")]
    proc, ready = start_server(plan, out)
    try:
        report["served"] = {}
        for protocol, port in (("http", ready["http_port"]), ("grpc", ready["grpc_port"])):
            url = f"127.0.0.1:{port}"
            rows = (sweep_perf_analyzer(exe, url, protocol, model, levels, out,
                                        args.items_per_request) if exe
                    else sweep_load_client(url, protocol, model, levels, args.items_per_request))
            held = [r for r in rows if r["p99_ms"] <= args.p99]
            report["served"][protocol] = {
                "client": "perf_analyzer" if exe else "bench/serve_load.py", "levels": rows,
                "best_within_bound": max(held, key=lambda r: r["items_per_s"]) if held else None}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)
        report["server_exit_code"] = proc.returncode
    (out / "report.json").write_text(json.dumps(report, indent=2))
    for protocol, served in report["served"].items():
        best = served["best_within_bound"]
        figure = f"{best['items_per_s']:.0f} items/s at c{best['concurrency']}" if best else "none"
        print(f"{protocol}: best within p99 ≤ {args.p99:g} ms: {figure}")
    print(f"report: {out / 'report.json'}")


if __name__ == "__main__":
    main()
