"""Soak: `infermux serve` through a burst at twice its saturation, then back at half of it.

1. The saturating rate: perf_analyzer, closed loop at `--concurrency` (gRPC), requests/s.
2. Before: perf_analyzer at `--calm-factor` × that rate (Poisson) for `--calm-s`: p99, and the
   server's resident memory (its process and its worker processes).
3. The burst: Poisson arrivals at `--factor` × the saturating rate for `--burst-s`, open
   loop over `--channels` gRPC channels (each call is a stream of one of them; every answer
   is counted by its status code, and a call still unanswered after `--call-timeout-s`, the
   server's drain timeout, is DEADLINE_EXCEEDED: hung). perf_analyzer stops at the first
   refused request ("Thread [..] had error: ... admission limit"), so it cannot drive a load
   past admission; bench/serve_load.py opens a channel per call outstanding, which on two
   shared cores fell behind a 1,225/s schedule by minutes and grew to 3.7 GB. Resident memory
   sampled every 0.5 s.
   With `--kill worker`, the model's worker process is killed (SIGKILL) half-way through;
   with `--kill front`, the server runs `--fronts 2` (front processes) and one of them is
   killed (SIGKILL) half-way through: the server restarts it, and what it held is answered
   into its old slabs or lost with its connections (the client sees UNAVAILABLE).
4. After: perf_analyzer at the calm rate again: p99 and resident memory.

Checks (each true or false in the report, with the figures):
- `none_lost`: every call got one answer, and the server's counters' deltas equal the
  client's counts: answered, refused (UNAVAILABLE with `retry-after`), failed. Calls grpc
  reset before any handler saw them (UNAVAILABLE without `retry-after`: RST_STREAM
  REFUSED_STREAM, once a connection's calls the front had not yet taken passed its stream
  limit) are counted by the client only (`reset`); so are calls CANCELLED by grpc (more than
  10,000 not taken, or one not taken within 30 s), which `refusals_are_503` fails. With `--kill
  front`, calls the killed front held may have been answered by the runtime with the answer
  lost with the connection (the client sees a reset): then the server's refusals still
  equal the client's, it counted no more than was sent, and each answer the client did not
  get is one of its resets;
- `refusals_are_503`: the burst got nothing but OK and UNAVAILABLE, except, with `--kill`,
  failures answered with a message (counted apart);
- `refusals_hinted`: no call was refused by grpc itself (RST_STREAM, no `retry-after`): the
  front took every call and answered it (a killed front's sockets are not counted here);
- `none_hung`: every burst call was answered within `--call-timeout-s` (the server's drain
  timeout, `--drain-timeout-s`, which also bounds a wait for a restarting worker, plus a
  margin for the answer to travel);
- `drained`: no request left in flight after the burst (none hangs past the drain timeout);
- `memory_flat`: resident memory after within 10% of before;
- `p99_recovered`: p99 after within 20% of before (each the lowest of `--calm-runs` runs: a
  neighbour's load on a shared machine moves single runs by more than 20%);
- `ready_after`: the server is ready after it all;
- `front_restarted` (`--kill front`): the killed front was replaced (`front_restarts` 1).

    python bench/serve_soak.py --out /tmp/serve-soak            # 60 s burst, the full run
    python bench/serve_soak.py --out /tmp/serve-soak --burst-s 10 --calm-s 5   # a short one
    python bench/serve_soak.py --out /tmp/serve-soak-front --kill front
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from infermux.load.v2client import perf_analyzer_figures

ROOT = Path(__file__).resolve().parents[1]
INFERMUX = [sys.executable, "-m", "infermux"]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its children (the worker processes)."""
    import psutil

    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += child.memory_info().rss
    return int(total)


def counters(metrics_url: str, model: str) -> dict[str, float]:
    """The server's request counters for `model` (answered, failed, refused, in flight)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {"ok": 0.0, "failed": 0.0, "rejected": 0.0, "in_flight": 0.0}
    for line in text.splitlines():
        if f'model="{model}"' not in line:
            continue
        value = float(line.rsplit(" ", 1)[1])
        if line.startswith("nv_inference_request_success_total"):
            out["ok"] += value
        elif line.startswith("nv_inference_request_failure_total") and "BACKEND" in line:
            out["failed"] += value
        elif line.startswith("infermux_requests_rejected_total"):
            out["rejected"] += value
        elif line.startswith("nv_inference_pending_request_count"):
            out["in_flight"] += value
    return out


def calm_best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the lowest p99 among those that measured (the first run if none did)."""
    ok = [r for r in runs if r.get("ok")]
    return min(ok, key=lambda r: r["p99_ms"]) if ok else runs[0]


