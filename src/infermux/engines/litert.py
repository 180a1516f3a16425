"""The LiteRT (TensorFlow Lite) engine: XNNPACK on CPU core sets, the Edge TPU delegate on `edgetpu:N`.

A torch model becomes a `.tflite` file once per content, cached by hash like ONNX exports
(`infermux.export`): `litert-torch` converts the module (no TensorFlow involved: it lowers the
exported program through StableHLO with the standalone `litert-converter`), and the fp16 and int8
files are made from that fp32 file by Google's AI Edge Quantizer: fp16 casts the weights
(`FLOAT_CASTING`), int8 is static post-training quantization (int8 weights per channel, int8
activations and int8 inputs/outputs) calibrated on `calibration_data` (the shared loader of
`infermux.quantize`: an image folder, an `.npy` file or seeded noise). A prebuilt `.tflite`
runs as is with `model_file=PATH`: then only the interpreter (`ai-edge-litert`) is needed.

Units: `cpu` and core sets (`cpu/int8`, `cpu:0-1/int8` for int8) run the interpreter with XNNPACK
and as many threads as the unit has cores; `edgetpu:N` (discovered in `infermux.units.edgetpu`)
runs the int8 file compiled by `edgetpu_compiler` through libedgetpu's delegate. The compiler's
summary says how many operations run on the TPU and how many fall back to the CPU; the runner
records both in its options and warns when the model does not map fully.

The file is converted at batch 1 and the interpreter's input is resized to the runner's batch
(CNNs keep their batch axis free through the conversion; the output's batch is checked). An Edge
TPU model is compiled for batch 1, so an Edge TPU runner invokes it once per row of its batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from infermux.cache import bound_after_write, touch
from infermux.engines.base import (
    BatchTiming,
    Engine,
    Runner,
    host_output,
    parse_options,
    register_engine,
)
from infermux.errors import RunError, UsageError, first_line
from infermux.export import cache_dir, file_digest, write_atomic
from infermux.models import LoadedModel
from infermux.units import Unit

__all__ = [
    "EdgeTpuCompile",
    "LiteRtEngine",
    "LiteRtOptions",
    "LiteRtRunner",
    "TfliteFile",
    "compile_for_edgetpu",
    "convert_tflite",
    "parse_edgetpu_compiler",
]

log = logging.getLogger(__name__)
# LiteRT's C++ side logs through TensorFlow's logger: keep its INFO/WARNING lines (oneDNN notices,
# absl preambles) out of the output unless the user asks for them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

Precision = Literal["fp32", "fp16", "int8"]
#: The Edge TPU runtime's shared library (libedgetpu1-std / -max packages).
EDGETPU_LIBRARY = "libedgetpu.so.1"
_COMPILER_HINT = ("install edgetpu_compiler (x86-64 Debian/Ubuntu: apt-get install edgetpu-compiler "
                  "from Coral's package repository, https://coral.ai/docs/edgetpu/compiler/) or "
                  "pass option model_file=PATH of a model compiled for the Edge TPU")


class LiteRtOptions(BaseModel):
    """Options of the LiteRT engine; `None` means "the engine decides for the unit"."""

    model_config = ConfigDict(extra="forbid")

    #: The unit's: fp32 on `cpu` units, int8 on `cpu/int8` and Edge TPU units (the only precision
    #: the TPU runs). fp16 and int8 may also be asked for on a plain `cpu` unit.
    precision: Precision | None = None
    #: Interpreter threads; the unit's core count when unset.
    threads: int | None = Field(None, ge=1)
    #: XNNPACK, the CPU delegate LiteRT applies by default; false runs the builtin kernels.
    xnnpack: bool = True
    #: int8 calibration: a folder of images, an (N, *input) .npy file, or `random` (seeded noise:
    #: right for timing, meaningless for accuracy).
    calibration_data: str = "random"
    calibration_items: int = Field(32, ge=1)
    #: A prebuilt .tflite file to run instead of converting the model.
    model_file: str | None = None
    #: The Edge TPU compiler's path; found on PATH when unset.
    edgetpu_compiler: str | None = None
    warmup_iters: int = Field(3, ge=0)

    def resolve(self, unit: Unit) -> LiteRtOptions:
        """Fill the defaults for `unit` and reject what it cannot run, naming the option."""
        update: dict[str, Any] = {}
        if unit.kind == "edgetpu":
            if self.precision not in (None, "int8"):
                raise UsageError(f"option precision={self.precision} cannot run on {unit.id!r}: the "
                                 "Edge TPU runs int8 models only (precision=int8)")
            update["precision"] = "int8"
            update["threads"] = self.threads or 1
        elif unit.kind == "cpu" and unit.mode == "int8":  # cpu/int8: the unit names it
            if self.precision not in (None, "int8"):
                raise UsageError(f"option precision={self.precision} on unit {unit.id!r}, which "
                                 "is int8: use the unit cpu (without /int8) for fp32/fp16")
            update["precision"] = "int8"
            update["threads"] = self.threads or len(unit.cores) or os.cpu_count() or 1
        else:
            if unit.mode == "int8" and self.precision not in (None, "int8"):
                raise UsageError(f"option precision={self.precision} on unit {unit.id!r}: the unit "
                                 "runs int8 (its name says so); use the unit without /int8 for "
                                 f"{self.precision}")
            update["precision"] = self.precision or ("int8" if unit.mode == "int8" else "fp32")
            update["threads"] = self.threads or len(unit.cores) or os.cpu_count() or 1
        return self.model_copy(update=update)


# --- conversion ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TfliteFile:
    """A .tflite file ready for the interpreter, and how it came to be."""

    path: Path
    digest: str
    precision: str
    converted: bool  # False when the cache had it or the user gave it
    convert_s: float = 0.0


def _converter_version() -> str:
    try:
        from importlib.metadata import version

        return f"litert-torch {version('litert-torch')}, ai-edge-quantizer {version('ai-edge-quantizer')}"
    except Exception:  # noqa: BLE001 - a missing distribution only weakens the key
        return "unknown"


def _litert_key(model: LoadedModel, precision: str, calibration: str) -> str:
    from infermux.export import content_hash  # what decides the exported graph

    h = hashlib.sha256(content_hash(model, 0).encode())
    h.update(f"|{precision}|{calibration}|{_converter_version()}".encode())
    return h.hexdigest()[:20]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60]


def convert_tflite(model: LoadedModel, precision: str = "fp32", calibration_data: str = "random",
                   calibration_items: int = 32, root: Path | None = None) -> TfliteFile:
    """The model as a .tflite file at `precision`, converted once per content and cached.

    fp32 comes from litert-torch; fp16 and int8 from the fp32 file through AI Edge Quantizer.
    """
    if model.module is None:
        raise UsageError(f"model {model.name!r} is an ONNX file: the litert engine converts torch "
                         "models; pass a torch model, or option model_file=PATH of a .tflite file")
    import importlib.util

    # Looked up, not imported: litert-torch imports JAX, which stays out of this process.
    missing = [m for m in ("litert_torch", "ai_edge_quantizer") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"converting {model.name} to LiteRT needs litert-torch ({missing[0]} is "
                         "missing): pip install 'infermux[litert]', or pass option "
                         "model_file=PATH of a .tflite file")
    from infermux.quantize import calibration_identity

    cache_root = root or cache_dir()
    folder = cache_root / "litert"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the LiteRT cache folder {str(folder)!r} ({exc}); "
                         "set INFERMUX_CACHE_DIR to a writable folder") from exc
    calibration = (f"{calibration_identity(calibration_data)}x{calibration_items}"
                   if precision == "int8" else "")
    key = _litert_key(model, precision, calibration)
    path = folder / f"{_safe(model.name)}-{key}-{precision}.tflite"
    if path.is_file() and path.stat().st_size > 0:
        touch(path)
        return TfliteFile(path, file_digest(path), precision, converted=False)
    started = time.perf_counter()
    if precision == "fp32":
        data = _convert_fp32(model)
    else:
        base = convert_tflite(model, "fp32", root=root)
        # The quantizer draws progress bars and warns about its debugging mode: not ours to show.
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            data = _quantize(base.path, precision, model, calibration_data, calibration_items)
    write_atomic(path, data)
    converted = TfliteFile(path, file_digest(path), precision, converted=True,
                           convert_s=time.perf_counter() - started)
    bound_after_write(cache_root, path)
    return converted


def _convert_fp32(model: LoadedModel) -> bytes:
    """torch.export here, litert-torch in a child process.

    The converter imports JAX, whose threads make every later `fork` of this process unsafe
    (the runtime forks its CPU workers): so it never enters this process. The exported program
    goes to the child as a `.pt2` file.
    """
    import torch

    example = torch.zeros((1, *model.input_shape), dtype=getattr(torch, model.dtype))
    with tempfile.TemporaryDirectory() as tmp:
        program, out = Path(tmp) / "model.pt2", Path(tmp) / "model.tflite"
        try:
            with torch.no_grad():
                exported = torch.export.export(model.module.eval(), (example,))
            torch.export.save(exported, str(program))
        except Exception as exc:  # torch.export raises many types, naming the construct
            raise RunError(f"converting {model.name} to LiteRT failed in torch.export: "
                           f"{first_line(exc)}; export the model yourself and pass option "
                           "model_file=PATH") from exc
        src = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}
        shape = ",".join(str(d) for d in example.shape)
        proc = subprocess.run(
            [sys.executable, "-c", "from infermux.engines.litert import _convert_main; _convert_main()",
             str(program), str(out), shape, model.dtype],
            capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0 or not out.is_file():
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            raise RunError(f"converting {model.name} to LiteRT failed: "
                           f"{(lines or ['exit status ' + str(proc.returncode)])[-1][:300]}; export "
                           "the model yourself and pass option model_file=PATH")
        return out.read_bytes()


def _convert_main() -> None:
    """The child's side of `_convert_fp32`: argv = program.pt2 out.tflite shape dtype."""
    import litert_torch
    import torch

    program, out, shape, dtype = sys.argv[1:5]
    litert_torch.config.show_progress = False
    module = torch.export.load(program).module()
    example = torch.zeros(tuple(int(d) for d in shape.split(",")), dtype=getattr(torch, dtype))
    litert_torch.convert(module, (example,)).export(out)


