"""Where a served BERT request's time goes: perf_analyzer's server split, a trace, py-spy.

One server (`infermux serve --fronts 8`) of BERT-base as a service answering only
`pooler_output` (the factory module `transformers_gpu._outputs_factory` writes; `--front
triton`: behind Triton's server, `--fronts` instances), fp16 on
`cuda:0`, batch `--batch` × `--instances` with `torch.compile` `default`; perf_analyzer over
gRPC at `--concurrency` (a perf_analyzer range, e.g. 128:256:128) with INT64 inputs of
length 128; with `--py-spy PATH`, six seconds of the runtime process's stacks (raw, 250 Hz)
summed per thread and per frame, then six of the lock holder's. Needs the `hf` and `serve`
extras (and a GPU for the default unit).

    python bench/serve_bert_profile.py --out prof --perf-analyzer /tmp/opt/perf_analyzer \
        --py-spy /tmp/pyspy/bin/py-spy
    python bench/serve_bert_profile.py --out prof --perf-analyzer PA --instances 2 \
        --concurrency 128:256:128
    python bench/serve_bert_profile.py --out prof --perf-analyzer PA --py-spy PY_SPY \
        --options compile=default,precision=fp8 --batch 128 --instances 2 --buckets 32,64,128 \
        --concurrency 256:384:128

`--options`, `--buckets`, `--model` and `--unit` set the plan (`--unit cpu --model hf:FOLDER`
runs it on the CPU); perf_analyzer sends ids and masks of ones (`--input-data tokens`). It
prints each server process's cores over the sampled seconds, the trace's gaps, and py-spy's
samples twice: of the running threads, and of the interpreter lock's holder (`--gil`).
Behind Triton's front, perf_analyzer's inference and execution counts say how many client
requests Triton put in each batch it handed on (`--triton-queue-delay` sets how long it waits
for them).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import transformers_gpu
from infermux.serve.trace import summarize


def _spy_summary(raw: Path) -> dict[str, list[tuple[str, float]]]:
    """Shares of the samples per thread, per innermost frame and per infermux frame."""
    own: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    by_thread: dict[str, collections.Counter[str]] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        threads[frames[0]] += n
        own[frames[-1]] += n
        by_thread.setdefault(frames[0], collections.Counter())[frames[-1]] += n
        for frame in set(frames[1:]):
            inclusive[frame] += n
    total = sum(threads.values()) or 1
    return {"threads": [(t, c / total) for t, c in threads.most_common(12)],
            "by_thread": [(f"{t} | {f}", c / total) for t, _ in threads.most_common(4)
                          for f, c in by_thread[t].most_common(8)],
            "own": [(f, c / total) for f, c in own.most_common(30)],
            "inclusive": [(f, c / total) for f, c in inclusive.most_common(300)
                          if "infermux" in f][:30]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the plan, logs, trace and report")
    p.add_argument("--perf-analyzer", required=True)
    p.add_argument("--py-spy", help="py-spy executable: profile the runtime process")
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--concurrency", default="128:128")
    p.add_argument("--options", default="compile=default",
                   help="torch options as in transformers_gpu's --serve-plan: "
                   "compile=default,precision=fp8")
    p.add_argument("--buckets", default="pow2", help="batch buckets: pow2 or 64,128,256")
    p.add_argument("--input-data", default="tokens", choices=("tokens", "zero"))
    p.add_argument("--fronts", type=int, default=8)
    p.add_argument("--front", default="own", choices=("own", "triton"),
                   help="who parses gRPC (serve --front); with triton, --fronts instances")
    p.add_argument("--triton-queue-delay",
                   help="--front triton: serve's --triton-queue-delay (default: the backend's)")
    p.add_argument("--model", default="hf:bert-base")
    p.add_argument("--unit", default="cuda:0/fp16")
    args = p.parse_args()
    _, _, options = transformers_gpu._serve_plan(f"b{args.batch}:{args.options}")
    buckets: str | list[int] = args.buckets
    if args.buckets not in ("pow2", "fine", "none"):
        buckets = [int(b) for b in args.buckets.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = transformers_gpu._outputs_factory(args.model, ["pooler_output"])
    plan = {"name": "bert", "models": [{"name": "bert", "model": model, "seq_buckets": [128],
            "replicas": [{"unit": args.unit, "engine": "torch", "instances": args.instances,
                          "batch": args.batch, "batch_buckets": buckets,
                          "options": options}]}]}
    (out / "plan.json").write_text(json.dumps(plan))
    trace = out / "trace.jsonl"
    started = time.monotonic()
    with (out / "serve.log").open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "infermux", "serve", str(out / "plan.json"), "--http-port", "0",
             "--grpc-port", "0", "--metrics-port", "0", "--json", "--fronts", str(args.fronts),
             "--front", args.front, "--no-store", "--telemetry", "off", "--trace-requests", "8",
             "--trace-file", str(trace),
             *(["--triton-queue-delay", args.triton_queue_delay]
               if args.triton_queue_delay is not None else [])],
            stdout=subprocess.PIPE, stderr=log, text=True)
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line:
            raise SystemExit(f"the server did not start: see {out / 'serve.log'}")
        ready = json.loads(line)
        report: dict[str, object] = {"plan": plan, "ready_s": time.monotonic() - started}
        cmd = [args.perf_analyzer, "-m", "bert", "-u", f"127.0.0.1:{ready['grpc_port']}", "-i",
               "grpc", "--concurrency-range", args.concurrency, "--measurement-interval", "5000",
               "--max-trials", "3", "--stability-percentage", "50", "--input-data",
               transformers_gpu.pa_input_data(ready["models"][0]["inputs"], 128,
                                              args.input_data, out)]
        for spec in ready["models"][0]["inputs"]:
            cmd += ["--shape", f"{spec['name']}:128"]
        lib = Path(args.perf_analyzer).resolve().parent / "lib"
        env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
            [str(lib), os.environ.get("LD_LIBRARY_PATH", "")]))
        began = time.perf_counter_ns()
        client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=env)
        import psutil

        tree = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True),
                psutil.Process(client.pid)]
        time.sleep(6)  # past perf_analyzer's warm-up
        cpu0: dict[int, float] = {}
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                cpu0[proc.pid] = sum(proc.cpu_times()[:2])
        t0 = time.perf_counter()
        if args.py_spy:
            # Threads while they run (py-spy's default), then only the one holding the
            # interpreter lock (`--gil`): who keeps the others waiting.
            for name, extra in (("spy.txt", []), ("spy-gil.txt", ["--gil"])):
                subprocess.run([args.py_spy, "record", "--pid", str(server.pid), "--duration",
                                "6", "--rate", "250", "--format", "raw", "--output",
                                str(out / name), "--nonblocking", "--threads", *extra],
                               capture_output=True, check=False)
        else:
            time.sleep(8)
        elapsed = time.perf_counter() - t0
        # Cores each process of the server used over those seconds (the runtime first).
        cores: dict[str, float] = {}
        for proc in tree:  # a child that has ended (a compile worker) is left out
            with contextlib.suppress(psutil.Error, KeyError):
                cores[f"{proc.pid} {' '.join(proc.cmdline()[:4])[-60:]}"] = round(
                    (sum(proc.cpu_times()[:2]) - cpu0[proc.pid]) / elapsed, 2)
        report["cores"] = cores
        shown = client.communicate(timeout=300)[0]
        ended = time.perf_counter_ns()
        server.send_signal(signal.SIGTERM)
        tail = server.communicate(timeout=120)[0]
    with contextlib.suppress(ValueError):  # the server's summary: its batches' mean size
        models = json.loads(tail[tail.index("{"):])["models"]
        report["mean_batch"] = {name: m.get("mean_batch") for name, m in models.items()}
    report["perf_analyzer"] = [ln.strip() for ln in shown.splitlines() if any(
        k in ln for k in ("Request concurrency", "Throughput", "p99 latency", "Avg request",
                          "Avg gRPC", "Inference count", "Execution count"))]
    report["trace"] = summarize(str(trace), (began, ended))
    if (out / "spy.txt").exists():
        report["py_spy"] = _spy_summary(out / "spy.txt")
    if (out / "spy-gil.txt").exists():
        report["py_spy_gil"] = _spy_summary(out / "spy-gil.txt")
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    print("\n".join(report["perf_analyzer"]))  # type: ignore[arg-type]
    print(f"mean batch {report.get('mean_batch')}")
    for name, cores in report["cores"].items():  # type: ignore[attr-defined]
        print(f"cores     {cores:5.2f} {name}")
    for gap, figures in report["trace"]["gaps"].items():  # type: ignore[index]
        print(f"gap       {gap:32s} p50 {figures['p50_ms']:7.2f} p99 {figures['p99_ms']:7.2f} "
              f"mean {figures['mean_ms']:7.2f} ms")
    for bucket, figures in report["trace"].get("batches", {}).items():  # type: ignore[union-attr]
        device = figures["device"] or {}
        idle = figures.get("idle_before") or {}
        print(f"bucket    {bucket:>5} requests {figures['requests']:6d} mean items "
              f"{figures['mean_items']:6.1f} device p50 {device.get('p50_ms', 0):7.2f} p99 "
              f"{device.get('p99_ms', 0):7.2f} mean {device.get('mean_ms', 0):7.2f} ms; idle "
              f"before it mean {idle.get('mean_ms', 0):6.2f} p99 {idle.get('p99_ms', 0):6.2f} ms")
    print(f"gathers   {report['trace'].get('gather_paths')}")  # type: ignore[union-attr]
    for kind, key in (("threads", "py_spy"), ("own", "py_spy"), ("inclusive", "py_spy"),
                      ("by_thread", "py_spy"), ("gil", "py_spy_gil")):
        part = "by_thread" if kind == "gil" else kind
        for frame, share in (report.get(key) or {}).get(part, []):  # type: ignore[attr-defined]
            print(f"{kind:9s} {share:.3f} {frame[:140]}")


if __name__ == "__main__":
    main()