def perf_analyzer(exe: str, url: str, model: str, csv_file: Path, *, concurrency: int | None = None,
                  rate: float | None = None, seconds: float, stability_pct: float = 50.0,
                  max_trials: int = 3) -> dict[str, Any]:
    """One perf_analyzer level over gRPC; throughput and p99 from its CSV."""
    level = (["--concurrency-range", f"{concurrency}:{concurrency}"] if concurrency is not None
             else ["--request-rate-range", f"{rate:.1f}:{rate:.1f}",
                   "--request-distribution", "poisson"])
    cmd = [exe, "-m", model, "-u", url, "-i", "grpc", *level,
           "--measurement-interval", str(int(seconds * 1000)), "--stability-percentage", f"{stability_pct:g}",
           "--max-trials", str(max_trials), "-f", str(csv_file)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    row: dict[str, Any] = {"command": " ".join(cmd), "ok": done.returncode == 0
                           and csv_file.exists()}
    if not row["ok"]:
        row["error"] = done.stdout[-500:] + done.stderr[-500:]
        return row
    data = perf_analyzer_figures(csv_file)
    row.update(throughput_rps=data["requests_per_s"], p99_ms=data["p99_ms"], p50_ms=data["p50_ms"])
    return row


async def burst(target: str, model: str, tensor: dict[str, Any], rate_qps: float,
                seconds: float, *, channels: int, call_timeout_s: float) -> dict[str, Any]:
    """Open-loop Poisson arrivals over gRPC; every call's status code counted.

    Calls share `channels` channels (HTTP/2 streams), so a call costs the client no connection
    of its own. A call is sent at its scheduled arrival or, if the client lags, at once; the
    lag is reported (`achieved_rate_rps`) rather than hidden.
    """
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    shape = [1, *tensor["shape"][1:]]
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=tensor["name"], datatype="FP32", shape=shape)
    request.raw_input_contents.append(x.tobytes())
    chans = [grpc.aio.insecure_channel(target) for _ in range(channels)]
    stubs = [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in chans]
    codes: Counter[str] = Counter()
    details: Counter[str] = Counter()
    latencies_ms: list[float] = []

    async def one(i: int, due: float) -> None:
        try:
            await stubs[i % channels].ModelInfer(request, timeout=call_timeout_s)
            codes["OK"] += 1
            latencies_ms.append((time.perf_counter() - due) * 1e3)
        except grpc.aio.AioRpcError as exc:
            name = exc.code().name
            # The server's own refusals (admission, not ready, shutting down) carry a
            # `retry-after` trailer; an UNAVAILABLE without one never reached its handler
            # (grpc reset the stream: REFUSED_STREAM, or the connection went away).
            if name == "UNAVAILABLE" and not any(
                    k == "retry-after" for k, _ in (exc.trailing_metadata() or ())):
                name = "UNAVAILABLE_RESET"
                if "RST_STREAM" in (exc.details() or ""):
                    codes["refused_stream"] += 1  # grpc refused it: the front had not taken it
            codes[name] += 1
            details[f"{name}: {(exc.details() or '')[:80]}"] += 1

    rng = random.Random(0)
    start = time.perf_counter()
    at, end, tasks = start, start + seconds, []
    while True:
        at += rng.expovariate(rate_qps)
        if at >= end:
            break
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(len(tasks), at)))
    sent_by = time.perf_counter()
    await asyncio.gather(*tasks)
    for c in chans:
        await c.close()
    lat = np.asarray(latencies_ms or [0.0])
    return {"sent": len(tasks), "ok": codes["OK"], "rejected": codes["UNAVAILABLE"],
            "reset": codes["UNAVAILABLE_RESET"], "refused_stream": codes["refused_stream"],
            "errors": len(tasks) - codes["OK"] - codes["UNAVAILABLE"]
            - codes["UNAVAILABLE_RESET"],
            "hung": codes["DEADLINE_EXCEEDED"], "codes": dict(codes),
            "details": dict(details.most_common(8)),
            "rate_rps": rate_qps, "achieved_rate_rps": len(tasks) / max(1e-9, sent_by - start),
            "answered_within_s": time.perf_counter() - start,
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the report (report.json) and CSVs")
    p.add_argument("--model", default="digits-cnn", help="model reference (default digits-cnn)")
    p.add_argument("--unit", default="cpu:1")
    p.add_argument("--engine", default="torch")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--queue-delay-ms", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=16, help="closed loop for saturation")
    p.add_argument("--factor", type=float, default=2.0, help="burst rate / saturating rate")
    p.add_argument("--calm-factor", type=float, default=0.5, help="calm rate / saturating rate")
    p.add_argument("--burst-s", type=float, default=60.0)
    p.add_argument("--calm-s", type=float, default=10.0, help="perf_analyzer window, calm runs")
    p.add_argument("--stability", type=float, default=50.0,
                   help="perf_analyzer's --stability-percentage (a loaded machine needs more)")
    p.add_argument("--kill", choices=("none", "worker", "front"), default="none",
                   help="kill the model's worker process, or a front process (the server "
                        "then runs --fronts 2), half-way through the burst")
    p.add_argument("--channels", type=int, default=8, help="gRPC channels the burst shares")
    p.add_argument("--max-trials", type=int, default=3,
                   help="perf_analyzer's --max-trials (a loaded machine needs more)")
    p.add_argument("--calm-runs", type=int, default=2, help="calm runs before and after each")
    p.add_argument("--settle-s", type=float, default=5.0,
                   help="pause between the burst's drain and the calm run after it")
    p.add_argument("--drain-timeout-s", type=float, default=25.0,
                   help="the server's --drain-timeout (also its bound on waiting for a restart)")
    p.add_argument("--call-timeout-s", type=float, default=30.0,
                   help="a burst call unanswered this long is hung (the drain timeout plus a margin)")
    p.add_argument("--perf-analyzer", help="path of perf_analyzer (default: the venv, PATH)")
    args = p.parse_args()
    exe = args.perf_analyzer or shutil.which("perf_analyzer", path=str(Path(sys.executable).parent)) \
        or shutil.which("perf_analyzer")
    if exe is None:
        raise SystemExit("perf_analyzer is not installed: run `make perf-analyzer`, or pass "
                         "--perf-analyzer PATH")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = {"name": "soak", "models": [{"name": "net", "model": args.model, "replicas": [
        {"unit": args.unit, "engine": args.engine, "instances": 1, "batch": args.batch}]}],
        "dispatcher": {"max_queue_delay_ms": args.queue_delay_ms}}
    plan_file = out / "plan.yaml"
    plan_file.write_text(json.dumps(plan, indent=2))
    proc = subprocess.Popen([*INFERMUX, "serve", str(plan_file), "--http-port", "0",
                             "--grpc-port", "0", "--metrics-port", "0", "--json",
                             "--telemetry", "off", "--db", str(out / "serve.db"),
                             "--drain-timeout", f"{args.drain_timeout_s:g}s",
                             *(["--fronts", "2"] if args.kill == "front" else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"the server did not start: {proc.stderr.read() if proc.stderr else ''}")
    ready = json.loads(line)
    grpc_url = f"127.0.0.1:{ready['grpc_port']}"
    metrics_url = f"http://127.0.0.1:{ready['metrics_port']}/metrics"
    report: dict[str, Any] = {"plan": plan, "args": vars(args),
                              "max_queue_items": ready["models"][0]["max_queue_items"]}
    try:
        sat = perf_analyzer(exe, grpc_url, "net", out / "saturation.csv",
                            concurrency=args.concurrency, seconds=args.calm_s,
                            stability_pct=args.stability, max_trials=args.max_trials)
        if not sat["ok"]:
            raise SystemExit(f"perf_analyzer failed: {sat['error']}")
        report["saturation"] = sat
        calm_rate = sat["throughput_rps"] * args.calm_factor
        burst_rate = sat["throughput_rps"] * args.factor
        print(f"saturation {sat['throughput_rps']:.1f} requests/s; calm {calm_rate:.1f}, "
              f"burst {burst_rate:.1f} for {args.burst_s:g} s", flush=True)
        befores = [perf_analyzer(exe, grpc_url, "net", out / f"before-{i}.csv", rate=calm_rate,
                                 seconds=args.calm_s, stability_pct=args.stability,
                                 max_trials=args.max_trials)
                   for i in range(args.calm_runs)]
        before = calm_best(befores)
        rss_before = rss_bytes(proc.pid)
        start_counts = counters(metrics_url, "net")
        samples: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.5):
                with contextlib.suppress(Exception):
                    samples.append(rss_bytes(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        killed: int | None = None
        if args.kill != "none":
            pids = (ready["worker_pids"].values() if args.kill == "worker"
                    else ready.get("front_pids", []))
            killed = next(iter(pids), None)
            if killed is None:
                raise SystemExit(f"--kill {args.kill}: the server has no such process")
            victim = killed
            threading.Timer(args.burst_s / 2, lambda: os.kill(victim, signal.SIGKILL)).start()
        load = asyncio.run(burst(grpc_url, "net", ready["models"][0]["inputs"][0], burst_rate,
                                 args.burst_s, channels=args.channels,
                                 call_timeout_s=args.call_timeout_s))
        stop.set()
        sampler.join()
        # Admitted requests are answered or failed: none may still be in flight after the
        # drain timeout (30 s by default).
        deadline = time.monotonic() + 30
        while counters(metrics_url, "net")["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.2)
        end_counts = counters(metrics_url, "net")
        print(f"burst: sent {load['sent']} ({load['achieved_rate_rps']:.1f}/s), codes "
              f"{load['codes']}, answered within {load['answered_within_s']:.1f} s",
              flush=True)
        time.sleep(args.settle_s)
        afters = [perf_analyzer(exe, grpc_url, "net", out / f"after-{i}.csv", rate=calm_rate,
                                seconds=args.calm_s, stability_pct=args.stability,
                                max_trials=args.max_trials)
                  for i in range(args.calm_runs)]
        after = calm_best(afters)
        rss_after = rss_bytes(proc.pid)
        health = urllib.request.urlopen(
            f"http://127.0.0.1:{ready['http_port']}/v2/health/ready", timeout=10).status
        served = {k: end_counts[k] - start_counts[k] for k in ("ok", "failed", "rejected")}
        sent = load["sent"]
        # Every call had one answer (the client counts each by its code). The server's
        # counters match the client's exactly: its answers (none lost, none twice), its
        # refusals (the UNAVAILABLEs with `retry-after`) and its failures; calls grpc reset
        # before a handler saw them are the client's only (`reset`). A killed front's calls
        # may have been answered by the runtime with the answer lost with the connection.
        if args.kill == "front":
            counted = (served["rejected"] == load["rejected"] and sum(served.values()) <= sent
                       and 0 <= served["ok"] - load["ok"] <= load["reset"])
        else:
            counted = (served["ok"] == load["ok"] and served["rejected"] == load["rejected"]
                       and served["failed"] == load["errors"])
        checks = {
            "none_lost": counted and load["ok"] + load["rejected"] + load["reset"]
            + load["errors"] == sent,
            "refusals_are_503": load["errors"] == 0 or (killed is not None
                                                        and load["errors"] <= served["failed"]),
            "refusals_hinted": load["refused_stream"] == 0,
            "none_hung": load["hung"] == 0,
            "drained": end_counts["in_flight"] == 0,
            "memory_flat": abs(rss_after - rss_before) <= 0.10 * rss_before,
            "p99_recovered": bool(before.get("ok") and after.get("ok")
                                  and after["p99_ms"] <= 1.2 * before["p99_ms"]),
            "ready_after": health == 200,
        }
        report.update(calm_rate_rps=calm_rate, burst_rate_rps=burst_rate, before=before,
                      burst=load, after=after, before_runs=befores, after_runs=afters,
                      server_counts=served, client_sent=sent,
                      killed_pid=killed, rss_before_mb=rss_before / 2**20,
                      rss_max_mb=max(samples or [rss_after]) / 2**20,
                      rss_after_mb=rss_after / 2**20, checks=checks,
                      passed=all(checks.values()))
        print(f"burst: sent {sent} ({load['achieved_rate_rps']:.1f}/s of {burst_rate:.1f}/s), "
              f"codes {load['codes']}; server: {served}; in flight after "
              f"{end_counts['in_flight']:.0f}", flush=True)
        print(f"p99 before {before.get('p99_ms', float('nan')):.2f} ms, after "
              f"{after.get('p99_ms', float('nan')):.2f} ms; RSS {rss_before / 2**20:.0f} → max "
              f"{report['rss_max_mb']:.0f} → {rss_after / 2**20:.0f} MiB", flush=True)
        print("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()),
              flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        stopped: dict[str, Any] = {}
        with contextlib.suppress(subprocess.TimeoutExpired):
            rest, _ = proc.communicate(timeout=120)
            with contextlib.suppress(ValueError):
                stopped = json.loads(rest[rest.index("{"):])
        report["server_exit_code"] = proc.returncode
        report["server_status"] = stopped.get("status")
        if args.kill == "front" and "checks" in report:
            report["front_restarts"] = stopped.get("front_restarts")
            report["checks"]["front_restarted"] = stopped.get("front_restarts") == 1
            report["passed"] = all(report["checks"].values())
            print(f"front restarts {stopped.get('front_restarts')}", flush=True)
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    if not report.get("passed"):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