def _quantize(fp32: Path, precision: str, model: LoadedModel, calibration_data: str,
              items: int) -> bytes:
    from ai_edge_quantizer import algorithm_manager, qtyping, quantizer, recipe, recipe_manager

    qt = quantizer.Quantizer(str(fp32))
    if precision == "fp16":
        manager = recipe_manager.RecipeManager()
        manager.add_weight_only_config(regex=".*", operation_name=qtyping.TFLOperationName.ALL_SUPPORTED,
                                       num_bits=16,
                                       algorithm_key=algorithm_manager.AlgorithmName.FLOAT_CASTING)
        qt.load_quantization_recipe(manager.get_quantization_recipe())
        result = qt.quantize(enable_progress_report=False)
    else:
        from infermux.quantize import load_calibration

        qt.load_quantization_recipe(recipe.static_wi8_ai8())
        samples = load_calibration(calibration_data, model.input_shape, items)
        signature, input_name = _signature_input(fp32)
        feeds = [{input_name: samples[i:i + 1]} for i in range(len(samples))]
        try:
            qsvs = qt.calibrate({signature: feeds}, num_threads=1)
            result = qt.quantize(qsvs, enable_progress_report=False)
        except Exception as exc:  # the quantizer raises ValueError/RuntimeError per op
            raise RunError(f"int8 quantization of {model.name} failed: {first_line(exc)}") from exc
    if result.quantized_model is None:
        raise RunError(f"{precision} quantization of {model.name} produced no model")
    return bytes(result.quantized_model)


