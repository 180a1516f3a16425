"""Overload: Poisson arrivals at twice the saturating rate against `infermux serve`.

1. The saturating rate: closed-loop concurrency 16 (bench/serve_load.py) for 10 s.
2. Poisson arrivals at `--factor` × that rate for `--duration` s, while the server's resident
   memory (its process and its worker processes) is sampled every 0.5 s.
3. Afterwards: health, one inference, and the server's own counters (`/metrics`).

Reported: answered and refused (503) requests, p99 of the answered ones, memory before,
at most during, and after, whether the server was still healthy.

    python bench/serve_overload.py --out /tmp/serve-overload
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_cpu import ROOT, start_server, write_plan


def rss_bytes(pid: int) -> int:
    import psutil

    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += child.memory_info().rss
    return int(total)


def latency_buckets(metrics_url: str) -> dict[float, float]:
    """The server's own request-duration histogram (cumulative counts by upper bound, s)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("infermux_request_duration_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.split()[-1])
    return out


def p99_bound_s(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The histogram bucket bound holding the 99th percentile of the requests in between."""
    counts = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = counts.get(float("inf"), 0.0)
    if total <= 0:
        return None
    return next(le for le, c in counts.items() if c >= 0.99 * total)


def client(url: str, *levels: str) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "bench" / "serve_load.py"), "--url", url, "--model",
           "mobilenet", "--input-shape", "3x224x224", "--json", *levels]
    row = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)[0]
    row["command"] = " ".join(cmd)
    return dict(row)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="serve-overload-results")
    p.add_argument("--model", default="mobilenet_v3_small")
    p.add_argument("--unit", default="cpu:1")
    p.add_argument("--engine", default="onnxruntime")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--queue-delay-ms", type=float, default=2.0)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=30.0)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ns = argparse.Namespace(**{**vars(args), "duration": 10.0})
    plan = write_plan(out, ns)
    proc, ready = start_server(plan, out)
    url = f"127.0.0.1:{ready['http_port']}"
    report: dict[str, Any] = {"plan": json.loads(plan.read_text()),
                              "max_queue_items": ready["models"][0]["max_queue_items"]}
    try:
        saturating = client(url, "--concurrency", "16", "--duration", "10")
        rate = saturating["throughput_rps"] * args.factor
        report["saturating"] = saturating
        print(f"saturating: {saturating['throughput_rps']:.1f} req/s; offering {rate:.1f}/s "
              f"for {args.duration:g} s", flush=True)
        samples: list[int] = []
        before = rss_bytes(proc.pid)
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.5):
                samples.append(rss_bytes(proc.pid))

        metrics_url = f"http://127.0.0.1:{ready['metrics_port']}/metrics"
        hist_before = latency_buckets(metrics_url)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        overload = client(url, "--rate", f"{rate:.1f}", "--duration", str(args.duration),
                          "--warmup", "0")
        stop.set()
        sampler.join()
        server_p99 = p99_bound_s(hist_before, latency_buckets(metrics_url))
        after = rss_bytes(proc.pid)
        health = urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=10).status
        check = client(url, "--concurrency", "1", "--duration", "2", "--warmup", "0")
        metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{ready['metrics_port']}/metrics", timeout=10).read().decode()
        rejected = next((float(line.split()[-1]) for line in metrics.splitlines()
                         if line.startswith("infermux_requests_rejected_total")), 0.0)
        report.update(offered_rps=rate, overload=overload, rss_before_mb=before / 2**20,
                      rss_max_mb=max(samples or [after]) / 2**20, rss_after_mb=after / 2**20,
                      ready_after=health, inference_after=check["ok"] > 0,
                      rejected_by_metrics=rejected, server_p99_at_most_s=server_p99)
        print(f"answered {overload['ok']} ({overload['throughput_rps']:.1f}/s), 503 "
              f"{overload['rejected']}, errors {overload['errors']}, p99 of answered "
              f"{overload['p99_ms']:.1f} ms from the scheduled arrival (server's own p99 ≤ "
              f"{server_p99} s); RSS {before / 2**20:.0f} → max "
              f"{report['rss_max_mb']:.0f} → {after / 2**20:.0f} MiB; ready after: {health}",
              flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        report["server_exit_code"] = proc.returncode
    (out / "report.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
