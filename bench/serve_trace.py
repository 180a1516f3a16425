r"""Where served requests wait: perf_analyzer load on `infermux serve --fronts N`, with the trace.

Serves the server-tuned ResNet50 fp16 plan (torch b64 x2, `compile: default`; bench/serve_gpu.py)
with 8 front processes and drives it with perf_analyzer over gRPC, `--shared-memory system`,
single-image requests, at concurrency 64 and 256; then digits-cnn (8x8-scale input: the fronts'
and the runtime's per-request cost alone) at 256. The server traces every 8th request's stages
(`--trace-requests 8`, serve/trace.py). For each row: requests/s and p99 (perf_analyzer), the
server's own split of a request (its statistics: queue, compute, and the rest, "overhead"),
the average batch, the CPU cores each process used, and the trace's p50/p99 of every gap
between stages for the requests of that row's window. One JSON file (`--json`).

    python bench/serve_trace.py --json /tmp/serve-trace.json --perf-analyzer /path/perf_analyzer
    python bench/serve_trace.py --device cpu --cases digits:2:16,digits:2:128 --json cpu.json

`--cases` lists model:fronts:concurrency rows (rows of one model and front count share a
server, started once, in the order given). `--baseline-src DIR` (another checkout's `src/`)
serves the same rows with that code first (last with `--baseline-after`), untraced unless
`--trace-baseline`, for a before/after in one run. Each row also records the fronts' cores
and each front's client connections two seconds into the run (where the client's first burst
landed), then at 8 and 14 s while the run lasts (once the server re-placed them: serve/steer.py).
On this 2-core machine, the served rows' gather before and after:

    python bench/serve_trace.py --device cpu --cpu-workers thread --trace-baseline \
        --baseline-src /path/to/before/src --cases digits:2:16,digits:2:64,digits:2:128 \
        --json cpu-gather.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_cpu import ENV, ROOT, VENV_BIN
from serve_gpu import cpu_s, ensure_serve_extra, perf_analyzer_env, plans, start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from infermux.load.v2client import perf_analyzer_figures
from infermux.serve.trace import summarize

_DEFAULT_CASES = "resnet50:8:64,resnet50:8:256,digits:8:256"
_PA_TIMEOUT_S = 100


def _stats(http_port: int, model: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{http_port}/v2/models/{model}/stats"
    data: dict[str, Any] = json.loads(urllib.request.urlopen(url, timeout=10).read())
    return dict(data["model_stats"][0])


def _split(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The server's mean request in ms between two statistics records: queue, compute, rest."""
    def delta(*keys: str) -> float:
        a: Any = after
        b: Any = before
        for k in keys:
            a, b = a[k], b[k]
        return float(a - b)

    ok = delta("inference_stats", "success", "count")
    if ok <= 0:
        return {}
    parts = {k: delta("inference_stats", k, "ns") / ok / 1e6
             for k in ("queue", "compute_input", "compute_infer", "compute_output")}
    request_ms = delta("inference_stats", "success", "ns") / ok / 1e6
    executions = delta("execution_count")
    return {"request_ms": round(request_ms, 3), "queue_ms": round(parts["queue"], 3),
            "compute_ms": round(sum(parts.values()) - parts["queue"], 3),
            "overhead_ms": round(request_ms - sum(parts.values()), 3),
            "avg_batch": round(delta("inference_count") / executions, 2) if executions else None}


def _start(plan: Path, out: Path, fronts: int, trace: Path | None, src: str | None,
           connection_age: str | None = None) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """The server, traced; or with the code of checkout `src`, untraced (a baseline).

    `connection_age`: this tree's `--connection-age` (a baseline's serve may not know it).
    """
    traced = ["--trace-requests", "8", "--trace-file", str(trace)] if trace else []
    if connection_age and src is None:
        traced += ["--connection-age", connection_age]
    # The checkout's `src/` replaces this one's on the path; the rest of it (where the serving
    # wheels were installed) stays.
    path = [p for p in ENV.get("PYTHONPATH", "").split(os.pathsep)
            if p and os.path.abspath(p) != str(ROOT / "src")]
    env = ENV if src is None else dict(
        ENV, PYTHONPATH=os.pathsep.join([os.path.abspath(src), *path]))
    return start_server(plan, out, fronts, extra=traced, env=env,
                        tag="-baseline" if src else "")