def _signature_input(path: Path) -> tuple[str, str]:
    from ai_edge_litert.interpreter import Interpreter

    signatures = Interpreter(model_path=str(path)).get_signature_list()
    name, signature = next(iter(signatures.items()))
    return name, signature["inputs"][0]


# --- Edge TPU compilation ------------------------------------------------------------------------

@dataclass(frozen=True)
class EdgeTpuCompile:
    """What `edgetpu_compiler` made of a model: the operations on the TPU and on the CPU."""

    ops_tpu: int
    ops_cpu: int
    subgraphs: int | None = None
    version: str = ""
    on_chip_bytes: float | None = None
    off_chip_bytes: float | None = None
    #: (operator, count, status) rows of the operation table, as the compiler prints them.
    operators: list[tuple[str, int, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Every operation of the model."""
        return self.ops_tpu + self.ops_cpu

    @property
    def tpu_fraction(self) -> float:
        """The share of operations mapped to the Edge TPU (1.0: the whole model)."""
        return self.ops_tpu / self.total if self.total else 0.0

    def unmapped(self) -> list[tuple[str, int, str]]:
        """Operator rows not mapped to the Edge TPU, with the compiler's reason."""
        return [row for row in self.operators if row[2] != "Mapped to Edge TPU"]

    def summary(self) -> str:
        """One line: how much of the model runs on the TPU, and what does not."""
        text = f"{self.ops_tpu} of {self.total} operations run on the Edge TPU ({self.tpu_fraction:.0%})"
        rest = self.unmapped()
        if rest:
            text += "; on the CPU: " + ", ".join(f"{n}×{op} ({why})" for op, n, why in rest[:4])
        return text

    def to_dict(self) -> dict[str, Any]:
        """A plain dict for results."""
        return {"ops_tpu": self.ops_tpu, "ops_cpu": self.ops_cpu, "tpu_fraction": self.tpu_fraction,
                "subgraphs": self.subgraphs, "compiler_version": self.version,
                "on_chip_bytes": self.on_chip_bytes, "off_chip_bytes": self.off_chip_bytes,
                "unmapped": [list(r) for r in self.unmapped()]}


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _size(text: str | None) -> float | None:
    match = re.match(r"([\d.]+)\s*([KMG]iB|B)", text or "")
    return float(match.group(1)) * _UNITS[match.group(2)] if match else None


def parse_edgetpu_compiler(text: str) -> EdgeTpuCompile:
    """The compiler's stdout (with `-s`) or its operation log, parsed.

    A model that maps fully prints no "will run on" counts: then every operation of the
    "Total number of operations" line (or of the operator table) is on the TPU.
    """
    def grab(pattern: str) -> str | None:
        match = re.search(pattern, text)
        return match.group(1) if match else None

    operators = [(m.group(1), int(m.group(2)), m.group(3).strip())
                 for m in re.finditer(r"^([A-Z][A-Z0-9_]+)\s+(\d+)\s+(\S.*)$", text, re.MULTILINE)]
    tpu = grab(r"Number of operations that will run on Edge TPU:\s*(\d+)")
    cpu = grab(r"Number of operations that will run on CPU:\s*(\d+)")
    total = grab(r"Total number of operations:\s*(\d+)")
    if tpu is not None:
        ops_tpu, ops_cpu = int(tpu), int(cpu or 0)
    elif operators:
        ops_tpu = sum(n for _, n, s in operators if s == "Mapped to Edge TPU")
        ops_cpu = sum(n for _, n, s in operators if s != "Mapped to Edge TPU")
    elif total is not None and "compiled successfully" in text:
        ops_tpu, ops_cpu = int(total), 0
    else:
        raise RunError("edgetpu_compiler's output names no operation counts: "
                       + (text.strip().splitlines() or ["(empty)"])[-1][:200])
    subgraphs = grab(r"Number of Edge TPU subgraphs:\s*(\d+)")
    return EdgeTpuCompile(
        ops_tpu=ops_tpu, ops_cpu=ops_cpu,
        subgraphs=int(subgraphs) if subgraphs else None,
        version=grab(r"Edge TPU Compiler version\s+(\S+)") or "",
        on_chip_bytes=_size(grab(r"On-chip memory used for caching model parameters:\s*(\S+)")),
        off_chip_bytes=_size(grab(r"Off-chip memory used for streaming uncached model parameters:"
                                  r"\s*(\S+)")),
        operators=operators,
    )


def compile_for_edgetpu(source: TfliteFile, compiler: str | None = None,
                        root: Path | None = None) -> tuple[Path, EdgeTpuCompile]:
    """The int8 file compiled by `edgetpu_compiler` (cached by the source's digest)."""
    exe = compiler or shutil.which("edgetpu_compiler")
    if not exe or not Path(exe).exists():
        raise UsageError(f"the Edge TPU needs the model compiled by edgetpu_compiler, which is not "
                         f"{'at ' + repr(compiler) if compiler else 'on PATH'}: {_COMPILER_HINT}")
    cache_root = root or cache_dir()
    folder = cache_root / "litert" / "edgetpu"
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{source.path.stem}-{source.digest}"
    out = folder / f"{stem}_edgetpu.tflite"
    report = folder / f"{stem}_edgetpu.txt"
    if out.is_file() and report.is_file():
        touch(out)
        touch(report)
        return out, parse_edgetpu_compiler(report.read_text())
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        model = Path(tmp) / f"{stem}.tflite"
        shutil.copyfile(source.path, model)
        proc = subprocess.run([exe, "-s", "-o", tmp, str(model)], capture_output=True, text=True,
                              timeout=600, check=False)
        text = proc.stdout + proc.stderr
        made = Path(tmp) / f"{stem}_edgetpu.tflite"
        if proc.returncode != 0 or not made.is_file():
            last = (text.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            raise RunError(f"edgetpu_compiler could not compile {source.path.name}: {last[:300]}")
        os.replace(made, out)
    report.write_text(text)
    bound_after_write(cache_root, out, report)
    return out, parse_edgetpu_compiler(text)


# --- the runner ----------------------------------------------------------------------------------

class LiteRtRunner(Runner):
    """One interpreter, one batch size; quantized inputs and outputs are converted at the edges."""

    engine = "litert"

    def __init__(self, interpreter: Any, unit: Unit, batch: int, input_shape: tuple[int, ...],
                 opts: LiteRtOptions, started: float, rows_per_invoke: int) -> None:
        self.unit = unit
        self.batch = batch
        self.input_shape = input_shape
        self.options = opts.model_dump()
        self._it = interpreter
        self._rows = rows_per_invoke  # the batch, or 1 on an Edge TPU (one invoke per row)
        self._in = interpreter.get_input_details()[0]
        self._outs = interpreter.get_output_details()
        self._in_dtype = np.dtype(self._in["dtype"])
        self._in_q = self._in["quantization"]
        self._x = np.zeros((batch, *input_shape), dtype=self._in_dtype)
        self._y: list[np.ndarray] = []
        self.run()
        shapes = [y.shape for y in self._y]
        if any(not s or s[0] != batch for s in shapes):
            raise RunError(f"the LiteRT model gives outputs of shapes {shapes} at batch {batch}: its "
                           "batch axis is fixed; convert it at this batch or use batch 1")
        for _ in range(opts.warmup_iters):
            self.run()
        self.build_s = time.perf_counter() - started

    def run(self) -> BatchTiming:
        """One batch: invoke (one per row on an Edge TPU), then read the outputs."""
        it = self._it
        start = time.perf_counter_ns()
        if self._rows == self.batch:
            it.set_tensor(self._in["index"], self._x)
            it.invoke()
            self._y = [it.get_tensor(o["index"]) for o in self._outs]
        else:
            parts: list[list[np.ndarray]] = [[] for _ in self._outs]
            for row in range(self.batch):
                it.set_tensor(self._in["index"], self._x[row:row + 1])
                it.invoke()
                for k, o in enumerate(self._outs):
                    parts[k].append(it.get_tensor(o["index"]))
            self._y = [np.concatenate(p) for p in parts]
        latency = time.perf_counter_ns() - start
        return BatchTiming(latency_ns=latency, compute_ns=latency)

    def set_input(self, batch: np.ndarray) -> None:
        """Copy `batch` into the input buffer, quantized where the model takes integers."""
        expected = (self.batch, *self.input_shape)
        if tuple(batch.shape) != expected:
            raise UsageError(f"batch of shape {tuple(batch.shape)} given, runner takes {expected}")
        if self._in_dtype.kind in "iu":
            scale, zero = self._in_q
            info = np.iinfo(self._in_dtype)
            q = np.rint(np.asarray(batch, dtype=np.float32) / (scale or 1.0)) + zero
            self._x[...] = np.clip(q, info.min, info.max)
        else:
            self._x[...] = batch

    def outputs(self) -> list[np.ndarray]:
        """The last batch's outputs.

        Quantized ones dequantized to float32, the others as `host_output` gives them (floats
        float32, integer outputs as they are).
        """
        result = []
        for y, o in zip(self._y, self._outs, strict=True):
            scale, zero = o["quantization"]
            if np.dtype(o["dtype"]).kind in "iu" and scale:
                result.append(((y.astype(np.float32) - zero) * scale).astype(np.float32))
            else:
                result.append(host_output(y))
        return result

    def close(self) -> None:
        """Drop the interpreter (and its delegates)."""
        self._it = None


def _load_edgetpu_delegate(unit: Unit) -> Any:
    from ai_edge_litert.interpreter import load_delegate

    device = str(unit.details.get("delegate_device", ""))
    try:
        return load_delegate(EDGETPU_LIBRARY, {"device": device} if device else {})
    except (OSError, ValueError) as exc:
        raise UsageError(f"unit {unit.id!r}: the Edge TPU delegate ({EDGETPU_LIBRARY}) cannot open "
                         f"{device or 'the device'} ({first_line(exc)}); install libedgetpu1-std and "
                         "check the device's permissions (the apex/udev rules of the Coral runtime)") from exc


@register_engine
class LiteRtEngine(Engine):
    """LiteRT on CPU units (XNNPACK) and Edge TPU units (libedgetpu delegate)."""

    name = "litert"
    unit_kinds = ("cpu", "edgetpu")
    requires = ("ai_edge_litert",)
    install_hint = "pip install 'infermux[litert]' (ai-edge-litert alone runs prebuilt .tflite files)"
    options_model = LiteRtOptions

    def accepts(self, model: LoadedModel) -> bool:
        """Torch models, where the converter is installed (ONNX files need a .tflite of their own)."""
        import importlib.util

        return (model.module is not None and importlib.util.find_spec("litert_torch") is not None
                and super().accepts(model))

    def resolve_options(self, options: dict[str, Any] | None, unit: Unit, model: LoadedModel,
                        data: str) -> LiteRtOptions:
        """Parsed, with the unit's defaults (precision, threads)."""
        return parse_options(LiteRtOptions, self.name, options).resolve(unit)

    def tflite_for(self, model: LoadedModel, opts: LiteRtOptions) -> TfliteFile:
        """The file the interpreter loads: the user's, or the cached conversion."""
        if opts.model_file:
            path = Path(opts.model_file).expanduser()
            if not path.is_file():
                raise UsageError(f"option model_file={opts.model_file!r}: no such file; pass the "
                                 "path of a .tflite model")
            return TfliteFile(path, file_digest(path), opts.precision or "fp32", converted=False)
        return convert_tflite(model, opts.precision or "fp32", opts.calibration_data,
                              opts.calibration_items)

    def _build(self, model: LoadedModel, unit: Unit, batch: int, opts: LiteRtOptions, data: str,
               instance: int) -> LiteRtRunner:
        from ai_edge_litert.interpreter import Interpreter, OpResolverType

        started = time.perf_counter()
        source = self.tflite_for(model, opts)
        path = source.path
        delegates: list[Any] = []
        compiled: EdgeTpuCompile | None = None
        if unit.kind == "edgetpu":
            if not path.stem.endswith("_edgetpu"):
                path, compiled = compile_for_edgetpu(source, opts.edgetpu_compiler)
                if compiled.ops_cpu:
                    log.warning("%s on %s: %s", model.name, unit.id, compiled.summary())
            delegates.append(_load_edgetpu_delegate(unit))
        resolver = (OpResolverType.AUTO if opts.xnnpack
                    else OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
        try:
            interpreter = Interpreter(model_path=str(path), num_threads=opts.threads,
                                      experimental_delegates=delegates or None,
                                      experimental_op_resolver_type=resolver)
            rows = 1 if unit.kind == "edgetpu" else batch
            first = interpreter.get_input_details()[0]
            if tuple(first["shape"]) != (rows, *model.input_shape):
                if tuple(first["shape"][1:]) != tuple(model.input_shape):
                    raise UsageError(f"{path.name} takes inputs of shape {tuple(first['shape'])}, the "
                                     f"model {model.name} has {model.input_shape}: pass --input-shape")
                interpreter.resize_tensor_input(first["index"], [rows, *model.input_shape])
            interpreter.allocate_tensors()
            runner = LiteRtRunner(interpreter, unit, batch, model.input_shape, opts, started, rows)
        except (UsageError, RunError):
            raise
        except Exception as exc:  # the interpreter raises RuntimeError/ValueError with its log
            raise RunError(f"LiteRT failed to run {model.name} on {unit.id} at batch {batch}: "
                           f"{first_line(exc)}") from exc
        runner.options.update(tflite_file=str(path), tflite_sha256=source.digest,
                              convert_s=round(source.convert_s, 3))
        if opts.model_file:  # the file decides its precision: integer inputs or outputs mean int8
            details = [runner._in, *runner._outs]
            integer = any(np.dtype(d["dtype"]).kind in "iu" for d in details)
            runner.options["precision"] = "int8" if integer else opts.precision
        if compiled is not None:
            runner.options["edgetpu"] = compiled.to_dict()
        return runner
