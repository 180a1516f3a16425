"""The runtime on a GPU, side by side in one run (ResNet50 fp16 by default).

1. 1 instance through the runtime vs a plain PyTorch loop (eager, and the same runner with its
   CUDA graph driven directly) at batch 64 and 256;
2. 4 instances vs 1 at batch 8 and 64, same data placement (host, copies timed), through the
   runtime and as a plain script (one thread, stream and CUDA graph per instance);
3. a cuda:0/fp16 + cpu plan vs the GPU-only plan: offline throughput, and server p99 at half
   the GPU-only offline rate (the CPU unit must not poison the tail);
4. server --find-peak with p99 <= 15 ms, as a fraction of offline throughput.
Prints a markdown table and writes everything as JSON to --out DIR.

    python bench/runtime_gpu.py --out results/          # on a GPU machine, a few minutes
    python bench/runtime_gpu.py --smoke --out /tmp/x    # the same logic on CPU units, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from infermux.bench import measure
from infermux.engines import create_engine
from infermux.models import ModelSpec, load_model
from infermux.runtime import parse_plan, run_plan
from infermux.units import discover, select_units


class Setup:
    """Where each part runs: real GPU units, or CPU stand-ins for --smoke."""

    def __init__(self, smoke: bool, duration_s: float, model: str, cpu_cores: str | None) -> None:
        self.smoke = smoke
        self.duration_s = duration_s
        cores = sorted(os.sched_getaffinity(0))
        if smoke:
            self.model, self.shape = "tests/tiny_models.py:tiny_cnn", [3, 32, 32]
            self.gpu_unit = f"cpu:{cores[0]}"
            self.multi_unit = f"cpu:{cores[0]}-{cores[min(1, len(cores) - 1)]}"
            self.cpu_unit = f"cpu:{cores[-1]}"
            self.multi = min(2, len(cores))
            self.big, self.small, self.mid = 16, 2, 8
            self.bound_ms = 50.0
            self.cpu_workers = "thread"
            self.gpu_instances = 1
        else:
            self.model, self.shape = model, [3, 224, 224]
            self.gpu_unit = "cuda:0/fp16"
            self.multi_unit = self.gpu_unit
            # The CPU unit gets half the cores; the GPU feeder threads keep the rest.
            half = cores[: max(1, len(cores) // 2)]
            self.cpu_unit = cpu_cores or f"cpu:{half[0]}-{half[-1]}"
            self.multi = 4
            self.big, self.small, self.mid = 256, 8, 64
            self.bound_ms = 15.0
            self.cpu_workers = "process"
            self.gpu_instances = 2  # two streams: one instance's copies overlap the other's compute

    def load(self, **kw: Any) -> dict[str, Any]:
        """The plan's load section with this setup's duration."""
        return {"min_duration_s": self.duration_s, "min_queries": 64, "sample_pool": 256, **kw}


def plan(setup: Setup, replicas: list[dict[str, Any]], load: dict[str, Any],
         bound_ms: float | None = None, delay_ms: float = 1.0) -> Any:
    return parse_plan({
        "name": "bench",
        "models": [{"name": "m", "model": setup.model, "input_shape": setup.shape,
                    "latency_bound_ms": bound_ms, "replicas": replicas}],
        "dispatcher": {"max_queue_delay_ms": delay_ms, "cpu_workers": setup.cpu_workers},
        "load": setup.load(**load),
    })


def offline_rate(setup: Setup, replicas: list[dict[str, Any]]) -> tuple[float, dict[str, Any]]:
    report = run_plan(plan(setup, replicas, {"scenario": "offline"}))
    rec = report.final
    if rec is None:
        return 0.0, {}
    # the trial's record as stored (JSON for the results file)
    return float(rec.items_per_s or 0.0), rec.to_dict()


def plain_eager(setup: Setup, batch: int) -> float:
    """A plain PyTorch loop: copy in from pinned memory, forward, copy out, every batch."""
    import torch

    model = load_model(ModelSpec(setup.model, input_shape=tuple(setup.shape))).module
    on_gpu = not setup.smoke
    device = torch.device("cuda:0" if on_gpu else "cpu")
    dtype = torch.float16 if on_gpu else torch.float32
    fmt = torch.channels_last if on_gpu else torch.contiguous_format
    model = model.to(device=device, dtype=dtype, memory_format=fmt).eval()
    x_host = torch.randn(batch, *setup.shape).to(dtype)
    if on_gpu:
        x_host = x_host.pin_memory()

    def step() -> None:
        x = x_host.to(device, non_blocking=True).contiguous(memory_format=fmt)
        model(x).float().cpu()

    with torch.inference_mode():
        for _ in range(5):
            step()
        end = time.perf_counter() + setup.duration_s
        n = 0
        start = time.perf_counter()
        while time.perf_counter() < end:
            step()
            n += 1
        elapsed = time.perf_counter() - start
    if on_gpu:
        torch.cuda.synchronize()
    return n * batch / elapsed


def runner_loop(setup: Setup, batch: int, instances: int) -> float:
    """The foundation's plain script: K threads, each driving its own runner (stream + graph)."""
    found = discover(with_runtimes=False)
    unit = select_units([setup.multi_unit if instances > 1 and setup.smoke else setup.gpu_unit],
                        found)[0]
    model = load_model(ModelSpec(setup.model, input_shape=tuple(setup.shape)))
    engine = create_engine("torch")
    runners = [engine.build(model, unit, batch, instance=i) for i in range(instances)]
    samples, window = measure(runners, min_duration_s=setup.duration_s, min_queries=64,
                              warmup_s=0.5)
    engine.release()  # type: ignore[attr-defined]
    return len(samples) * batch / window


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for runtime_gpu.json")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU units")
    parser.add_argument("--duration", type=float, default=None, help="seconds per measurement")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--cpu-unit", default=None, help="CPU unit of the mixed plan")
    args = parser.parse_args()
    setup = Setup(args.smoke, args.duration or (0.4 if args.smoke else 5.0), args.model,
                  args.cpu_unit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    results: dict[str, Any] = {"setup": {k: v for k, v in vars(setup).items()},
                               "machine": platform.node(), "rows": rows}

    def row(part: str, name: str, value: float | None, unit: str, ref: float | None = None,
            target: str = "") -> None:
        ratio = value / ref if value is not None and ref else None
        rows.append({"part": part, "configuration": name, "value": value, "unit": unit,
                     "ratio": ratio, "target": target})
        shown = f"{value:,.1f}" if value is not None else "–"
        print(f"[{time.perf_counter() - started:6.1f}s] {part} | {name}: {shown} {unit}"
              + (f" ({ratio:.3f}×)" if ratio else ""), flush=True)

    one = {"unit": setup.gpu_unit, "instances": 1, "batch_buckets": "none"}
    # 1. runtime overhead against plain loops
    for batch in (setup.mid, setup.big):
        eager = plain_eager(setup, batch)
        row("1 vs plain", f"plain PyTorch eager loop, batch {batch}", eager, "img/s")
        graph = runner_loop(setup, batch, 1)
        row("1 vs plain", f"runner loop (CUDA graph), batch {batch}", graph, "img/s", eager)
        rt, _ = offline_rate(setup, [{**one, "batch": batch}])
        row("1 vs plain", f"runtime, 1 instance, batch {batch}", rt, "img/s", eager,
            "≥ 0.97× plain")
        row("1 vs plain", f"runtime / runner loop, batch {batch}", rt / graph if graph else None,
            "×")
    # 2. instances
    for batch in (setup.small, setup.mid):
        base, _ = offline_rate(setup, [{**one, "batch": batch}])
        row("2 instances", f"runtime, 1 instance, batch {batch}", base, "img/s")
        script = runner_loop(setup, batch, setup.multi)
        row("2 instances", f"plain script, {setup.multi} threads × graph, batch {batch}", script,
            "img/s", base)
        multi, _ = offline_rate(setup, [{"unit": setup.multi_unit, "instances": setup.multi,
                                         "batch": batch, "batch_buckets": "none"}])
        row("2 instances", f"runtime, {setup.multi} instances, batch {batch}", multi, "img/s",
            base, "≥ 1.5× (b8), ≥ 1.05× (b64)")
    # 3 + 4. GPU-only (find-peak: offline + server trials) vs GPU + CPU
    gpu = [{"unit": setup.gpu_unit, "instances": setup.gpu_instances, "batch": setup.mid}]
    mixed = [*gpu, {"unit": setup.cpu_unit, "instances": 1, "batch": 1}]
    peak_report = run_plan(plan(setup, gpu, {"scenario": "server", "find_peak": True,
                                             "p99_bound_ms": setup.bound_ms},
                                bound_ms=setup.bound_ms))
    peak = peak_report.peak or {}
    gpu_offline = peak.get("offline_items_per_s") or 0.0
    row("3 mixed", "GPU-only plan, offline", gpu_offline, "img/s")
    mixed_offline, mixed_rec = offline_rate(setup, mixed)
    row("3 mixed", "GPU + CPU plan, offline", mixed_offline, "img/s", gpu_offline,
        "≥ 1.0× GPU-only")
    rate = 0.5 * gpu_offline
    p99s = {}
    for name, reps in (("GPU-only", gpu), ("GPU + CPU", mixed)):
        rec = run_plan(plan(setup, reps, {"scenario": "server", "rate_qps": rate,
                                          "p99_bound_ms": setup.bound_ms},
                            bound_ms=setup.bound_ms)).final
        p99s[name] = rec.latency.p99_ms if rec is not None and rec.latency else None
        row("3 mixed", f"{name} plan, server p99 at {rate:,.0f} qps", p99s[name], "ms",
            p99s.get("GPU-only") if name != "GPU-only" else None, "≤ GPU-only")
        results[f"server_{name}"] = rec.to_dict() if rec is not None else {}
    row("4 peak", f"server peak within p99 ≤ {setup.bound_ms:g} ms", peak.get("peak_qps"),
        "qps", gpu_offline, "MLPerf H100 TensorRT: 0.82")
    results["peak"] = peak
    results["mixed_offline"] = mixed_rec
    results["elapsed_s"] = time.perf_counter() - started
    (out / "runtime_gpu.json").write_text(json.dumps(results, indent=2, default=str))
    print()
    print("| part | configuration | value | unit | ratio | target |")
    print("|---|---|---:|---|---:|---|")
    for r in rows:
        v = f"{r['value']:,.2f}" if r["value"] is not None else "–"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else ""
        print(f"| {r['part']} | {r['configuration']} | {v} | {r['unit']} | {ratio} | {r['target']} |")
    print(f"\n{results['elapsed_s']:.0f} s in all; JSON in {out / 'runtime_gpu.json'}")


if __name__ == "__main__":
    main()
