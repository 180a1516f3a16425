"""The served targets on one GPU host, in one command: ResNet50 and BERT-base through Triton's front.

Each served figure moves by host, so it counts only where it holds on each of several fresh
hosts. This runs, on the host it is started on, the two measurements those figures come from
(docs/benchmarks.md, "Triton's front with the native backend" and the sections after it) and
prints each target beside its bound:

- ResNet50 fp16, the server tune's b64 ×2 shape, served through Triton's front (2 native
  instances, gRPC, single-image requests): the highest rate within p99 15 ms against the plan's
  offline figure, with the tensors in system shared memory (target ≥ 0.7) and in the request
  (≥ 0.4) (`bench/serve_gpu.py`);
- BERT-base at sequence 128, the b128 ×2 FP8 plan: the plan against eager fp16 at eager's best
  batch (≥ 1.5×) and served over gRPC, answering its pooled output, within p99 50 ms against
  its offline figure (≥ 0.7) (`bench/transformers_gpu.py`).

The host's own speed goes beside them (`host_speed`: one Python core's time for a fixed loop,
a host memory copy, the CPU's name and cores): a served figure is bound by the runtime
process's interpreter lock, so it moves with one core's speed, which differs by host.

`--bert-options` adds torch options to the BERT plan (e.g. `wait=sleep`); `--only` runs one of
the two; each step gets what is left of `--budget-s`, and a step that runs out is reported as
such with what it measured. `--summarize DIR` prints the table of a folder written before.

    python bench/served_targets_gpu.py --perf-analyzer /tmp/opt/perf_analyzer --out host-a
    python bench/served_targets_gpu.py --perf-analyzer PA --out host-a-sleep --only bert \
        --bert-options wait=sleep
    python bench/served_targets_gpu.py --summarize host-a
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STEPS = ("resnet50", "bert")
#: (target name, bound) as the issues state them.
TARGETS = {"resnet50 shared memory": 0.7, "resnet50 in the request": 0.4,
           "bert plan / eager": 1.5, "bert served": 0.7}


def _commands(args: argparse.Namespace, out: Path) -> dict[str, list[str]]:
    options = ",".join(filter(None, ["compile=default,precision=fp8", args.bert_options]))
    return {
        "resnet50": [sys.executable, str(HERE / "serve_gpu.py"), "--perf-analyzer",
                     args.perf_analyzer, "--models", "resnet50", "--fronts", "2", "--front",
                     "triton:native", "--protocols", "grpc", "--shared-memory", "system,none",
                     "--concurrency", args.resnet50_concurrency, "--json",
                     str(out / "resnet50.json")],
        "bert": [sys.executable, str(HERE / "transformers_gpu.py"), str(out / "bert.json"),
                 "--runtime", "--serve-plan", f"b128x2:{options}", "--serve-buckets",
                 "32,64,96,128", "--served-outputs", "pooler_output", "--perf-analyzer",
                 args.perf_analyzer, "--fronts", "2", "--front", "triton", "--concurrency",
                 args.bert_concurrency, "--shared-memory", "none", "--mixed-sets", ""],
    }


def host_speed() -> dict[str, Any]:
    """The host's CPU: its name, usable cores, and two timings, each the best of five.

    One Python core's time for a 5e6-step loop and a 256 MiB copy in memory (docs/benchmarks.md,
    hosts P-R: a host whose loop took twice as long served BERT-base at half the rate).
    """
    import numpy as np

    from infermux.train.reference import best_of

    name = ""
    with contextlib.suppress(OSError):
        name = next((line.split(":", 1)[1].strip() for line in
                     Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), "")
    a = np.ones(32 * 2**20)
    b = np.empty_like(a)
    return {"cpu": name, "cores": len(os.sched_getaffinity(0)),
            "python_loop_s": round(best_of(lambda: sum(i * i for i in range(5_000_000)))["s"], 4),
            "host_copy_gb_per_s": round(a.nbytes / best_of(lambda: np.copyto(b, a))["s"] / 1e9, 2)}


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summarize(out: Path) -> list[dict[str, Any]]:
    """One row per target from the folder's reports: its figure, bound and what it rests on."""
    rows: list[dict[str, Any]] = []
    resnet = _read(out / "resnet50.json")
    model = (resnet or {}).get("models", {}).get("resnet50", {})
    offline = (model.get("offline") or {}).get("items_per_s")
    errors = [e.strip() for e in [(model.get("offline") or {}).get("error"),
                                  *(s.get("error") for s in model.get("servers", []))] if e]
    for mode, name in (("system", "resnet50 shared memory"), ("none", "resnet50 in the request")):
        best = next((r for key, r in (model.get("best_within_bound") or {}).items()
                     if key.endswith(f"shm={mode}")), None)
        if best is None:
            tried = [r for r in model.get("served", []) if r.get("shared_memory") == mode
                     and "p99_ms" in r]
            why = ("not run" if resnet is None else
                   f"failed: {errors[0][:160]}" if not tried and errors else
                   "no level measured" if not tried else "no level within the bound (p99 "
                   + ", ".join(f"c{r['concurrency']} {r['p99_ms']:.1f} ms" for r in tried)
                   + ")")
            rows.append({"target": name, "figure": None, "detail": why})
            continue
        rows.append({"target": name, "figure": best.get("served_over_offline"),
                     "detail": f"c{best['concurrency']} {best['requests_per_s']:,.0f} requests/s, "
                               f"p99 {best['p99_ms']:.1f} ms, of {offline or 0:,.0f} offline"})
    bert = _read(out / "bert.json")
    plans = (bert or {}).get("plans", {})
    ratio = (bert or {}).get("given_vs_eager")
    failed = next((f"{name}: {p['error'][:160]}" for name, p in plans.items() if "error" in p),
                  None)
    rows.append({"target": "bert plan / eager", "figure": ratio,
                 "detail": "not run" if bert is None else
                 f"failed: {failed}" if ratio is None and failed else
                 "no ratio" if ratio is None else
                 f"{plans.get('given', {}).get('items_per_s', 0):,.0f} against eager b256 "
                 f"{plans.get('eager b256', {}).get('items_per_s', 0):,.0f} items/s"})
    served = (bert or {}).get("served") or {}
    best = served.get("best_within_bound")
    levels = ", ".join(f"c{r['concurrency']} {r['requests_per_s']:,.0f} ({r['p99_ms']:.1f} ms)"
                       for r in served.get("rows", []) if "requests_per_s" in r)
    offline_bert = ((bert or {}).get("served_outputs") or {}).get("offline", {}).get(
        "items_per_s")
    rows.append({"target": "bert served", "figure": served.get("served_vs_offline") if best
                 else None,
                 "detail": ("not run" if bert is None else
                            f"failed: {served['error'][:160]}" if "error" in served else
                            f"{levels or 'no level'}; of {offline_bert or 0:,.0f} offline")})
    for row in rows:
        bound = TARGETS[row["target"]]
        row["bound"] = bound
        # None: not measured here (not run, or stopped before it), neither met nor missed.
        row["met"] = (None if row["detail"] == "not run" else
                      row["figure"] is not None and row["figure"] >= bound)
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        figure = "–" if r["figure"] is None else f"{r['figure']:.2f}"
        status = "–" if r["met"] is None else "met" if r["met"] else "MISSED"
        print(f"{r['target']:26s} {figure:>5s} (≥ {r['bound']}) {status:6s} {r['detail']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="a folder for the reports and the summary")
    p.add_argument("--perf-analyzer", help="path of Triton's perf_analyzer")
    p.add_argument("--only", default=",".join(STEPS), help="resnet50, bert or both")
    p.add_argument("--budget-s", type=float, default=540.0, help="seconds for both steps")
    p.add_argument("--resnet50-concurrency", default="72,80,128,160")
    p.add_argument("--bert-concurrency", default="512,640")
    p.add_argument("--bert-options", default="",
                   help="torch options added to the BERT plan, e.g. wait=sleep")
    p.add_argument("--summarize", metavar="DIR", help="print the table of a folder written before")
    args = p.parse_args()
    if args.summarize:
        _print(summarize(Path(args.summarize)))
        return
    if not args.out or not args.perf_analyzer:
        p.error("give --out DIR and --perf-analyzer PATH (or --summarize DIR)")
    steps = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        p.error(f"--only {','.join(unknown)}: the steps are {', '.join(STEPS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    host = host_speed()
    print(f"host: {host['cpu']}, {host['cores']} cores, Python loop {host['python_loop_s']} s, "
          f"copy {host['host_copy_gb_per_s']} GB/s", flush=True)
    commands = _commands(args, out)
    began = time.monotonic()
    ran: dict[str, Any] = {}
    for step in steps:
        left = args.budget_s - (time.monotonic() - began)
        if left < 60:
            ran[step] = {"status": "skipped: the budget was spent"}
            continue
        with (out / f"{step}.log").open("w") as log:
            started = time.monotonic()
            try:
                code = subprocess.run(commands[step], stdout=log, stderr=subprocess.STDOUT,
                                      timeout=left, check=False).returncode
                status = "complete" if code == 0 else f"exit {code}"
            except subprocess.TimeoutExpired:
                status = "stopped at the budget"
        ran[step] = {"status": status, "wall_s": round(time.monotonic() - started, 1),
                     "command": " ".join(commands[step])}
        print(f"{step}: {status} ({ran[step]['wall_s']} s)", flush=True)
    rows = summarize(out)
    (out / "summary.json").write_text(json.dumps({"host": host, "steps": ran, "targets": rows},
                                                 indent=1))
    _print(rows)


if __name__ == "__main__":
    main()
