"""BERT-base at sequence 128 in fp16 on one GPU: plain eager PyTorch against the best torch options.

Side by side in one process, at each batch size: the torch engine with no CUDA graph and no
compile (plain eager fp16, the baseline), with one captured CUDA graph per (batch, length)
(the engine's GPU default), and with `torch.compile` (`default` mode, its kernels replayed in the
runner's CUDA graph); `--variants` adds `compile_fp8` (`precision: fp8`), `compile_fp8_full`
(its products accumulated in full fp32) and `*_masked` (the attention mask applied to every
batch, `dense_attention: false`, against the engine's default of running batches without
padding without it). Every point is a `run_bench` point: warm-up excluded, device-synchronized,
host→device copies of the int64 ids and masks counted, minimum duration and query count, outputs
checked against the fp32 CPU reference. Needs the `hf` extra (transformers); nothing is
downloaded (the network is BertConfig's defaults with random weights).

    python bench/transformers_gpu.py out.json
    python bench/transformers_gpu.py out.json --model hf:distilbert --batches 1,32 --seq 128

`--runtime` measures through plans (`run_plan`) instead, side by side in one process:
- a small space of plans at sequence 128 offline (plain eager fp16 at batches 32, 128 and 256
  against CUDA-graphed runners, batches 32 and 128, one or two instances): the best plan / the
  best eager plan;
- `--tune BUDGET` (seconds): first `infermux tune` (the library's `run_tune`) on the unit at
  sequence 128 — its space holds CUDA graphs, torch.compile per (batch, length) bucket and
  instances — and its written plan measured beside the eager plans (`tuned_vs_eager`; the
  hand-made graph plans are left out); the mixed-lengths runs then use the tuned plan's
  replica;
- mixed lengths: the best plan's replica with each bucket set of `--mixed-sets` (`pow2`: 32,
  64, 128, 256; `fine`: eight steps of 32; the tuner's candidates for `uniform:16-256`) and
  queries of `uniform:16-256` tokens, in tokens/s, against the same replica at the fixed mean
  length (136, compiled at 136), all with `--mixed-buckets` batch buckets (pow2 by default;
  `none` builds one runner per length, what a compiled plan wants), so each ratio is what
  padding to that set costs;
- `--only-mixed`: the mixed-lengths runs alone, at `--batches`' first batch (the engine's
  defaults: CUDA graphs on a GPU; the same command measures it on the CPU with `--unit cpu`).
- with `--perf-analyzer PATH`, the best plan served (`infermux serve --fronts N` for each N of
  `--fronts`, 1 and 8 by default, behind each `--front`: own, triton) over gRPC,
  perf_analyzer sending every input (INT64 ids and masks of ones, `--input-data tokens`, or
  everything zero-filled, `zero`) at sequence 128 and rising concurrency, with each
  `--shared-memory` mode: the highest requests/s whose p99 holds 50 ms, against the plan's
  offline items/s; `--serve-plan b256x2:compile=default,precision=fp8` measures that plan
  beside eager b128 and b256 (in place of the space) and serves it.

    python bench/transformers_gpu.py out.json --runtime --perf-analyzer /tmp/opt/perf_analyzer
    python bench/transformers_gpu.py out.json --runtime --tune 90 --mixed-sets fine \
        --mixed-buckets none
    python bench/transformers_gpu.py out.json --runtime --tune 120 --tune-scenario server \
        --perf-analyzer /tmp/opt/perf_analyzer --fronts 2 --front triton --mixed-sets ''
    python bench/transformers_gpu.py out.json --runtime --only-mixed --unit cpu \
        --model hf:FOLDER --batches 8 --min-duration 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from infermux.bench import BenchConfig, run_bench
from infermux.models import ModelSpec, load_model

VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {"cuda_graph": False},
    "cuda_graph": {"cuda_graph": True},
    "compile_default": {"compile": "default"},
    "compile_fp8": {"compile": "default", "precision": "fp8"},
    # The same with the attention mask applied to every batch (no mask-free graph).
    "compile_fp8_masked": {"compile": "default", "precision": "fp8", "dense_attention": False},
    "compile_default_masked": {"compile": "default", "dense_attention": False},
    # FP8 products accumulated in full fp32 (not the tensor cores' fast mode).
    "compile_fp8_full": {"compile": "default", "precision": "fp8", "fp8_fast_accum": False},
}


def _serve_plan(text: str) -> tuple[int, int, dict[str, Any]]:
    """Batch, instances and torch options from `--serve-plan` ("b128x2:compile=default")."""
    shape, _, opts = text.partition(":")
    batch, _, instances = shape.removeprefix("b").partition("x")
    options: dict[str, Any] = {}
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        options[key] = {"true": True, "false": False}.get(value, value)
    try:
        return int(batch), int(instances or 1), options
    except ValueError:
        raise SystemExit(f"--serve-plan {text!r}: expected bBATCH[xINSTANCES][:key=value,...], "
                         "e.g. b128x2:compile=default") from None


def _plan(model: str, unit: str, batch: int, options: dict[str, Any], *, instances: int = 1,
          seq_buckets: list[int], lengths: str | int, duration_s: float,
          buckets: str | list[int] = "none") -> dict[str, Any]:
    return {"name": "bert", "models": [{"name": "bert", "model": model, "seq_buckets": seq_buckets,
            "replicas": [{"unit": unit, "engine": "torch", "instances": instances,
                          "batch": batch, "batch_buckets": buckets, "options": options}]}],
            "load": {"scenario": "offline", "min_duration_s": duration_s, "min_queries": 1024,
                     "lengths": lengths}}


def _offline(plan: dict[str, Any]) -> dict[str, Any]:
    from infermux.runtime import parse_plan, run_plan

    t0 = time.perf_counter()
    try:
        report = run_plan(parse_plan(plan))
    except Exception as exc:  # noqa: BLE001 - one plan's failure is its row, the rest run on
        return {"error": f"{type(exc).__name__}: {exc}", "wall_s": time.perf_counter() - t0}
    final = report.final
    model = final.models.get("bert") if final is not None else None
    return {"items_per_s": final.items_per_s if final else None,
            "tokens_per_s": final.tokens_per_s if final else None,
            "mean_length": model.mean_length if model else None,
            "valid": final.valid if final else None,
            "p99_ms": final.latency.p99_ms if final and final.latency else None,
            "status": report.status,
            "build_s": report.build.get("build_s"), "wall_s": time.perf_counter() - t0}


def _served(args: argparse.Namespace, plan: dict[str, Any], offline_items_per_s: float | None,
            fronts: int, front: str = "own") -> dict[str, Any]:
    """The plan behind `infermux serve --fronts N --front F`, driven by perf_analyzer.

    gRPC at the sequence length, each `--shared-memory` mode at each concurrency.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serve_gpu import pa_figures

    exe = args.perf_analyzer
    lib = Path(exe).resolve().parent / "lib"
    env = dict(os.environ)
    if lib.is_dir():
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(lib), env.get("LD_LIBRARY_PATH", "")])
    tmp = Path(tempfile.mkdtemp(prefix="infermux-bert-serve-"))
    plan_file = tmp / "bert.json"
    plan_file.write_text(json.dumps(plan))
    log = (tmp / "serve.log").open("w")
    extra = ["--front", front]
    if front == "triton" and args.triton_python_path:
        extra += ["--triton-python-path", args.triton_python_path]
    proc = subprocess.Popen([sys.executable, "-m", "infermux", "serve", str(plan_file),
                             "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
                             "--json", "--fronts", str(fronts), "--no-store", "--telemetry", "off",
                             *extra],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        return {"error": f"the server did not start: see {log.name}"}
    ready = json.loads(line)
    rows = []
    try:
        levels = [(m, int(c)) for m in args.shared_memory.split(",")
                  for c in args.concurrency.split(",")]
        for shm, concurrency in levels:
            csv_file = tmp / f"pa-{shm}-{concurrency}.csv"
            cmd = [exe, "-m", "bert", "-u", f"127.0.0.1:{ready['grpc_port']}", "-i", "grpc",
                   "--concurrency-range", f"{concurrency}:{concurrency}",
                   "--measurement-interval", "4000", "--stability-percentage", "20",
                   "--max-trials", "5", "--shared-memory", shm, "--input-data",
                   pa_input_data(ready["models"][0]["inputs"], args.seq, args.input_data, tmp),
                   "-f", str(csv_file)]
            for spec in ready["models"][0]["inputs"]:
                cmd += ["--shape", f"{spec['name']}:{args.seq}"]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            row: dict[str, Any] = {"concurrency": concurrency, "shared_memory": shm,
                                   "command": " ".join(cmd)}
            if done.returncode != 0 or not csv_file.exists():
                row["error"] = (done.stdout + done.stderr)[-400:]
            else:
                row.update(pa_figures(csv_file))
            print(f"served {front} fronts {fronts} shm {shm} c{concurrency:<4d} "
                  f"{row.get('requests_per_s') or 0:10.1f} req/s "
                  f"p99 {row.get('p99_ms') or 0:7.2f} ms (server compute "
                  f"{(row.get('server_compute_us') or 0) / 1e3:.1f} ms, outside "
                  f"{(row.get('outside_us') or 0) / 1e3:.1f} ms) {row.get('error', '')}",
                  flush=True)
            rows.append(row)
    finally:
        import signal

        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    held = [r for r in rows if r.get("p99_ms") is not None and r["p99_ms"] <= args.p99_ms]
    best = max(held, key=lambda r: r["requests_per_s"], default=None)
    return {"fronts": fronts, "front": front, "rows": rows, "p99_bound_ms": args.p99_ms,
            "best_within_bound": best,
            "served_vs_offline": (best["requests_per_s"] / offline_items_per_s
                                  if best and offline_items_per_s else None)}


def pa_input_data(inputs: list[dict[str, Any]], seq: int, kind: str, folder: Path) -> str:
    """perf_analyzer's `--input-data` for token inputs: `zero`, or a JSON file of `tokens`.

    `tokens`: what a tokenizer sends for unpadded text, four requests' worth: ids drawn from a
    BERT vocabulary's word range, masks of ones, token types of zeros. Zero-filled inputs have
    masks of zeros, a batch no client sends (every position masked).
    """
    if kind == "zero":
        return "zero"
    rng = np.random.default_rng(0)
    data = []
    for _ in range(4):
        entry = {}
        for spec in inputs:
            name = spec["name"]
            if "mask" in name:
                content = [1] * seq
            elif "type" in name:
                content = [0] * seq
            else:
                content = rng.integers(1000, 30000, seq).tolist()
            entry[name] = {"content": content, "shape": [seq]}
        data.append(entry)
    path = folder / "tokens.json"
    path.write_text(json.dumps({"data": data}))
    return str(path)


def _outputs_factory(model: str, names: list[str]) -> str:
    """`FILE:build` of the `hf:` network `model` returning only the outputs `names`."""
    if not model.startswith("hf:"):
        raise SystemExit(f"--served-outputs takes an hf: model, not {model!r}")
    path = Path(tempfile.mkdtemp(prefix="infermux-bert-outputs-")) / "outputs_of.py"
    path.write_text(
        "from infermux import hf\n\n\n"
        "def build():\n"
        f"    net = hf.build({model.removeprefix('hf:')!r})\n"
        f"    keep = [t for t in net.outputs if t.name in {names!r}]\n"
        f"    if len(keep) != {len(names)}:\n"
        "        raise ValueError('the network has only ' + repr(net.output_names))\n"
        "    net.outputs = keep\n"
        "    net.output_names = [t.name for t in keep]\n"
        "    return net\n")
    return f"{path}:build"


def _tuned(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """`run_tune` on the unit at sequence `--seq`: (its written plan, a summary of the tune)."""
    from infermux.tune import Constraints, TrialSettings, TuneRequest, run_tune

    t0 = time.perf_counter()
    # The server scenario's tune judges each candidate's peak rate within `--p99-ms` (the bound
    # the served rows are held to), so the plan it writes is the one meant to be served.
    server = args.tune_scenario == "server"
    request = TuneRequest(models=[ModelSpec(args.model)], units=args.unit, engines="torch",
                          budget_s=args.tune, max_instances=2, pipelines=False,
                          scenario=args.tune_scenario,
                          constraints=Constraints(p99_bound_ms=args.p99_ms if server else None),
                          trial=TrialSettings(lengths=str(args.seq)))
    report = run_tune(request)
    if report.plan is None:
        raise SystemExit("the tune found no plan")
    best = report.result.best
    summary = {"best": best.candidate.label() if best else None,
               "best_items_per_s": best.items_per_s if best else None,
               "measured": report.result.measured, "wall_s": time.perf_counter() - t0,
               "trials": [t.to_dict() for t in report.result.trials]}
    print(f"tuned: {summary['best']} {summary['best_items_per_s'] or 0:.1f} items/s "
          f"({summary['measured']} trials, {summary['wall_s']:.0f} s)", flush=True)
    return report.plan, summary


#: Bucket sets the mixed-lengths runs may compare (`--mixed-sets`).
MIXED_SETS = {"pow2": [32, 64, 128, 256], "fine": [32, 64, 96, 128, 160, 192, 224, 256]}


def _mixed(args: argparse.Namespace, batch: int, options: dict[str, Any],
           instances: int) -> dict[str, Any]:
    """The plan's replica at mixed lengths with each bucket set, against the fixed mean length."""
    low, high = 16, 256
    mean = (low + high) // 2
    mixed_runs: dict[str, Any] = {}
    for set_name in args.mixed_sets.split(","):
        mixed_runs[set_name] = _offline(_plan(
            args.model, args.unit, batch, options, instances=instances,
            seq_buckets=MIXED_SETS[set_name], lengths=f"uniform:{low}-{high}",
            duration_s=args.min_duration, buckets=args.mixed_buckets))
    fixed = _offline(_plan(args.model, args.unit, batch, options, instances=instances,
                           seq_buckets=[mean], lengths=mean, duration_s=args.min_duration,
                           buckets=args.mixed_buckets))
    for name, p in (*((f"mixed {k}", v) for k, v in mixed_runs.items()), (f"fixed {mean}", fixed)):
        print(f"{name:19s} {p.get('items_per_s') or 0:10.1f} items/s "
              f"{p.get('tokens_per_s') or 0:12.0f} tok/s mean length {p.get('mean_length')} "
              f"{p.get('error', '')}", flush=True)

    def ratio(run: dict[str, Any]) -> float | None:
        return (run["tokens_per_s"] / fixed["tokens_per_s"]
                if run.get("tokens_per_s") and fixed.get("tokens_per_s") else None)

    first = next(iter(mixed_runs))
    return {"lengths": f"uniform:{low}-{high}", "batch": batch, "options": options,
            "instances": instances, "batch_buckets": args.mixed_buckets,
            "seq_buckets": MIXED_SETS[first], "mixed": mixed_runs[first],
            "fixed": fixed, "fixed_length": mean,
            "mixed_vs_fixed_tokens": ratio(mixed_runs[first]),
            "by_set": {k: {"seq_buckets": MIXED_SETS[k], "run": v,
                           "mixed_vs_fixed_tokens": ratio(v)}
                       for k, v in mixed_runs.items()}}


def runtime_main(args: argparse.Namespace) -> dict[str, Any]:
    """Plans through the runtime: the best of a small space vs eager, mixed lengths, served."""
    seq = args.seq
    space = {
        "eager b32": (32, {"cuda_graph": False}, 1),
        "eager b128": (128, {"cuda_graph": False}, 1),
        "eager b256": (256, {"cuda_graph": False}, 1),
        "graph b32": (32, {"cuda_graph": True}, 1),
        "graph b128": (128, {"cuda_graph": True}, 1),
        "graph b64 x2": (64, {"cuda_graph": True}, 2),
    }
    plans: dict[str, Any] = {}
    if args.serve_plan:  # the given plan beside eager's two largest batches, then served
        batch, instances, options = _serve_plan(args.serve_plan)
        space = {k: v for k, v in space.items() if k in ("eager b128", "eager b256")}
        space["given"] = (batch, options, instances)
    if args.tune:
        # The tuned plan takes the place of the hand-made graph plans; eager is the baseline.
        space = {k: v for k, v in space.items() if k.startswith("eager")}
    if args.only_mixed:
        space = {"given": (int(args.batches.split(",")[0]), {}, 1)}
    for name, (batch, options, instances) in space.items():
        if args.only_mixed:
            plans[name] = {"skipped": "--only-mixed"}
            continue
        plans[name] = _offline(_plan(args.model, args.unit, batch, options, instances=instances,
                                     seq_buckets=[seq], lengths=seq,
                                     duration_s=args.min_duration))
        p = plans[name]
        print(f"plan {name:14s} {p.get('items_per_s') or 0:10.1f} items/s "
              f"{p.get('tokens_per_s') or 0:12.0f} tok/s {p.get('error', '')}", flush=True)
    tune_summary = None
    tuned_buckets: str | list[int] | None = None
    if args.tune and not args.only_mixed:
        tuned_plan, tune_summary = _tuned(args)
        # Offline batches fill: measured with one runner per length, as the tuner's trials
        # were (the written plan's pow2 buckets would compile every smaller batch too).
        replica = tuned_plan["models"][0]["replicas"][0]
        tuned_buckets = replica.get("batch_buckets")
        space["tuned"] = (replica["batch"], replica.get("options") or {},
                          replica.get("instances", 1))
        plans["tuned"] = _offline(_plan(args.model, args.unit, replica["batch"],
                                        replica.get("options") or {},
                                        instances=replica.get("instances", 1),
                                        seq_buckets=[seq], lengths=seq,
                                        duration_s=args.min_duration))
        p = plans["tuned"]
        print(f"plan {'tuned':14s} {p.get('items_per_s') or 0:10.1f} items/s "
              f"{p.get('tokens_per_s') or 0:12.0f} tok/s {p.get('error', '')}", flush=True)
    eager = max((p.get("items_per_s") or 0 for n, p in plans.items() if n.startswith("eager")),
                default=0)
    best_name = max(plans, key=lambda n: plans[n].get("items_per_s") or 0)
    if "tuned" in plans:
        best_name = "tuned"
    if args.serve_plan:
        best_name = "given"
    best = plans[best_name]
    batch, options, instances = space[best_name]
    out: dict[str, Any] = {
        "plans": plans, "best_plan": best_name, "tune": tune_summary,
        "best_vs_eager": (best.get("items_per_s") or 0) / eager if eager else None,
        "tuned_vs_eager": ((plans["tuned"].get("items_per_s") or 0) / eager
                           if "tuned" in plans and eager else None),
        "given_vs_eager": ((plans["given"].get("items_per_s") or 0) / eager
                           if "given" in plans and eager else None)}
    if args.mixed_sets:
        out["mixed_lengths"] = _mixed(args, batch, options, instances)
    if args.perf_analyzer:
        served_model, offline_items_per_s = args.model, best.get("items_per_s")
        if args.served_outputs:
            # The network as a service that answers only these outputs (a factory module), its
            # offline figure measured again with the same outputs: the ratio's denominator.
            served_model = _outputs_factory(args.model, args.served_outputs.split(","))
            again = _offline(_plan(served_model, args.unit, batch, options,
                                   instances=instances, seq_buckets=[seq], lengths=seq,
                                   duration_s=args.min_duration))
            out["served_outputs"] = {"outputs": args.served_outputs.split(","),
                                     "model": served_model, "offline": again}
            offline_items_per_s = again.get("items_per_s")
            print(f"plan {'outputs ' + args.served_outputs:14s} "
                  f"{offline_items_per_s or 0:10.1f} items/s {again.get('error', '')}", flush=True)
        # The tuned plan is served with the batch buckets it was tuned with, unless given.
        buckets: str | list[int] = args.serve_buckets or tuned_buckets or "pow2"
        if isinstance(buckets, str) and buckets not in ("pow2", "fine", "none"):
            buckets = [int(b) for b in buckets.split(",")]
        served_plan = _plan(served_model, args.unit, batch, options, instances=instances,
                            seq_buckets=[seq], lengths=seq, duration_s=args.min_duration,
                            buckets=buckets)
        by_fronts = {f"{k} {n}": _served(args, served_plan, offline_items_per_s, n, k)
                     for n in (int(f) for f in args.fronts.split(","))
                     for k in args.front.split(",")}
        out["served_by_fronts"] = by_fronts
        out["served"] = max(by_fronts.values(),
                            key=lambda s: s.get("served_vs_offline") or 0.0)
    print(json.dumps({k: v for k, v in out.items() if k != "plans"}, indent=1, default=str))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--model", default="hf:bert-base")
    parser.add_argument("--unit", default="cuda:0/fp16")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--min-duration", type=float, default=3.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--runtime", action="store_true",
                        help="measure plans through the runtime (and serve) instead")
    parser.add_argument("--perf-analyzer", help="with --runtime: serve the best plan and "
                        "drive it with this perf_analyzer over gRPC")
    parser.add_argument("--only-mixed", action="store_true",
                        help="with --runtime: only the mixed-lengths pair")
    parser.add_argument("--concurrency", default="16,64,128,256")
    parser.add_argument("--served-outputs", default="",
                        help="serve only these outputs (comma-separated names, e.g. "
                             "pooler_output), with the offline figure of the same")
    parser.add_argument("--fronts", default="1,8",
                        help="front processes to serve with, each measured in turn (1: the "
                             "server process alone)")
    parser.add_argument("--front", default="own",
                        help="serve --front for the served runs: own, triton, or own,triton")
    parser.add_argument("--triton-python-path",
                        help="--front triton: a numpy<2 install for its model instances")
    parser.add_argument("--shared-memory", default="none",
                        help="perf_analyzer --shared-memory modes, each at every concurrency "
                             "(none, system)")
    parser.add_argument("--input-data", default="tokens", choices=("tokens", "zero"),
                        help="what perf_analyzer sends: `tokens` (ids, masks of ones) or "
                        "`zero` (every input zero-filled, masks of zeros)")
    parser.add_argument("--serve-plan",
                        help="with --runtime --perf-analyzer: measure and serve this plan "
                             "(bBATCH[xINSTANCES][:key=value,...]) in place of the space")
    parser.add_argument("--serve-buckets",
                        help="batch buckets of the served plan: pow2, fine, none or a list "
                             "(32,64,128); default: the tuned plan's, else pow2")
    parser.add_argument("--tune", type=float, default=0.0,
                        help="with --runtime: tune for this many seconds first and measure "
                        "the tuned plan beside eager (0: no tune)")
    parser.add_argument("--tune-scenario", default="offline", choices=("offline", "server"),
                        help="with --tune: the scenario tuned for (server: each candidate's "
                        "peak within --p99-ms; with --perf-analyzer the tuned plan is served)")
    parser.add_argument("--mixed-sets", default="pow2,fine",
                        help=f"bucket sets the mixed-length runs compare: {', '.join(MIXED_SETS)}"
                        " ('': no mixed-length runs)")
    parser.add_argument("--mixed-buckets", default="pow2",
                        help="batch buckets of the mixed and fixed runs: pow2 or none")
    parser.add_argument("--p99-ms", type=float, default=50.0)
    args = parser.parse_args()
    if args.serve_plan and (args.tune or args.only_mixed or not args.runtime
                            or not args.perf_analyzer):
        parser.error("--serve-plan serves one given plan: it needs --runtime and "
                     "--perf-analyzer, and takes neither --tune nor --only-mixed")
    batches = [int(b) for b in args.batches.split(",")]
    started = time.perf_counter()
    if args.runtime:
        result = runtime_main(args)
        with open(args.out, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "host": platform.node(),
                       "wall_s": time.perf_counter() - started, **result}, f, indent=1,
                      default=str)
        return
    runs: dict[str, Any] = {}
    # A network without a sequence dim (a ViT) is measured at its one shape.
    io = load_model(ModelSpec(args.model)).spec_io
    seq_buckets = [args.seq] if io.dynamic_dims else None
    for name in args.variants.split(","):
        config = BenchConfig(ModelSpec(args.model), units=args.unit, batches=batches,
                             engine="torch", min_duration_s=args.min_duration, min_queries=256,
                             warmup_s=1.0, options=VARIANTS[name], seq_buckets=seq_buckets,
                             telemetry_interval_s=None)
        t0 = time.perf_counter()
        report = run_bench(config)
        runs[name] = {"wall_s": time.perf_counter() - t0, **report.to_dict()}
        for r in runs[name]["results"]:
            print(f"{name:16s} b{r['batch']:<4d} seq{r['seq_len']} {r['status']:5s} "
                  f"{(r['items_per_s'] or 0):10.1f} items/s {(r['tokens_per_s'] or 0):12.0f} tok/s "
                  f"p99 {r.get('p99_ms') or 0:7.2f} ms build {r['build_s']:6.1f} s "
                  f"agree {(r['agreement'] or {}).get('status')} {r['error'] or ''}", flush=True)
    table = []
    for batch in batches:
        row: dict[str, Any] = {"batch": batch, "seq": args.seq}
        for name, run in runs.items():
            point = next(r for r in run["results"] if r["batch"] == batch)
            row[f"{name}_items_per_s"] = point["items_per_s"] if point["status"] == "ok" else None
            row[f"{name}_valid"] = point["valid"]
        base = row.get("eager_items_per_s")
        for name in runs:
            value = row.get(f"{name}_items_per_s")
            row[f"{name}_vs_eager"] = value / base if value and base else None
        table.append(row)
    best_eager = max((r["eager_items_per_s"] or 0 for r in table), default=0) if "eager" in runs else 0
    best = {name: max((r[f"{name}_items_per_s"] or 0 for r in table), default=0) for name in runs}
    summary = {"best_items_per_s": best,
               "best_vs_best_eager": {n: (v / best_eager if best_eager else None)
                                      for n, v in best.items()}}
    print(json.dumps({"table": table, "summary": summary}, indent=1))
    with open(args.out, "w") as f:
        json.dump({"command": "python bench/transformers_gpu.py " + " ".join(
                       f"{k}={v}" for k, v in vars(args).items()),
                   "host": platform.node(), "wall_s": time.perf_counter() - started,
                   "table": table, "summary": summary, "runs": runs}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
