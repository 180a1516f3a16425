"""One build, in a fresh process: `python -m infermux.characterize._build_child SPEC.json`.

The parent writes the spec (model, unit, engine, options, settings, where the inputs are) and
sets the environment (`INFERMUX_CACHE_DIR`, a fresh folder per build unless caches are shared;
`INFERMUX_BUILD_INDEX`). This process applies the settings, builds the runner (timing the build:
export, int8 quantization and compilation included), runs every input through it, measures its
batch latency, and checks it within itself: the same inputs run twice, and items alone against
the same items inside batches of other sizes. It writes `outputs.npy` (the first output of every
input, float32) and `result.json`; an error is written there too, as one line.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["run_build"]


def _import(ref: str) -> None:
    """Import a module by name, or a Python file by path (engines it registers become usable)."""
    if ref.endswith(".py"):
        path = Path(ref)
        spec = importlib.util.spec_from_file_location(f"_infermux_plugin_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {ref}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        importlib.import_module(ref)


def _first_output(runner: Any, chunk: np.ndarray) -> np.ndarray:
    outs = runner.infer(chunk)
    return np.asarray(outs[0], dtype=np.float32).reshape(len(chunk), -1)


def run_all(runner: Any, x: np.ndarray) -> np.ndarray:
    """Every item of `x` through `runner` in batches of its size (the last one zero-padded)."""
    b = runner.batch
    parts = []
    for start in range(0, len(x), b):
        chunk = np.asarray(x[start:start + b], dtype=np.float32)
        n = len(chunk)
        if n < b:
            chunk = np.concatenate([chunk, np.zeros((b - n, *chunk.shape[1:]), np.float32)])
        parts.append(_first_output(runner, chunk)[:n].copy())
    return np.concatenate(parts)


def measure_latency(runner: Any, x: np.ndarray, *, warmup_runs: int, min_runs: int,
                    min_s: float) -> list[int]:
    """Batch latencies (ns) of repeated runs on one batch: warm-up excluded, ≥ min runs and time."""
    b = runner.batch
    chunk = np.asarray(x[:b], dtype=np.float32)
    if len(chunk) < b:
        chunk = np.concatenate([chunk, np.zeros((b - len(chunk), *chunk.shape[1:]), np.float32)])
    runner.set_input(chunk)
    for _ in range(warmup_runs):
        runner.run()
    samples: list[int] = []
    started = time.perf_counter()
    while len(samples) < min_runs or time.perf_counter() - started < min_s:
        samples.append(int(runner.run().latency_ns))
    return samples


def _build(spec: dict[str, Any]) -> tuple[Any, Any, Any, float]:
    """(engine, runner, model, build seconds) for the spec's main batch."""
    from infermux.characterize.knobs import apply_settings
    from infermux.engines import create_engine
    from infermux.models import ModelSpec, load_model
    from infermux.units import Unit

    for ref in spec.get("imports", []):
        _import(ref)
    apply_settings(spec.get("settings") or {})
    unit_data = dict(spec["unit"])
    unit_data["cores"] = tuple(unit_data.get("cores") or ())
    unit = Unit(**unit_data)
    m = spec["model"]
    started = time.perf_counter()
    model = load_model(ModelSpec(m["ref"], m.get("weights"),
                                 tuple(m["input_shape"]) if m.get("input_shape") else None))
    if spec.get("precision") == "int8":
        from infermux.characterize.int8 import quantize_onnx
        from infermux.export import cache_dir, export_onnx

        exported = export_onnx(model, "onnxruntime")
        calibration = np.load(spec["calibration"], mmap_mode="r")
        quantized = quantize_onnx(exported.path, np.asarray(calibration),
                                  cache_dir() / "characterize-int8")
        model = load_model(ModelSpec(str(quantized), None, tuple(model.input_shape)))
    engine = create_engine(spec["engine"])
    runner = engine.build(model, unit, int(spec["batch"]), dict(spec.get("options") or {}))
    return engine, runner, model, time.perf_counter() - started


def run_build(spec: dict[str, Any]) -> dict[str, Any]:
    """Carry out one build as the spec says; return the result record (outputs are saved)."""
    from infermux.characterize.metrics import spread

    out_dir = Path(spec["out_dir"])
    engine, runner, model, build_s = _build(spec)
    x = np.load(spec["inputs"], mmap_mode="r")
    outputs = run_all(runner, x)
    np.save(out_dir / "outputs.npy", outputs)
    lat = spec.get("latency") or {}
    samples = measure_latency(runner, x, warmup_runs=int(lat.get("warmup_runs", 3)),
                              min_runs=int(lat.get("min_runs", 20)),
                              min_s=float(lat.get("min_s", 0.5)))
    median_ns = statistics.median(samples)
    record: dict[str, Any] = {
        "status": "ok",
        "pid": os.getpid(),
        "build_s": build_s,
        "options": {k: v for k, v in runner.options.items()
                    if isinstance(v, (str, int, float, bool, type(None)))},
        "reported_precision": str(runner.options.get("precision") or runner.unit.mode),
        "latency": {"median_ms": median_ns / 1e6, "runs": len(samples),
                    "min_ms": min(samples) / 1e6, "max_ms": max(samples) / 1e6,
                    "items_per_s": runner.batch / (median_ns / 1e9), "samples_ns": samples},
    }
    again = run_all(runner, x)
    record["run_to_run"] = spread([outputs, again]).to_dict()
    if spec.get("batch_dependence", True):
        sizes = sorted({int(s) for s in spec.get("batch_sizes", [])} | {1})
        items = np.asarray(x[:min(len(x), max(sizes))], dtype=np.float32)
        by_size: dict[int, np.ndarray] = {}
        for size in sizes:
            sized = runner if size == runner.batch else engine.build(
                model, runner.unit, size, dict(spec.get("options") or {}))
            by_size[size] = run_all(sized, items)
        record["batch_dependence"] = [
            {"batch": size, **spread([by_size[1], got]).to_dict()}
            for size, got in sorted(by_size.items()) if size != 1]
    # The engine is not released: the process ends right after (see `main`).
    return record


def main(argv: list[str] | None = None) -> int:
    """Entry point: read the spec, build, write `result.json`; exit 0 even when the build failed."""
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    out_dir = Path(spec["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        record = run_build(spec)
    except Exception as exc:  # noqa: BLE001 - every failure becomes the build's one-line error
        from infermux.errors import InfermuxError

        message = str(exc) if isinstance(exc, InfermuxError) else f"{type(exc).__name__}: {exc}"
        record = {"status": "error", "error": message.strip().splitlines()[0][:500] if message
                  else type(exc).__name__, "traceback": traceback.format_exc()[-4000:]}
    (out_dir / "result.json").write_text(json.dumps(record, default=str))
    return 0


def _exit_now(code: int) -> None:
    """End the process without tearing the runtimes down.

    Freeing an OpenVINO compiled model joins its stream threads; one still about to run a
    request's completion callback waits for the GIL that the freeing thread holds, and the
    process hung there once in a few dozen builds. The result is written by now, so nothing is
    lost by skipping the teardown.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    import faulthandler

    # A build that hangs anyway prints every thread's stack and ends (the parent reports it).
    faulthandler.dump_traceback_later(float(os.environ.get("INFERMUX_BUILD_TIMEOUT_S", "1800")),
                                      exit=True)
    _exit_now(main())