def _stop(proc: subprocess.Popen[str]) -> dict[str, Any]:
    stopped = stop_server(proc)
    return {"exit_code": stopped["exit_code"], "status": stopped["status"],
            "trace_requests": (stopped["summary"].get("trace") or {}).get("requests")}


def _perf_analyzer(exe: str, port: int, model: str, concurrency: int, shm: str,
                   interval_ms: int, csv_file: Path) -> dict[str, Any]:

    cmd = [exe, "-m", model, "-u", f"127.0.0.1:{port}", "-i", "grpc", "-b", "1",
           "--concurrency-range", f"{concurrency}:{concurrency}",
           "--measurement-interval", str(interval_ms), "--stability-percentage", "30",
           "--max-trials", "5", "--shared-memory", shm, "-f", str(csv_file)]
    row: dict[str, Any] = {"command": " ".join(cmd)}
    try:  # a server that never lets it stabilise must not eat the whole run
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_PA_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        row["error"] = f"perf_analyzer did not finish within {_PA_TIMEOUT_S} s"
        return row
    if done.returncode != 0 or not csv_file.exists():
        row["error"] = (done.stdout + done.stderr)[-400:]
        return row
    data = perf_analyzer_figures(csv_file)
    row.update(requests_per_s=data["requests_per_s"], p50_ms=data["p50_ms"], p99_ms=data["p99_ms"])
    return row


