"""`infermux serve` on a GPU: served requests/s against the plan's offline figure, per front count.

For each model (the server-tuned ResNet50 fp16 plan, and digits-cnn, whose 1x32x32 input
isolates the fronts' per-request cost), the script measures the plan's offline figure
(`infermux run --scenario offline`, the runtime alone), then serves the plan with each
`--fronts` count and runs perf_analyzer over gRPC and HTTP at each concurrency, with the
tensors in the requests and with `--shared-memory system`. perf_analyzer runs on the same
machine as the server. Everything lands in one JSON file (`--out`), with the served/offline
ratio of each row; a time budget (`--budget`) skips what would run past it, and says so.

    python bench/serve_gpu.py --json /tmp/serve-gpu.json            # H100: both models
    python bench/serve_gpu.py --device cpu --models digits --fronts 1,2 --json cpu.json

perf_analyzer: `--perf-analyzer PATH` (its lib/ folder, if beside it, goes on the loader's
path), else `perf_analyzer` on PATH or in the venv (`make perf-analyzer`); without it the
load comes from bench/serve_load.py (no shared memory then).

The ResNet50 plan (`resnet50`) is what `infermux tune -m resnet50 --units cuda:0/fp16 --scenario
server --p99 15ms` chose on an H100 (docs/benchmarks.md): torch b64 x2, `compile: default`, pow2
buckets. `resnet50x4` is the shape the server tune writes since it measures its candidates'
peaks shortest latency first: b32 x4, the same offline rate with four workers taking turns.
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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from infermux.load.v2client import perf_analyzer_figures as pa_figures
from serve_cpu import ENV, INFERMUX, VENV_BIN

ROOT = Path(__file__).resolve().parents[1]
_LOAD = {"scenario": "offline", "min_duration_s": 4, "min_queries": 1024}


def plans(device: str) -> dict[str, dict[str, Any]]:
    """The plans served, by short name."""
    gpu = device == "cuda"

    def resnet50(name: str, batch: int, instances: int) -> dict[str, Any]:
        """The server-tuned ResNet50 plan at one shape (on the CPU: b8 ×2)."""
        return {
            "name": name,
            "models": [{"name": "resnet50", "model": "resnet50", "replicas": [
                {"unit": "cuda:0/fp16" if gpu else "cpu:0", "engine": "torch",
                 "instances": instances if gpu else 2,
                 "batch": batch if gpu else 8, "batch_buckets": "pow2",
                 "options": {"compile": "default"} if gpu else {}}]}],
            "dispatcher": {"max_queue_delay_ms": 2.0}, "load": _LOAD}

    return {
        "resnet50": resnet50("resnet50-server", 64, 2),
        # The shape the server tune writes where its find-peaks measure it (b32 x4: four
        # workers taking turns, docs/benchmarks.md "two plan shapes side by side").
        "resnet50x4": resnet50("resnet50-server-x4", 32, 4),
        "digits": {
            "name": "digits-serve",
            "models": [{"name": "digits", "model": "digits-cnn", "replicas": [
                {"unit": "cuda:0/fp16" if gpu else "cpu:0", "engine": "torch",
                 "instances": 2 if gpu else 1, "batch": 64 if gpu else 32,
                 "batch_buckets": "pow2"}]}],
            "dispatcher": {"max_queue_delay_ms": 1.0}, "load": _LOAD},
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


def offline(plan: Path, scenario: str = "offline") -> dict[str, Any]:
    """The plan's own figure: `infermux run --scenario offline` (the runtime, no server).

    `scenario="single-stream"`: one query at a time, so its latency is the plan's batch-1
    latency, the reference of the concurrency-1 rows.
    """
    done = subprocess.run([*INFERMUX, "run", str(plan), "--scenario", scenario, "--json",
                           "--no-store"], capture_output=True, text=True, env=ENV)
    if done.returncode != 0:
        return {"error": done.stderr[-500:]}
    result = json.loads(done.stdout)["result"]
    return {"items_per_s": result["items_per_s"], "p50_ms": result["latency"].get("p50_ms"),
            "p99_ms": result["latency"]["p99_ms"]}


_TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used, from /proc."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) * _TICK_S
    return total


def answered(ready: dict[str, Any], model: str) -> float:
    """Items the server has answered (its Prometheus counter, kept by the runtime process).

    Items, not the runtime's requests: behind Triton's front a runtime request is a Triton
    batch of one or more client requests; at one item per client request (perf_analyzer's
    `-b 1`) items are the client's requests whatever the front.
    """
    import urllib.request

    url = f"http://127.0.0.1:{ready['metrics_port']}/metrics"
    key = f'nv_inference_count_total{{model="{model}",version="1"}}'
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith(key):
            return float(line.rpartition(" ")[2])
    return 0.0


def start_server(plan: Path, out: Path, fronts: int, *, extra: Sequence[str] = (),
                 env: dict[str, str] | None = None, tag: str = "",
                 ) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """`infermux serve PLAN --fronts N` on free ports (`extra` options, `env`): its ready line."""
    log = (out / f"serve-{plan.stem}-f{fronts}{tag}.log").open("w")
    proc = subprocess.Popen([*INFERMUX, "serve", str(plan), "--http-port", "0",
                             "--grpc-port", "0", "--metrics-port", "0", "--json",
                             "--fronts", str(fronts), "--no-store", "--telemetry", "off", *extra],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env or ENV)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the server did not start (exit code {proc.wait()}): see {log.name}")
    return proc, json.loads(line)


def stop_server(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """SIGTERM, then the exit code, status and front restarts; `summary`: the whole summary."""
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    try:
        summary: dict[str, Any] = json.loads(out[out.index("{"):])
    except ValueError:
        summary = {}
    return {"exit_code": proc.returncode, "status": summary.get("status"),
            "front_restarts": summary.get("front_restarts"), "summary": summary}


def perf_analyzer(exe: str, url: str, protocol: str, model: str, concurrency: int,
                  shared_memory: str, csv_file: Path, interval_ms: int, items: int = 1,
                  stability_pct: int = 20, extra: Sequence[str] = ()) -> dict[str, Any]:
    cmd = [exe, "-m", model, "-u", url, "-i", protocol, "-b", str(items),
           "--concurrency-range", f"{concurrency}:{concurrency}",
           "--measurement-interval", str(interval_ms), "--stability-percentage", str(stability_pct),
           "--max-trials", "5", "--shared-memory", shared_memory, "-f", str(csv_file), *extra]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    row: dict[str, Any] = {"concurrency": concurrency, "command": " ".join(cmd),
                           "wall_s": round(time.perf_counter() - started, 1)}
    if done.returncode != 0 or not csv_file.exists():
        row["error"] = (done.stdout + done.stderr)[-400:]
        return row
    row.update(pa_figures(csv_file))
    return row


def load_client(url: str, protocol: str, model: str, shape: str, concurrency: int,
                ) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "bench" / "serve_load.py"), "--url", url, "--protocol",
           protocol, "--model", model, "--input-shape", shape, "--concurrency", str(concurrency),
           "--duration", "5", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    row: dict[str, Any] = {"concurrency": concurrency, "command": " ".join(cmd)}
    if done.returncode != 0:
        row["error"] = done.stderr[-400:]
        return row
    data = json.loads(done.stdout)[0]
    row.update(requests_per_s=data["throughput_rps"], p50_ms=data["p50_ms"],
               p99_ms=data["p99_ms"])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="where the report goes")
    p.add_argument("--out", help="a folder for the report (report.json) instead of --json")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--models", default="resnet50,digits")
    p.add_argument("--fronts", default="1,8", help="front counts to serve with (1: in-process)")
    p.add_argument("--front", default="own",
                   help="serve --front: own, triton, or both (own,triton), each per front count; "
                        "triton:native or triton:python name its --triton-backend")
    p.add_argument("--triton-python-path",
                   help="--front triton: a numpy<2 install for its model instances")
    p.add_argument("--triton-queue-delay",
                   help="--front triton: serve's --triton-queue-delay (default: the backend's)")
    p.add_argument("--concurrency", default="1,64,256")
    p.add_argument("--shared-memory",
                   help="perf_analyzer --shared-memory modes (none, system, cuda); default: "
                        "none,system for ResNet50 (301 KB requests), none for digits-cnn")
    p.add_argument("--protocols", default="grpc,http")
    p.add_argument("--interval-ms", type=int, default=1500,
                   help="perf_analyzer's measurement interval")
    p.add_argument("--stability", type=int, default=20,
                   help="perf_analyzer's --stability-percentage (raise it on a shared machine)")
    p.add_argument("--p99", type=float, default=15.0, help="latency bound for the summary, ms")
    p.add_argument("--budget", type=float, default=400.0,
                   help="seconds; measurements that would start later are skipped (and listed)")
    p.add_argument("--plan", help="serve this plan file instead of the built-in ones")
    p.add_argument("--items-per-request", type=int, default=1, help="perf_analyzer's -b")
    p.add_argument("--perf-analyzer", help="path of perf_analyzer")
    p.add_argument("--wheels", help="folder of wheels to install the serve extra from, offline")
    args = p.parse_args()
    ensure_serve_extra(args.wheels)
    began = time.monotonic()
    if not args.json and not args.out:
        p.error("give --json FILE (or --out DIR) for the report")
    report_path = Path(args.json) if args.json else Path(args.out) / "report.json"
    work = report_path.with_suffix(".d")
    work.mkdir(parents=True, exist_ok=True)
    exe = args.perf_analyzer or shutil.which("perf_analyzer", path=str(VENV_BIN)) \
        or shutil.which("perf_analyzer")
    if exe:
        perf_analyzer_env(exe)
    levels = [int(c) for c in args.concurrency.split(",")]
    front_counts = [int(f) for f in args.fronts.split(",")]
    report: dict[str, Any] = {"device": args.device, "client": exe or "bench/serve_load.py",
                              "cores": len(os.sched_getaffinity(0)), "bound_ms": args.p99,
                              "models": {}, "skipped": []}

    def save() -> None:
        report["wall_s"] = round(time.monotonic() - began, 1)
        report_path.write_text(json.dumps(report, indent=2))

    all_plans = plans(args.device)
    names = args.models.split(",")
    if args.plan:
        import yaml

        all_plans = {"plan": yaml.safe_load(Path(args.plan).read_text())}
        names = ["plan"]
    for name in names:
        plan_file = work / f"{name}.json"
        plan_file.write_text(json.dumps(all_plans[name], indent=2))
        model = all_plans[name]["models"][0]["name"]
        modes = ["none"] if not exe else args.shared_memory.split(",") if args.shared_memory \
            else ["none"] if name == "digits" else ["none", "system"]
        entry: dict[str, Any] = {"plan": all_plans[name], "served": []}
        report["models"][name] = entry
        print(f"{name}: offline ...", flush=True)
        entry["offline"] = offline(plan_file)
        print(f"  {entry['offline']}", flush=True)
        if 1 in levels:  # the concurrency-1 rows' reference
            entry["single_stream"] = offline(plan_file, "single-stream")
            print(f"  single-stream: {entry['single_stream']}", flush=True)
        ceiling = entry["offline"].get("items_per_s")
        for fronts, front in [(f, k) for f in front_counts for k in args.front.split(",")]:
            if time.monotonic() - began > args.budget:
                report["skipped"].append(f"{name} --fronts {fronts} --front {front}")
                continue
            try:
                kind, _, backend = front.partition(":")
                extra = ["--front", kind, *(["--triton-backend", backend] if backend else [])]
                if kind == "triton" and args.triton_python_path:
                    extra += ["--triton-python-path", args.triton_python_path]
                if kind == "triton" and args.triton_queue_delay is not None:
                    extra += ["--triton-queue-delay", args.triton_queue_delay]
                proc, ready = start_server(plan_file, work, fronts, extra=extra,
                                           tag=f"-{front.replace(':', '-')}")
            except RuntimeError as exc:
                entry.setdefault("servers", []).append({"fronts": fronts, "front": front,
                                                        "error": str(exc)})
                print(f"  {name} --fronts {fronts} --front {front}: {exc}", flush=True)
                continue
            shape = "x".join(str(d) for d in ready["models"][0]["inputs"][0]["shape"][1:])
            try:
                for protocol in args.protocols.split(","):
                    port = ready["http_port" if protocol == "http" else "grpc_port"]
                    for mode in modes:
                        for c in levels:
                            what = (f"{name} fronts={fronts}"
                                    f"{'' if front == 'own' else ' ' + front} {protocol} "
                                    f"shm={mode} c{c}")
                            if time.monotonic() - began > args.budget:
                                report["skipped"].append(what)
                                continue
                            url = f"127.0.0.1:{port}"
                            fronts_pids = ready.get("front_pids") or []
                            before = (cpu_s([proc.pid]), cpu_s(fronts_pids),
                                      answered(ready, model))
                            row = perf_analyzer(
                                exe, url, protocol, model, c, mode,
                                work / f"{name}-f{fronts}-{front.replace(':', '-')}-{protocol}"
                                       f"-{mode}-c{c}.csv",
                                args.interval_ms, args.items_per_request,
                                args.stability) if exe else \
                                load_client(url, protocol, model, shape, c)
                            row.update(fronts=fronts, front=front, protocol=protocol,
                                       shared_memory=mode)
                            # CPU per answered request (warm-up and every trial included):
                            # the runtime process's, and the front processes' together.
                            served = answered(ready, model) - before[2]
                            if served > 0:
                                row["runtime_cpu_ms_per_request"] = round(
                                    1e3 * (cpu_s([proc.pid]) - before[0]) / served, 4)
                                row["fronts_cpu_ms_per_request"] = round(
                                    1e3 * (cpu_s(fronts_pids) - before[1]) / served, 4)
                            if ceiling and "requests_per_s" in row:
                                row["served_over_offline"] = round(row["requests_per_s"] / ceiling, 3)
                            entry["served"].append(row)
                            figure = (f"{row['requests_per_s']:.0f} req/s, p99 {row['p99_ms']:.1f} ms"
                                      if "requests_per_s" in row else f"failed: {row['error'][-160:]}")
                            print(f"  {what}: {figure}", flush=True)
                            save()
            finally:
                stopped = stop_server(proc)
                stopped.pop("summary")
                entry.setdefault("servers", []).append({"fronts": fronts, "front": front,
                                                        **stopped})
        held = [r for r in entry["served"] if r.get("p99_ms", 1e9) <= args.p99]
        entry["best_within_bound"] = {
            f"{protocol} fronts={f} front={k} shm={m}": max(
                (r for r in held if (r["protocol"], r["fronts"], r["front"], r["shared_memory"])
                 == (protocol, f, k, m)), key=lambda r: r["requests_per_s"], default=None)
            for protocol in args.protocols.split(",") for f in front_counts
            for k in args.front.split(",") for m in modes}
        save()
    save()
    print(f"report: {report_path} ({report['wall_s']} s)")


if __name__ == "__main__":
    main()
