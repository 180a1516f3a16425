"""Single-request latency of `infermux serve` over gRPC: where it goes, and the idle take.

A request of one item that reaches an idle server used to wait out the plan's
`max_queue_delay_ms` for a fuller batch (Triton's rule) before its worker took it. With
`take_when_idle` (the server's default now) a worker takes a partial batch at once when every
worker of the model is idle. This runs both rules side by side on the same plan, alternating
servers round by round (and a third server whose CPU worker is a pinned thread of the server
process instead of a child process: the hop where the rest of the latency goes), and splits
each request's mean latency into the server's own statistics (queue wait, compute as the
worker timed it, admission to answer) and what remains (the gRPC front and client).

    .venv/bin/python bench/serve_latency.py --out /tmp/slat
    .venv/bin/python bench/serve_latency.py --rounds 3 --concurrency 1,8 --duration 8
    .venv/bin/python bench/serve_latency.py --variants "wait (before),idle take (after)"
    .venv/bin/python bench/serve_latency.py --variants "one batch in the child,idle take (after)"

Each level is bench/serve_load.py (closed loop, gRPC); throughput at concurrency 8 shows
what the rule costs under load (there workers are busy and batches fill as before).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from serve_cpu import ENV, INFERMUX, load_client, write_plan  # noqa: E402

#: name → (extra `infermux serve` flags, dispatcher settings changed in the plan)
VARIANTS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "wait (before)": (["--wait-when-idle"], {}),
    "idle take (after)": ([], {}),
    # The worker as a pinned thread of the server process: no hop to a child process.
    "idle take + thread worker": ([], {"cpu_workers": "thread"}),
    # The child process gets each batch only after its previous answer was read (the relay
    # idles its core every batch), against the default: the next batch waits in its pipe.
    "one batch in the child": ([], {"cpu_in_flight": 1}),
}
#: What runs without --variants.
DEFAULT_VARIANTS = ("wait (before)", "idle take (after)", "idle take + thread worker")


def start(plan: Path, out: Path, extra: list[str]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen([*INFERMUX, "serve", str(plan), "--http-port", "0", "--grpc-port", "0",
                             "--metrics-port", "0", "--json", "--no-store", "--telemetry", "off",
                             *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def stats(http: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{http}/v2/models/mobilenet/stats", timeout=10) as r:
        s = json.loads(r.read())["model_stats"][0]
    inf = s["inference_stats"]
    return {"requests": inf["success"]["count"], "request_ns": inf["success"]["ns"],
            "items": inf["queue"]["count"], "queue_ns": inf["queue"]["ns"],
            "compute_ns": inf["compute_infer"]["ns"], "batches": s["execution_count"]}


def level(ready: dict[str, Any], c: int, duration: float) -> dict[str, Any]:
    http = f"127.0.0.1:{ready['http_port']}"
    before = stats(http)
    row = load_client(f"127.0.0.1:{ready['grpc_port']}", "grpc", c, duration)
    after = stats(http)
    d = {k: after[k] - before[k] for k in after}
    per_item = max(1, d["items"])
    row["server_request_ms"] = d["request_ns"] / max(1, d["requests"]) / 1e6
    row["queue_ms"] = d["queue_ns"] / per_item / 1e6
    row["compute_ms"] = d["compute_ns"] / per_item / 1e6
    row["mean_batch"] = d["items"] / max(1, d["batches"])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="serve-latency-results")
    p.add_argument("--model", default="mobilenet_v3_small")
    p.add_argument("--unit", default="cpu:1")
    p.add_argument("--engine", default="onnxruntime")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--queue-delay-ms", type=float, default=2.0)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma list of: {', '.join(VARIANTS)}")
    args = p.parse_args()
    chosen = {v: VARIANTS[v] for v in args.variants.split(",")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.duration, duration = 10.0, args.duration  # write_plan's offline duration (unused here)
    base = write_plan(out, args)
    plans = {}
    for name, (_, changes) in chosen.items():
        data = json.loads(base.read_text())
        data["dispatcher"].update(changes)
        plans[name] = out / f"plan-{len(plans)}.yaml"
        plans[name].write_text(json.dumps(data, indent=2))
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for name, (extra, _) in chosen.items():
            proc, ready = start(plans[name], out, extra)
            try:
                for c in levels:
                    row = {"round": rnd, "variant": name, "concurrency": c,
                           **level(ready, c, duration)}
                    rows.append(row)
                    print(f"round {rnd} {name:18s} c{c}: {row['throughput']:7.1f}/s  "
                          f"p50 {row['p50_ms']:6.2f}  p99 {row['p99_ms']:6.2f} ms  "
                          f"(server {row['server_request_ms']:.2f}: queue {row['queue_ms']:.2f}"
                          f" + compute {row['compute_ms']:.2f}; batch {row['mean_batch']:.2f})",
                          flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.communicate(timeout=120)
    report = {"plans": {n: json.loads(p.read_text()) for n, p in plans.items()},
              "machine": os.uname().nodename, "load_average": os.getloadavg(), "rows": rows}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"report in {out / 'report.json'}")


if __name__ == "__main__":
    main()
