"""The TensorRT engine: ONNX → serialized engine for `cuda:N/*` and `dla:N/*` units.

Two build paths, chosen by what the installed TensorRT has (feature detection, `trt_api`), not
by its version string:

- **Strongly typed** (TensorRT 11, which removed the precision flags and the int8 calibrators;
  also available from 9.x with `typing=strong`): the precision is in the ONNX model. fp16 and
  bf16 units build a model cast by `infermux.quantize.convert_precision` (fp32 islands for
  normalisation, softmax and reductions; fp32 inputs and outputs), int8 builds a Q/DQ model
  made by post-training quantization from calibration data (`quantize_qdq`: the file the CPU
  engines run too; its unquantized layers stay fp32 unless ModelOpt wrote it with fp16).
- **Weakly typed** (TensorRT 10 and older, e.g. 10.3 on JetPack 6): builder flags (`FP16`,
  `BF16`, `INT8`) and the entropy calibrator. DLAs need this path (TensorRT 11 does not support
  the DLA on JetPack/DriveOS builds).

Written against the TensorRT Python API (8.6 on JetPack 5 through 11.x): named I/O tensors,
`execute_async_v3`, an optimisation profile fixed at the runner's batch, a timing cache so a
rebuild picks the kernels timed the first time (kernel choice by timing is what makes TensorRT
builds non-deterministic), serialized engines cached on disk by a key of everything that shapes
them, entropy calibration for int8 (from an image folder or generated data) with its cache kept,
and CUDA-graph replay on GPU units. Buffers are torch CUDA tensors, so no CUDA binding beyond
torch is needed. Every input of the network is profiled and bound (the samples feed the first;
the others of a multi-input network hold zeros), and everything that touches the device happens
under `torch.cuda.device(N)`, so a `cuda:1` engine, context and buffers all live on GPU 1.
Engine, timing and calibration caches are written to a temporary file and renamed into place.

The timing cache is keyed by TensorRT release, device and the options that change timing
(typing, optimisation level, workspace); `reuse_timing_cache=false` times every kernel afresh
and bypasses the engine cache, for studies of rebuild variance.

`trt_api`, `build_plan`, `engine_cache_key` and `timing_cache_name` are pure, so the translation
of units and options and the version dispatch are tested on machines without TensorRT, against
objects shaped like either API; everything that needs the library is imported lazily.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from infermux.cache import bound_after_write, touch
from infermux.engines.base import (
    BatchTiming,
    Engine,
    Runner,
    compute_device,
    host_output,
    register_engine,
)
from infermux.errors import RunError, UsageError
from infermux.export import ExportedModel, cache_dir, write_atomic
from infermux.models import LoadedModel
from infermux.quantize import calibration_batches, calibration_identity
from infermux.units import Unit

__all__ = [
    "TRT10_API",
    "BuildPlan",
    "TrtApi",
    "TrtEngine",
    "TrtOptions",
    "TrtRunner",
    "build_plan",
    "calibration_batches",
    "engine_cache_key",
    "installed_trt_major",
    "network_flags",
    "timing_cache_name",
    "trt_api",
]

Typing = Literal["auto", "strong", "weak"]


@dataclass(frozen=True)
class TrtApi:
    """What the installed TensorRT offers, found by looking for it (not by its version)."""

    version: str
    #: `BuilderFlag.FP16`/`INT8` exist: weakly typed builds (TensorRT 10 and older).
    precision_flags: bool
    #: `IInt8EntropyCalibrator2` exists: implicit int8 by calibration (TensorRT 10 and older).
    calibrators: bool
    #: Strongly typed networks exist (`NetworkDefinitionCreationFlag.STRONGLY_TYPED`, or
    #: TensorRT 11, where every network is strongly typed).
    strongly_typed: bool

    @property
    def major(self) -> int:
        """The major release (11 for 11.4.1); 0 when the version string says none."""
        head = self.version.split(".")[0]
        return int(head) if head.isdigit() else 0


#: The API shape of TensorRT 10 (JetPack 6's 10.3 and later 10.x): flags, calibrators, and
#: strong typing on request.
TRT10_API = TrtApi("10.3.0", precision_flags=True, calibrators=True, strongly_typed=True)


def trt_api(trt: Any) -> TrtApi:
    """Detect the API shape of the `tensorrt` module given (or anything shaped like it)."""
    flags = getattr(trt, "BuilderFlag", None)
    creation = getattr(trt, "NetworkDefinitionCreationFlag", None)
    precision_flags = flags is not None and hasattr(flags, "FP16") and hasattr(flags, "INT8")
    version = str(getattr(trt, "__version__", "0"))
    return TrtApi(
        version=version,
        precision_flags=precision_flags,
        calibrators=hasattr(trt, "IInt8EntropyCalibrator2"),
        strongly_typed=(creation is not None and hasattr(creation, "STRONGLY_TYPED"))
        or not precision_flags,
    )


def installed_trt_major() -> int | None:
    """The major release of the importable `tensorrt`, or None where there is none."""
    try:
        import tensorrt
    except ImportError:
        return None
    return trt_api(tensorrt).major or None


class TrtOptions(BaseModel):
    """Options of the TensorRT engine; `None` means "the engine decides for the unit"."""

    model_config = ConfigDict(extra="forbid")

    int8: bool | None = None
    #: Layers a DLA cannot run go to the GPU; without it such a network fails to build.
    gpu_fallback: bool | None = None
    cuda_graph: bool | None = None
    #: int8: an image folder, an (N, *input) .npy file, or "random" (the default: seeded noise,
    #: right for timing, meaningless for accuracy).
    calibration_data: str | None = None
    calibration_items: int = Field(256, ge=1)
    #: Strongly typed (precision from the model), weakly typed (precision flags, calibrators,
    #: the DLA), or auto: weak where the TensorRT has precision flags (10 and older), else strong.
    typing: Typing = "auto"
    #: int8 on the strongly typed path: how the Q/DQ model is calibrated, and by whom.
    quantize_method: Literal["minmax", "entropy", "percentile"] = "minmax"
    quantize_tool: Literal["onnxruntime", "modelopt"] = "onnxruntime"
    #: fp16/bf16 on the strongly typed path: infermux's cast pass or ModelOpt's AutoCast.
    precision_tool: Literal["infermux", "modelopt"] = "infermux"
    #: Read and write the timing cache (true), or time every kernel afresh and rebuild instead
    #: of loading a cached engine (false: each build is a new draw, for rebuild studies).
    reuse_timing_cache: bool = True
    workspace_mib: int | None = Field(None, ge=1)
    builder_optimization_level: int | None = Field(None, ge=0, le=5)
    engine_cache_dir: str | None = None
    opset: int | None = None
    warmup_iters: int = Field(3, ge=0)


@dataclass(frozen=True)
class BuildPlan:
    """What a build sets on the builder config, derived from the unit and the options."""

    device: str  # gpu | dla
    device_index: int  # CUDA device, or DLA core
    typing: str  # strong | weak
    #: The precision set in the ONNX model before the build (strong typing), else fp32.
    model_precision: str
    set_flags: tuple[str, ...]
    clear_flags: tuple[str, ...]
    precision: str
    cuda_graph: bool
    calibrate: bool
    calibration_data: str | None
    calibration_items: int
    workspace_mib: int | None
    builder_optimization_level: int | None
    reuse_timing_cache: bool = True
    quantize_method: str = "minmax"
    quantize_tool: str = "onnxruntime"
    precision_tool: str = "infermux"


def _typing(unit: Unit, opts: TrtOptions, api: TrtApi) -> str:
    """Strong or weak typing for this build, or one clear line why neither can be."""
    on_dla = unit.kind == "dla"
    if opts.typing == "weak" and not api.precision_flags:
        raise UsageError(f"option typing=weak: TensorRT {api.version} has no precision flags "
                         "(weakly typed builds ended with TensorRT 10): use typing=auto")
    if opts.typing == "strong" and not api.strongly_typed:
        raise UsageError(f"option typing=strong: TensorRT {api.version} has no strongly typed "
                         "networks (they came with 9.x): use typing=auto")
    typing = opts.typing if opts.typing != "auto" else (
        "weak" if api.precision_flags else "strong")
    if on_dla and typing == "strong":
        if not api.precision_flags:
            raise UsageError(
                f"unit {unit.id!r} needs TensorRT 10 (JetPack 6): the DLA is built through "
                f"precision flags and calibrators, which TensorRT {api.version} does not have; "
                "install the TensorRT of JetPack 6 or use a cuda unit")
        raise UsageError(f"unit {unit.id!r}: DLA builds are weakly typed: drop typing=strong")
    return typing


def build_plan(unit: Unit, opts: TrtOptions, api: TrtApi = TRT10_API) -> BuildPlan:
    """Translate a unit and options to a build for `api`; one clear error for what cannot be."""
    if unit.kind not in ("cuda", "dla"):
        raise UsageError(f"the tensorrt engine cannot run on unit {unit.id!r} (it runs cuda, dla)")
    on_dla = unit.kind == "dla"
    int8 = opts.int8 if opts.int8 is not None else unit.mode == "int8"
    typing = _typing(unit, opts, api)
    set_flags: list[str] = []
    clear: list[str] = []
    if unit.mode == "fp32":
        clear.append("TF32")  # CUDA cores: what the fp32 unit means (TF32 stays in 11)
    if typing == "weak":
        model_precision = "fp32"
        if unit.mode == "fp16":
            set_flags.append("FP16")
        elif unit.mode == "bf16":
            set_flags.append("BF16")
        elif unit.mode == "int8":
            set_flags.append("FP16")  # layers without an int8 kernel fall back to fp16, not fp32
        if int8:
            set_flags.append("INT8")
    else:
        model_precision = "int8" if int8 else (
            unit.mode if unit.mode in ("fp16", "bf16") else "fp32")
    if on_dla:
        if unit.mode not in ("fp16", "int8"):
            raise UsageError(f"unit {unit.id!r}: a DLA runs fp16 or int8 only")
        if opts.cuda_graph:
            raise UsageError(f"option cuda_graph=true on {unit.id!r}: DLA work cannot be captured "
                             "in a CUDA graph; drop the option")
        if opts.gpu_fallback is not False:
            set_flags.append("GPU_FALLBACK")
    elif opts.gpu_fallback is not None:
        raise UsageError(f"option gpu_fallback needs a dla:N unit, not {unit.id!r}")
    data = opts.calibration_data
    if data not in (None, "random") and not (
            Path(data).is_dir() or (data.endswith(".npy") and Path(data).is_file())):
        raise UsageError(f"option calibration_data={data!r} is not a folder or a .npy file: "
                         "pass a folder of .jpg/.png images, an (N, *input) .npy array, or "
                         "'random' (timing only)")
    precision = "int8" if int8 else unit.mode
    return BuildPlan(
        device="dla" if on_dla else "gpu",
        device_index=unit.index,
        typing=typing,
        model_precision=model_precision,
        set_flags=tuple(set_flags),
        clear_flags=tuple(clear),
        precision=precision,
        cuda_graph=(not on_dla) if opts.cuda_graph is None else opts.cuda_graph,
        # Weak typing calibrates in the builder; strong typing calibrated the Q/DQ model.
        calibrate=int8 and typing == "weak",
        # Without data int8 calibrates on seeded noise: right for timing, not for accuracy.
        calibration_data=(data or "random") if int8 else None,
        calibration_items=opts.calibration_items,
        workspace_mib=opts.workspace_mib,
        builder_optimization_level=opts.builder_optimization_level,
        reuse_timing_cache=opts.reuse_timing_cache,
        quantize_method=opts.quantize_method,
        quantize_tool=opts.quantize_tool,
        precision_tool=opts.precision_tool,
    )


def timing_cache_name(plan: BuildPlan, trt_version: str, device_name: str) -> str:
    """The timing cache file for a build: one per TensorRT release, device and timing options.

    Kernel timings move with neither the release nor the device; the typing and the builder's
    optimisation level and workspace change which kernels are timed at all.
    """
    level = "d" if plan.builder_optimization_level is None else plan.builder_optimization_level
    workspace = plan.workspace_mib or "d"
    return (f"timing-{_slug(device_name)}-trt{trt_version}-{plan.typing}-o{level}"
            f"-w{workspace}.cache")


def engine_cache_key(onnx_digest: str, plan: BuildPlan, batch: int, trt_version: str,
                     device_name: str) -> str:
    """A key of everything that shapes a serialized engine.

    The graph, the build plan, the batch, the TensorRT release and the device it was built on:
    engines move between neither releases nor devices.
    """
    fields = asdict(plan)
    fields.pop("cuda_graph")  # a run-time choice: the same engine serves both
    fields["calibration_data"] = calibration_identity(plan.calibration_data)
    text = f"{onnx_digest}|{batch}|{trt_version}|{device_name}|{sorted(fields.items())}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _make_calibrator(trt: Any, batches: Iterator[np.ndarray], batch: int, cache: Path,
                     others: dict[str, tuple[int, ...]] | None = None) -> Any:
    """An entropy calibrator (the kind DLAs require) that keeps its cache file.

    The batches feed the network's first input; `others` (name: shape) get zeros.
    """
    import torch

    zeros = {name: torch.zeros(shape, dtype=torch.float32, device="cuda")
             for name, shape in (others or {}).items()}

    class _Calibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self._device: Any = None

        def get_batch_size(self) -> int:
            return batch

        def get_batch(self, names: list[str]) -> list[int] | None:
            host = next(batches, None)
            if host is None:
                return None
            self._device = torch.from_numpy(host).cuda()
            return [int(zeros[n].data_ptr()) if n in zeros else int(self._device.data_ptr())
                    for n in names]

        def read_calibration_cache(self) -> bytes | None:
            return cache.read_bytes() if cache.is_file() else None

        def write_calibration_cache(self, data: Any) -> None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(cache, bytes(data))

    return _Calibrator()


class TrtRunner(Runner):
    """A deserialized engine, an execution context, torch-owned buffers and maybe a CUDA graph."""

    engine = "tensorrt"

    def __init__(self, trt_engine: Any, unit: Unit, batch: int, input_shape: tuple[int, ...],
                 plan: BuildPlan, opts: TrtOptions, data: str, started: float) -> None:
        import tensorrt as trt
        import torch

        self.unit = unit
        self.batch = batch
        self.input_shape = input_shape
        self.options = {**opts.model_dump(), **asdict(plan)}
        self._engine = trt_engine
        self._context = trt_engine.create_execution_context()
        gpu = torch.device("cuda", plan.device_index if plan.device == "gpu" else 0)
        self._stream = torch.cuda.Stream(gpu)
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        names = [trt_engine.get_tensor_name(i) for i in range(trt_engine.num_io_tensors)]
        inputs = [n for n in names if trt_engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if n not in inputs]
        # Every input is bound: the first takes the samples; the others of a multi-input network
        # get their profile's shape (fixed at this batch by the build) and hold zeros.
        self._context.set_input_shape(inputs[0], (batch, *input_shape))
        for name in inputs[1:]:
            shape = tuple(trt_engine.get_tensor_shape(name))
            if any(d < 0 for d in shape):  # dynamic: the profile's (min = opt = max) shape
                shape = tuple(trt_engine.get_tensor_profile_shape(name, 0)[1])
            self._context.set_input_shape(name, shape)

        def tensor(name: str) -> Any:
            dtype = getattr(torch, np.dtype(trt.nptype(trt_engine.get_tensor_dtype(name))).name)
            return torch.empty(tuple(self._context.get_tensor_shape(name)), dtype=dtype, device=gpu)

        self._x_dev = tensor(inputs[0])
        self._other_inputs = [tensor(n).zero_() for n in inputs[1:]]
        self._y_dev = [tensor(n) for n in outputs]
        self._x_host = self._x_dev if data == "device" else torch.empty(
            self._x_dev.shape, dtype=self._x_dev.dtype, pin_memory=True)
        self._y_host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self._y_dev]
        self._context.set_tensor_address(inputs[0], self._x_dev.data_ptr())
        for name, t in zip(inputs[1:], self._other_inputs, strict=True):
            self._context.set_tensor_address(name, t.data_ptr())
        for name, t in zip(outputs, self._y_dev, strict=True):
            self._context.set_tensor_address(name, t.data_ptr())
        self._graph: Any = None
        with torch.cuda.stream(self._stream):
            for _ in range(max(1, opts.warmup_iters)):
                self._enqueue()
            self._stream.synchronize()
            if plan.cuda_graph:
                # The graph reads the addresses bound above: the buffers live as long as it does.
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=self._stream):
                    self._enqueue()
                self._graph = graph
            self._stream.synchronize()
        self.build_s = time.perf_counter() - started

    def _enqueue(self) -> None:
        if not self._context.execute_async_v3(self._stream.cuda_stream):
            raise RunError(f"TensorRT failed to enqueue a batch on {self.unit.id}")

    def run(self) -> BatchTiming:
        """One batch: copy in, replay (or enqueue), copy out; phases from CUDA events."""
        import torch

        ev = self._events
        start = time.perf_counter_ns()
        with torch.cuda.stream(self._stream):
            ev[0].record()
            if self._x_host is not self._x_dev:
                self._x_dev.copy_(self._x_host, non_blocking=True)
            ev[1].record()
            if self._graph is not None:
                self._graph.replay()
            else:
                self._enqueue()
            ev[2].record()
            for dst, src in zip(self._y_host, self._y_dev, strict=True):
                dst.copy_(src, non_blocking=True)
            ev[3].record()
        ev[3].synchronize()
        return BatchTiming(
            latency_ns=time.perf_counter_ns() - start,
            h2d_ns=int(ev[0].elapsed_time(ev[1]) * 1e6),
            compute_ns=int(ev[1].elapsed_time(ev[2]) * 1e6),
            d2h_ns=int(ev[2].elapsed_time(ev[3]) * 1e6),
        )

    def compute(self, x: Any) -> list[Any]:
        """`Runner.compute` on the runner's stream, from and to its bound device buffers.

        `x` (on the unit's GPU for `cuda` units, or any other device or the host) is copied
        into the bound input buffer after the work already queued for it on its device's
        current stream; the engine runs (the captured graph is replayed); the bound output
        buffers are returned on `cuda` units. DLA units compute on the host's side of the
        contract: the outputs come back through the pinned host buffers. Either way they are
        the runner's own buffers, overwritten by the next batch, and complete on return.
        """
        import torch

        expected = (self.batch, *self.input_shape)
        if tuple(x.shape) != expected:
            raise UsageError(f"tensor of shape {tuple(x.shape)} given, runner takes {expected}")
        stream = self._stream
        if x.is_cuda:  # produced on another stream: order the copy after it
            stream.wait_stream(torch.cuda.current_stream(x.device))
        to_host = compute_device(self.unit).type == "cpu"
        with torch.cuda.stream(stream):
            self._x_dev.copy_(x, non_blocking=True)  # converts the dtype on the way
            if self._graph is not None:
                self._graph.replay()
            else:
                self._enqueue()
            if to_host:
                for dst, src in zip(self._y_host, self._y_dev, strict=True):
                    dst.copy_(src, non_blocking=True)
        stream.synchronize()
        return list(self._y_host if to_host else self._y_dev)

    def set_input(self, batch: np.ndarray) -> None:
        """Copy `batch` into the input buffer (pinned host, or device when pre-staged)."""
        import torch

        expected = (self.batch, *self.input_shape)
        if tuple(batch.shape) != expected:
            raise UsageError(f"batch of shape {tuple(batch.shape)} given, runner takes {expected}")
        self._x_host.copy_(torch.from_numpy(np.ascontiguousarray(batch)))

    def outputs(self) -> list[np.ndarray]:
        """The last batch's outputs (`host_output`: floats as float32)."""
        return [host_output(t) for t in self._y_host]

    def close(self) -> None:
        """Drop the graph before the buffers and the context it reads."""
        self._graph = None
        self._context = None


@register_engine
class TrtEngine(Engine):
    """TensorRT on `cuda:N/*` and `dla:N/*` units (optional: the `tensorrt` package)."""

    name = "tensorrt"
    unit_kinds = ("cuda", "dla")

    requires = ("tensorrt",)
    install_hint = ("pip install tensorrt (on a Jetson it comes with JetPack); it needs an "
                    "NVIDIA GPU")
    options_model = TrtOptions

    def __init__(self) -> None:
        super().__init__()
        self._logger: Any = None

    def _build(self, model: LoadedModel, unit: Unit, batch: int, opts: TrtOptions, data: str,
               instance: int) -> TrtRunner:
        """Build (or load from the cache) an engine for `unit` at `batch`; return a runner."""
        import tensorrt as trt
        import torch

        api = trt_api(trt)
        plan = build_plan(unit, opts, api)
        started = time.perf_counter()
        onnx_file = self.onnx_for(model, opts.opset)
        precision_info: dict[str, Any] = {}
        if plan.model_precision != "fp32":
            from infermux.quantize import model_at_precision

            onnx_file, precision_info = model_at_precision(
                onnx_file, plan.model_precision, model.input_shape,
                calibration_data=plan.calibration_data, calibration_items=plan.calibration_items,
                method=plan.quantize_method, tool=plan.quantize_tool,
                precision_tool=plan.precision_tool)
        gpu_index = plan.device_index if plan.device == "gpu" else 0
        device_name = torch.cuda.get_device_name(gpu_index)
        folder = Path(opts.engine_cache_dir) if opts.engine_cache_dir else cache_dir() / "tensorrt"
        folder.mkdir(parents=True, exist_ok=True)
        cache_key = engine_cache_key(onnx_file.digest, plan, batch, trt.__version__, device_name)
        engine_path = folder / f"{model.name}-{cache_key}.engine"
        self._logger = self._logger or trt.Logger(trt.Logger.WARNING)
        # Everything that touches the device (build, deserialization, the execution context,
        # buffers, stream, warm-up and graph) happens on the unit's GPU: an engine or context
        # made while device 0 is current is bound to device 0.
        with torch.cuda.device(gpu_index):
            # Without the timing cache every build is a fresh draw: never served from the cache.
            if not engine_path.is_file() or not plan.reuse_timing_cache:
                serialized = self._build_engine(trt, api, onnx_file, model, plan, batch, folder,
                                                device_name)
                write_atomic(engine_path, serialized)
                bound_after_write(cache_dir(), engine_path)
            else:
                touch(engine_path)
            runtime = trt.Runtime(self._logger)
            if plan.device == "dla":
                runtime.DLA_core = plan.device_index
            trt_engine = runtime.deserialize_cuda_engine(engine_path.read_bytes())
            if trt_engine is None:
                raise RunError(f"TensorRT could not load the cached engine {engine_path}: delete it "
                               "to rebuild (built by another TensorRT release or device?)")
            try:
                runner = TrtRunner(trt_engine, unit, batch, model.input_shape, plan, opts, data,
                                   started)
            except (UsageError, RunError):
                raise
            except Exception as exc:
                raise RunError(f"tensorrt failed to run {model.name} on {unit.id} at batch {batch}: "
                               f"{type(exc).__name__}: {exc}") from exc
        runner.options.update(onnx_file=str(onnx_file.path), engine_file=str(engine_path),
                              onnx_sha256=onnx_file.digest, tensorrt_version=api.version,
                              **precision_info)
        return runner

    def _build_engine(self, trt: Any, api: TrtApi, onnx_file: ExportedModel, model: LoadedModel,
                      plan: BuildPlan, batch: int, folder: Path, device_name: str) -> bytes:
        builder = trt.Builder(self._logger)
        network = builder.create_network(network_flags(trt, plan.typing))
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse(onnx_file.path.read_bytes()):
            errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise RunError(f"TensorRT cannot parse {onnx_file.path.name}: "
                           f"{'; '.join(errors)[:400] or 'no error given'}")
        config = builder.create_builder_config()
        for flag in plan.set_flags:
            if not hasattr(trt.BuilderFlag, flag):
                raise UsageError(f"TensorRT {trt.__version__} has no {flag} build mode for this unit")
            config.set_flag(getattr(trt.BuilderFlag, flag))
        for flag in plan.clear_flags:
            if hasattr(trt.BuilderFlag, flag):  # TF32 off: a release without TF32 has it off
                config.clear_flag(getattr(trt.BuilderFlag, flag))
        if plan.device == "dla":
            config.default_device_type = trt.DeviceType.DLA
            config.DLA_core = plan.device_index
        if plan.workspace_mib:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.workspace_mib << 20)
        if plan.builder_optimization_level is not None:
            config.builder_optimization_level = plan.builder_optimization_level
        profile = builder.create_optimization_profile()
        others: dict[str, tuple[int, ...]] = {}
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            if i == 0:
                shape = (batch, *model.input_shape)
            else:  # another input of the network: its own sizes, the batch on a dynamic axis 0
                dims = tuple(int(d) for d in tensor.shape)
                shape = tuple(batch if j == 0 and d < 0 else d for j, d in enumerate(dims))
                if any(d < 0 for d in shape):
                    raise UsageError(
                        f"input {tensor.name!r} of {model.name} has dynamic sizes {dims} beyond "
                        "the batch axis: export the model with fixed sizes for every input")
                others[tensor.name] = shape
            profile.set_shape(tensor.name, shape, shape, shape)  # fixed: DLAs take static shapes
        config.add_optimization_profile(profile)
        timing_path = folder / timing_cache_name(plan, api.version, device_name)
        reuse = plan.reuse_timing_cache and timing_path.is_file()
        timing = config.create_timing_cache(timing_path.read_bytes() if reuse else b"")
        config.set_timing_cache(timing, ignore_mismatch=False)
        if plan.calibrate:
            if not api.calibrators:
                raise UsageError(f"TensorRT {trt.__version__} has no calibrator API: pass an ONNX "
                                 "model quantised with Q/DQ nodes instead")
            calib_key = hashlib.sha256(
                f"{onnx_file.digest}|{calibration_identity(plan.calibration_data)}|"
                f"{plan.calibration_items}".encode()).hexdigest()[:16]
            calibrator = _make_calibrator(
                trt, calibration_batches(plan.calibration_data or "random", model.input_shape,
                                         batch, plan.calibration_items),
                batch, folder / f"calibration-{calib_key}.cache", others)
            config.int8_calibrator = calibrator
            config.set_calibration_profile(profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise RunError(f"TensorRT failed to build {model.name} for {plan.device}:"
                           f"{plan.device_index} ({plan.precision}); the log above says which "
                           "layer" + (" (try gpu_fallback=true)" if plan.device == "dla" else ""))
        if plan.reuse_timing_cache:
            # Atomic: a concurrent build reads the old cache or the new one, never half of one.
            write_atomic(timing_path, bytes(config.get_timing_cache().serialize()))
        return bytes(serialized)


def network_flags(trt: Any, typing: str) -> int:
    """`create_network`'s flags for a typing, from what the module has.

    Strong: the STRONGLY_TYPED bit (accepted and redundant on TensorRT 11, where every network
    is strongly typed). Weak: EXPLICIT_BATCH where it still exists (8.x; ignored from 10).
    """
    creation = trt.NetworkDefinitionCreationFlag
    name = "STRONGLY_TYPED" if typing == "strong" else "EXPLICIT_BATCH"
    return 1 << int(getattr(creation, name)) if hasattr(creation, name) else 0


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)[:40]
