"""Threads or processes for CPU workers? Measure both on this machine's cores.

Each CPU worker owns a core set and runs one runner. Two ways to host several of them:
threads in one process (each pinned to its cores with sched_setaffinity, which Linux applies to
the calling thread) or one process per worker (pinned the same way). Both are measured against
one instance on one core and one instance on all cores, same model, batch and duration: first
as bare runner loops, then through the runtime (offline scenario, dispatcher and all).

    PYTHONPATH=src python bench/runtime_cpu_modes.py --model mobilenet_v3_small --batch 8 --duration 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import threading
import time
from typing import Any


def _runner(model_ref: str, cores: tuple[int, ...], batch: int, shape: tuple[int, ...] | None) -> Any:
    from infermux.engines import create_engine
    from infermux.models import ModelSpec, load_model
    from infermux.units import discover, select_units

    unit = select_units([f"cpu:{'+'.join(str(c) for c in cores)}"], discover(with_runtimes=False))[0]
    model = load_model(ModelSpec(model_ref, input_shape=shape))
    return create_engine("torch").build(model, unit, batch)


def _loop(runner: Any, cores: tuple[int, ...], barrier: Any, duration_s: float) -> int:
    """Pin the calling thread, warm up, wait for every other instance, count items."""
    import torch

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    runner.run()  # warm on the pinned cores
    barrier.wait()
    end = time.perf_counter() + duration_s
    items = 0
    while time.perf_counter() < end:
        runner.run()
        items += runner.batch
    return items


def _process_main(args: tuple, barrier: Any, duration_s: float, out: Any) -> None:
    model_ref, cores, batch, shape = args
    os.sched_setaffinity(0, cores)
    runner = _runner(model_ref, cores, batch, shape)
    out.put(_loop(runner, cores, barrier, duration_s))


def run_threads(model_ref: str, core_sets: list[tuple[int, ...]], batch: int,
                shape: tuple[int, ...] | None, duration_s: float) -> float:
    runners = [_runner(model_ref, cores, batch, shape) for cores in core_sets]
    counts = [0] * len(runners)
    barrier = threading.Barrier(len(runners))

    def target(i: int) -> None:
        counts[i] = _loop(runners[i], core_sets[i], barrier, duration_s)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(runners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return sum(counts) / duration_s


def run_processes(model_ref: str, core_sets: list[tuple[int, ...]], batch: int,
                  shape: tuple[int, ...] | None, duration_s: float) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    barrier = ctx.Barrier(len(core_sets))  # every child starts measuring once all are built
    procs = [ctx.Process(target=_process_main, args=((model_ref, cores, batch, shape), barrier,
                                                     duration_s, out)) for cores in core_sets]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    return total / duration_s


def run_runtime(model_ref: str, shape: tuple[int, ...] | None, batch: int, duration_s: float,
                cores: list[int], hosting: str) -> float:
    """Offline samples/s of a one-model plan with one worker per core, through the runtime."""
    from infermux.runtime import parse_plan, run_plan

    plan = parse_plan({
        "models": [{"name": "m", "model": model_ref,
                    "input_shape": list(shape) if shape else None,
                    "replicas": [{"unit": f"cpu:{c}", "batch": batch} for c in cores]}],
        "dispatcher": {"cpu_workers": hosting},
        "load": {"scenario": "offline", "min_duration_s": duration_s, "min_queries": 1},
    })
    final = run_plan(plan).final
    if final is None or final.items_per_s is None:
        raise SystemExit(f"{model_ref} on {hosting} workers ran no trial")
    return float(final.items_per_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--input-shape", default=None, help="e.g. 3x224x224")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", dest="json_out", default=None, help="write results here")
    parser.add_argument("--skip-runtime", action="store_true", help="bare runner loops only")
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.input_shape.split("x")) if args.input_shape else None
    cores = sorted(os.sched_getaffinity(0))
    singles = [(c,) for c in cores]
    cases = {
        "1 instance, 1 core": lambda: run_threads(args.model, singles[:1], args.batch, shape,
                                                  args.duration),
        f"1 instance, {len(cores)} cores": lambda: run_threads(args.model, [tuple(cores)],
                                                               args.batch, shape, args.duration),
        f"{len(cores)} threads, 1 core each": lambda: run_threads(args.model, singles, args.batch,
                                                                  shape, args.duration),
        f"{len(cores)} processes, 1 core each": lambda: run_processes(
            args.model, singles, args.batch, shape, args.duration),
    }
    if not args.skip_runtime:
        for hosting in ("thread", "process"):
            cases[f"runtime: 1 worker on 1 core ({hosting})"] = (
                lambda h=hosting: run_runtime(args.model, shape, args.batch, args.duration,
                                              cores[:1], h))
            cases[f"runtime: {len(cores)} workers, 1 core each ({hosting})"] = (
                lambda h=hosting: run_runtime(args.model, shape, args.batch, args.duration,
                                              cores, h))
    results: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            results[name].append(fn())
    base = max(results["1 instance, 1 core"])
    print(f"\n{args.model} batch {args.batch}, {args.duration:g} s per case, best of {args.repeats}, "
          f"{platform.processor() or platform.machine()}, {len(cores)} cores")
    print("| configuration | items/s (best) | all repeats | × 1 instance, 1 core |")
    print("|---|---:|---|---:|")
    for name, values in results.items():
        print(f"| {name} | {max(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} | "
              f"{max(values) / base:.2f} |")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"model": args.model, "batch": args.batch, "duration_s": args.duration,
                       "results_items_per_s": results}, fh, indent=2)


if __name__ == "__main__":
    main()