def _count_connections(pids: list[int], port: int, times_s: tuple[float, ...],
                       into: dict[str, Any], stop: threading.Event) -> threading.Thread:
    """Count each front's client connections on `port` at `times_s` into a run (a thread).

    A client opens what it opens (perf_analyzer: about one per five concurrent requests), and
    a front's share of the load is its share of the connections. The first count is where
    the client's burst of connections landed (`connections_per_front`), the later ones where
    they are once the server re-placed them (`--connection-age`; `connections_later`, one
    list per time, taken only while the run lasts).
    """
    def count() -> None:
        import psutil

        start = time.monotonic()
        for k, at in enumerate(times_s):
            if stop.wait(max(0.0, start + at - time.monotonic())):
                return
            counts = []
            for pid in pids:
                try:
                    conns = psutil.Process(pid).net_connections("tcp")
                except psutil.Error:
                    counts.append(None)
                    continue
                counts.append(sum(1 for c in conns
                                  if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port))
            if k == 0:
                into["connections_per_front"] = counts
            else:
                into.setdefault("connections_later", []).append(counts)

    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    return thread


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="where the report goes")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--cases", default=_DEFAULT_CASES, help="model:fronts:concurrency rows")
    p.add_argument("--shared-memory", default="system", help="perf_analyzer --shared-memory")
    p.add_argument("--interval-ms", type=int, default=4000,
                   help="perf_analyzer's measurement interval")
    p.add_argument("--perf-analyzer", help="path of perf_analyzer (its lib/ beside it is used)")
    p.add_argument("--wheels", help="folder of wheels to install the serve extra from, offline")
    p.add_argument("--connection-age", help="this tree's serve --connection-age (e.g. 5s)")
    p.add_argument("--baseline-src", help="another checkout's src/ to serve the rows with first")
    p.add_argument("--baseline-after", action="store_true",
                   help="serve each case with this checkout first, then the baseline")
    p.add_argument("--trace-baseline", action="store_true",
                   help="trace the baseline's requests too (its checkout must have "
                        "--trace-requests): the gaps before and after side by side")
    p.add_argument("--cpu-workers", choices=["process", "thread"],
                   help="the plans' dispatcher.cpu_workers (thread: a CPU runner gathers the "
                        "served rows in the server process, as GPU workers do)")
    args = p.parse_args()
    ensure_serve_extra(args.wheels)
    began = time.monotonic()
    exe = args.perf_analyzer or shutil.which("perf_analyzer", path=str(VENV_BIN)) \
        or shutil.which("perf_analyzer")
    if not exe:
        raise SystemExit("perf_analyzer not found: pass --perf-analyzer PATH")
    perf_analyzer_env(exe)
    report_path = Path(args.json)
    work = report_path.with_suffix(".d")
    work.mkdir(parents=True, exist_ok=True)
    cases = [(m, int(f), int(c)) for m, f, c in (x.split(":") for x in args.cases.split(","))]
    report: dict[str, Any] = {"device": args.device, "cores": len(os.sched_getaffinity(0)),
                              "client": exe, "shared_memory": args.shared_memory, "rows": [],
                              "servers": []}

    def save() -> None:
        report["wall_s"] = round(time.monotonic() - began, 1)
        report_path.write_text(json.dumps(report, indent=2))

    groups: list[tuple[str, int, list[int]]] = []
    for model, fronts, c in cases:
        if groups and groups[-1][:2] == (model, fronts):
            groups[-1][2].append(c)
        else:
            groups.append((model, fronts, [c]))
    all_plans = plans(args.device)
    if args.cpu_workers:
        for plan in all_plans.values():
            plan["dispatcher"]["cpu_workers"] = args.cpu_workers
    variants = ([args.baseline_src] if args.baseline_src else []) + [None]
    if args.baseline_after:
        variants.reverse()
    for (name, fronts, levels), src in [(g, v) for g in groups for v in variants]:
        variant = "baseline" if src else "this"
        plan_file = work / f"{name}.json"
        plan_file.write_text(json.dumps(all_plans[name], indent=2))
        trace = None if src and not args.trace_baseline else \
            work / f"trace-{name}-f{fronts}-{variant}.jsonl"
        print(f"{name} --fronts {fronts} ({variant}): starting", flush=True)
        try:
            proc, ready = _start(plan_file, work, fronts, trace, src, args.connection_age)
        except RuntimeError as exc:
            report["servers"].append({"model": name, "fronts": fronts, "variant": variant,
                                      "error": str(exc)})
            continue
        model = ready["models"][0]["name"]
        windows: list[tuple[dict[str, Any], tuple[int, int]]] = []
        try:
            for c in levels:
                pids = [proc.pid, *(ready.get("front_pids") or [])]
                s0, t0 = _stats(ready["http_port"], model), time.perf_counter_ns()
                cpu0 = [cpu_s([pid]) for pid in pids]
                conns: dict[str, Any] = {}
                done = threading.Event()
                counter = _count_connections(pids[1:], ready["grpc_port"], (2.0, 8.0, 14.0),
                                             conns, done)
                row = _perf_analyzer(exe, ready["grpc_port"], model, c, args.shared_memory,
                                     args.interval_ms,
                                     work / f"{name}-f{fronts}-c{c}-{variant}.csv")
                done.set()
                counter.join()
                row.update(conns)
                t1 = time.perf_counter_ns()
                time.sleep(0.3)  # the fronts answer statistics the runtime pushes every 0.1 s
                row.update(model=name, fronts=fronts, concurrency=c, protocol="grpc", variant=variant,
                           shared_memory=args.shared_memory,
                           server=_split(s0, _stats(ready["http_port"], model)))
                wall_s = (t1 - t0) / 1e9
                cores = [round((cpu_s([pid]) - before) / wall_s, 2)
                         for pid, before in zip(pids, cpu0, strict=True)]
                row["cores_used"] = {"runtime": cores[0], "fronts": cores[1:]}
                report["rows"].append(row)
                windows.append((row, (t0, t1)))
                figure = (f"{row['requests_per_s']:.0f} req/s, p99 {row['p99_ms']:.1f} ms, "
                          f"server {row['server']}, fronts' cores {cores[1:]}, connections "
                          f"{row.get('connections_per_front')} then "
                          f"{row.get('connections_later')}" if "requests_per_s" in row
                          else f"failed: {row['error'][-200:]}")
                print(f"  c{c}: {figure}", flush=True)
                save()
        finally:
            report["servers"].append({"model": name, "fronts": fronts, "variant": variant,
                                      **_stop(proc)})
        # The trace files are complete once the server stopped.
        for row, window in windows if trace is not None else []:
            row["trace"] = summarize(str(trace), window)
            gaps = row["trace"]["gaps"]
            worst = sorted(gaps.items(), key=lambda kv: -kv[1]["mean_ms"])[:4]
            print(f"  c{row['concurrency']} largest gaps (mean ms): "
                  + ", ".join(f"{k} {v['mean_ms']:.2f}" for k, v in worst), flush=True)
        save()
    save()
    print(f"report: {report_path} ({report['wall_s']} s)")


if __name__ == "__main__":
    main()
