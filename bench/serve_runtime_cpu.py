"""The runtime process's CPU per served request, for a model of three token inputs.

`infermux serve --fronts 2` of a module that takes BERT's three INT64 inputs (ids, mask, token
types, length 128) and does almost nothing with them (an embedding lookup), so the runtime
process's CPU time is the serving path's own: admission, the dispatcher, the worker's gather
and the answers (CPU workers as threads, in that process). perf_analyzer drives it over gRPC
at `--concurrency` with ids and masks of ones; the runtime process's CPU seconds over the
measurement, per request answered. With several `--src` trees (e.g. a worktree of an earlier
commit) each round serves them one after another, so they are compared on one machine.
`--py-spy PATH` samples the runtime process for 5 s of each measurement (`--gil`: only the
thread holding the interpreter lock) and prints the shares per thread and frame; compare the
CPU figures of runs without it. `--module image` serves a one-input module instead (an 8×8
image into a linear layer): the path ResNet50's requests take. `--front triton` serves it
behind Triton's server (its batches reach the runtime as descriptors of several rows);
`--triton-queue-delay 0,0.3ms` serves each tree at each of Triton's queue delays in turn.

    python bench/serve_runtime_cpu.py --perf-analyzer /tmp/pa/opt/perf_analyzer \
        --src /tmp/base/src,src --rounds 2 --concurrency 64
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import transformers_gpu
from serve_bert_profile import _spy_summary

MODULE = '''
import torch


class Tokens(torch.nn.Module):
    inputs = [{"name": "input_ids", "dtype": "int64", "shape": ["seq"], "high": 30522},
              {"name": "attention_mask", "dtype": "int64", "shape": ["seq"], "values": "ones"},
              {"name": "token_type_ids", "dtype": "int64", "shape": ["seq"], "high": 2}]
    outputs = [{"name": "pooler_output", "dtype": "float32", "shape": [16]}]
    default_dims = {"seq": 128}
    mask_input = "attention_mask"

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(30522, 16)

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.emb(input_ids[:, 0]) + attention_mask[:, :1] + token_type_ids[:, :1]


def build():
    return Tokens()
'''

#: `--module image`: one small float input (digits-cnn's 8×8), one output: the path ResNet50's
#: requests take, with the model's own work negligible.
IMAGE_MODULE = '''
import torch


class Image(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(x.flatten(1))


def build():
    return Image()
'''


def _one(src: str, folder: Path, args: argparse.Namespace, delay: str | None = None,
         ) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    log = (folder / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "infermux", "serve", str(folder / "plan.json"), "--http-port",
         "0", "--grpc-port", "0", "--metrics-port", "0", "--json", "--fronts", str(args.fronts),
         "--front", args.front, "--no-store", "--telemetry", "off",
         *(["--triton-queue-delay", delay] if delay is not None else [])],
        stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    assert server.stdout is not None
    line = server.stdout.readline()
    if not line:
        raise SystemExit(f"the server of {src} did not start: see {folder / 'serve.log'}")
    ready = json.loads(line)
    image = args.module == "image"
    data = ("random" if image else
            transformers_gpu.pa_input_data(ready["models"][0]["inputs"], 128, "tokens", folder))
    cmd = [args.perf_analyzer, "-m", "m", "-u", f"127.0.0.1:{ready['grpc_port']}", "-i", "grpc",
           "--concurrency-range", f"{args.concurrency}:{args.concurrency}",
           "--measurement-interval", "6000", "--max-trials", "3", "--stability-percentage", "50",
           "--input-data", data]
    for spec in [] if image else ready["models"][0]["inputs"]:
        cmd += ["--shape", f"{spec['name']}:128"]
    lib = Path(args.perf_analyzer).resolve().parent / "lib"
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, LD_LIBRARY_PATH=str(lib)))
    runtime = psutil.Process(server.pid)
    time.sleep(4)  # past perf_analyzer's warm-up
    cpu0, t0 = sum(runtime.cpu_times()[:2]), time.perf_counter()
    spy = None
    if args.py_spy:  # the runtime process's stacks, holding the interpreter lock or not
        raw = folder / f"spy-{abs(hash(src))}.txt"
        subprocess.run([args.py_spy, "record", "--pid", str(server.pid), "--duration", "5",
                        "--rate", "200", "--format", "raw", "--output", str(raw),
                        "--nonblocking", "--threads", *(["--gil"] if args.gil else [])],
                       capture_output=True, check=False)
        spy = _spy_summary(raw) if raw.exists() else None
    shown = client.communicate(timeout=300)[0]
    cpu1, t1 = sum(runtime.cpu_times()[:2]), time.perf_counter()
    server.send_signal(signal.SIGTERM)
    server.communicate(timeout=60)
    rates = [float(ln.split()[-2]) for ln in shown.splitlines() if "Throughput:" in ln]
    rate = rates[-1] if rates else 0.0
    cores = (cpu1 - cpu0) / (t1 - t0)
    return {"src": src, "triton_queue_delay": delay, "requests_per_s": rate, "runtime_cores": cores,
            "runtime_us_per_request": 1e6 * cores / rate if rate else None, "py_spy": spy}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--perf-analyzer", required=True)
    p.add_argument("--src", default="src", help="comma list of source trees to compare")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--module", choices=("tokens", "image"), default="tokens",
                   help="three token inputs (BERT's path) or one small image (ResNet50's)")
    p.add_argument("--json", default=None)
    p.add_argument("--front", choices=("own", "triton"), default="own",
                   help="serve --front: triton hands the runtime each Triton batch as one "
                   "descriptor of several rows")
    p.add_argument("--fronts", type=int, default=2)
    p.add_argument("--triton-queue-delay",
                   help="--front triton: a comma list of serve's --triton-queue-delay values, "
                   "each served in turn (default: the backend's own)")
    p.add_argument("--py-spy", help="py-spy executable: sample the runtime process for 5 s")
    p.add_argument("--gil", action="store_true", help="with --py-spy: only the lock's holder")
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="infermux-runtime-cpu-"))
    replicas = [{"unit": "cpu", "engine": "torch", "batch": 64, "batch_buckets": [16, 32, 64]}]
    if args.module == "image":
        (folder / "image_module.py").write_text(IMAGE_MODULE)
        model = {"name": "m", "model": f"{folder}/image_module.py:build",
                 "input_shape": [1, 8, 8], "replicas": replicas}
    else:
        (folder / "tokens_module.py").write_text(MODULE)
        model = {"name": "m", "model": f"{folder}/tokens_module.py:build",
                 "seq_buckets": [128], "replicas": replicas}
    plan = {"name": args.module, "models": [model], "dispatcher": {"cpu_workers": "thread"}}
    (folder / "plan.json").write_text(json.dumps(plan))
    rows = []
    delays: list[str | None] = (args.triton_queue_delay.split(",") if args.triton_queue_delay
                                else [None])
    for k in range(args.rounds):
        for src, delay in [(s, d) for s in args.src.split(",") for d in delays]:
            row = {"round": k + 1, **_one(src, folder, args, delay)}
            rows.append(row)
            label = src if delay is None else f"{src} (Triton's delay {delay})"
            print(f"round {k + 1} {label}: {row['requests_per_s']:.0f} requests/s, runtime process "
                  f"{row['runtime_cores']:.2f} cores, {row['runtime_us_per_request'] or 0:.0f} "
                  "us of its CPU per request", flush=True)
            for part in ("by_thread", "own", "inclusive"):
                for frame, share in (row["py_spy"] or {}).get(part, []):
                    print(f"  {part:9s} {share:.3f} {frame[:150]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": "python " + " ".join(sys.argv),
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
