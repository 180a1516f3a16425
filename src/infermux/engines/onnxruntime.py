"""The ONNX Runtime engine: CPU, CUDA and TensorRT execution providers over one exported file.

Units: `cpu` and core sets (CPU provider, intra-op threads = the unit's cores per instance),
`cpu/int8` and `cpu:0-1/int8` (the CPU provider running a Q/DQ int8 model, made once from
calibration data by `infermux.quantize`, or, for a model of token ids and masks, a dynamically
quantized one: int8 MatMul weights, activations quantized per batch), `cuda:N/fp32|tf32`
(CUDA provider), `cuda:N/fp16|int8` and `dla:N/fp16|int8` (TensorRT provider, with its engine
and timing caches). The GPU providers need the `onnxruntime-gpu` wheel.

Transformer encoders on the CPU: `transformer_fusion=true` loads the file rewritten by ONNX
Runtime's transformer optimizer (`engines/onnxruntime_fusion.py`: fused Attention, embedding
and skip LayerNorms, BiasGelu), in fp32 or before the dynamic int8 quantization.

The TensorRT provider follows the TensorRT engine's rules: linked against TensorRT 11 (ONNX
Runtime 1.27 and later), networks are strongly typed, so fp16 comes from a model cast to fp16 and
int8 from a Q/DQ model, never from `trt_fp16_enable`/`trt_int8_enable`; against TensorRT 10 the
flags and calibration tables still apply (and the DLA needs them).

A batch costs one `run_with_iobinding` call: the input and outputs are bound once to preallocated
buffers (numpy on the host, OrtValues on the GPU), so no per-batch dict, list or array is built.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from infermux.engines.base import (
    BatchTiming,
    Engine,
    Runner,
    compute_device,
    host_array,
    host_output,
    parse_options,
    register_engine,
)
from infermux.errors import RunError, UsageError, first_line
from infermux.export import cache_dir
from infermux.iospec import TensorSpec
from infermux.models import LoadedModel
from infermux.units import Unit

__all__ = ["OrtEngine", "OrtOptions", "OrtRunner", "check_batch_dim", "model_precision",
           "provider_config", "trt_typing"]

Provider = Literal["cpu", "cuda", "tensorrt"]
_PROVIDER_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
_OPT_LEVELS = ("disable", "basic", "extended", "all")
_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
             "tensor(double)": np.float64, "tensor(uint8)": np.uint8, "tensor(int8)": np.int8,
             "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


class OrtOptions(BaseModel):
    """Options of the ONNX Runtime engine; `None` means "the engine decides for the unit"."""

    model_config = ConfigDict(extra="forbid")

    provider: Provider | None = None
    intra_op_threads: int | None = Field(None, ge=1)
    inter_op_threads: int | None = Field(None, ge=1)
    graph_optimization: Literal["disable", "basic", "extended", "all"] = "all"
    execution_mode: Literal["sequential", "parallel"] = "sequential"
    #: Intra-op threads spin while waiting for work: faster alone, wasteful beside other instances.
    allow_spinning: bool = True
    #: Pin the pool's threads to the unit's cores (on a core-set unit such as cpu:0-3).
    pin_threads: bool | None = None
    fp16: bool | None = None
    int8: bool | None = None
    int8_calibration_table: str | None = None
    dla_core: int | None = Field(None, ge=0)
    #: int8 (cpu/int8 units; the TensorRT provider when strongly typed): calibration data for
    #: the Q/DQ model: an image folder, an (N, *input) .npy file, or "random" (the default:
    #: right for timing, meaningless for accuracy).
    calibration_data: str | None = None
    calibration_items: int = Field(256, ge=1)
    #: How int8 is made: calibrated Q/DQ (minmax, entropy, percentile), or dynamic (CPU
    #: provider: int8 MatMul weights, activations quantized per batch, no calibration). None:
    #: minmax for a model of one float input, dynamic for one of token ids and masks.
    quantize_method: Literal["minmax", "entropy", "percentile", "dynamic"] | None = None
    quantize_tool: Literal["onnxruntime", "modelopt"] = "onnxruntime"
    #: CPU provider: rewrite a transformer encoder with ONNX Runtime's fused operators
    #: (Attention, EmbedLayerNormalization, SkipLayerNormalization, BiasGelu) before loading it.
    transformer_fusion: bool = False
    #: The TensorRT provider: strongly typed (TensorRT 11: precision from the model), weakly
    #: typed (TensorRT 10: precision flags), or auto (by the TensorRT release installed).
    trt_typing: Literal["auto", "strong", "weak"] = "auto"
    #: The TensorRT provider reads and writes its timing cache (false: kernels timed afresh).
    reuse_timing_cache: bool = True
    cuda_graph: bool = False
    engine_cache_dir: str | None = None
    opset: int | None = None
    warmup_iters: int = Field(3, ge=0)

    def resolve(self, unit: Unit) -> OrtOptions:
        """Fill the defaults for `unit` and reject what the unit cannot do, naming the option."""
        update: dict[str, Any] = {}
        provider = self.provider
        if unit.kind == "cpu":
            provider = provider or "cpu"
            if provider != "cpu":
                raise UsageError(f"option provider={provider} needs a GPU unit, not {unit.id!r}")
            if self.fp16 or self.dla_core is not None or self.cuda_graph:
                raise UsageError(
                    f"options fp16/dla_core/cuda_graph need the TensorRT or CUDA provider; "
                    f"unit {unit.id!r} runs the CPU provider: use a cuda:N/fp16 or dla:N unit"
                )
            if self.int8 is not None and self.int8 != (unit.mode == "int8"):
                raise UsageError(
                    f"option int8={str(self.int8).lower()} on unit {unit.id!r}: a CPU unit's "
                    "precision is in its name: use the unit cpu/int8 (or cpu:0-1/int8) for int8, "
                    "cpu for fp32, and drop the option")
            update["int8"] = unit.mode == "int8"
            if self.quantize_method == "dynamic" and unit.mode != "int8":
                raise UsageError(f"option quantize_method=dynamic makes int8: use the unit "
                                 f"cpu/int8 (or cpu:0-1/int8), not {unit.id!r}")
            update["intra_op_threads"] = self.intra_op_threads or len(unit.cores) or 1
            update["pin_threads"] = (self.pin_threads if self.pin_threads is not None
                                     else unit.id != "cpu")
        elif unit.kind in ("cuda", "dla"):
            if self.transformer_fusion or self.quantize_method == "dynamic":
                option = ("transformer_fusion=true" if self.transformer_fusion
                          else "quantize_method=dynamic")
                raise UsageError(f"option {option} is for ONNX Runtime's CPU provider, not "
                                 f"{unit.id!r}: use the unit cpu (cpu/int8 for int8)")
            if unit.mode == "bf16":
                raise UsageError(f"ONNX Runtime has no bf16 mode for {unit.id!r}: use fp16 or tf32")
            needs_trt = unit.kind == "dla" or unit.mode in ("fp16", "int8")
            provider = provider or ("tensorrt" if needs_trt else "cuda")
            if needs_trt and provider != "tensorrt":
                raise UsageError(
                    f"option provider={provider} cannot run {unit.id!r}: {unit.mode} and DLA units "
                    "run on the TensorRT provider (provider=tensorrt)"
                )
            if provider == "cpu":
                raise UsageError(f"option provider=cpu on GPU unit {unit.id!r}: use the unit cpu")
            update["fp16"] = self.fp16 if self.fp16 is not None else unit.mode == "fp16"
            update["int8"] = self.int8 if self.int8 is not None else unit.mode == "int8"
            if unit.kind == "dla":
                update["dla_core"] = unit.index if self.dla_core is None else self.dla_core
            elif self.dla_core is not None:
                raise UsageError(f"option dla_core={self.dla_core} needs a dla:N unit, not {unit.id!r}")
            if provider == "tensorrt":
                from infermux.engines.tensorrt import installed_trt_major

                typing = trt_typing(self.trt_typing, installed_trt_major())
                if typing == "strong" and unit.kind == "dla":
                    raise UsageError(
                        f"unit {unit.id!r}: the DLA needs TensorRT 10's weakly typed build "
                        "(JetPack 6); this TensorRT is strongly typed: pass trt_typing=weak with "
                        "TensorRT 10, or use a cuda unit")
                update["trt_typing"] = typing
            update["intra_op_threads"] = self.intra_op_threads or 1
        else:
            raise UsageError(f"the onnxruntime engine cannot run on unit {unit.id!r}")
        update["provider"] = provider
        return self.model_copy(update=update)


def trt_typing(requested: str, trt_major: int | None) -> str:
    """`strong` or `weak` for the TensorRT provider: `auto` follows the installed TensorRT.

    TensorRT 11 has no precision flags (strong); TensorRT 10 and older, or a release that cannot
    be told here, keep the flags (weak). Pure: tested for both releases without either.
    """
    if requested != "auto":
        return requested
    return "strong" if trt_major is not None and trt_major >= 11 else "weak"


def model_precision(unit: Unit, opts: OrtOptions) -> str:
    """The precision set in the ONNX model the session loads (fp32 unless the unit needs it).

    cpu int8 units load a Q/DQ model; the strongly typed TensorRT provider loads a model cast
    to fp16 or a Q/DQ one. Everything else loads the fp32 export and is told by flags.
    """
    if opts.provider == "cpu":
        return "int8" if opts.int8 else "fp32"
    if opts.provider == "tensorrt" and opts.trt_typing == "strong":
        return "int8" if opts.int8 else ("fp16" if opts.fp16 else "fp32")
    return "fp32"


def provider_config(unit: Unit, opts: OrtOptions, cache_root: Path) -> list[tuple[str, dict[str, str]]]:
    """The (provider, provider options) list a session is created with, most preferred first.

    Pure: tests check the translation of units and options without a GPU.
    """
    if opts.provider == "cpu":
        return [("CPUExecutionProvider", {})]
    device = {"device_id": str(unit.index if unit.kind == "cuda" else 0)}
    cuda = {**device, "cudnn_conv_algo_search": "EXHAUSTIVE",
            "use_tf32": "1" if unit.mode == "tf32" else "0"}
    if opts.provider == "cuda":
        if opts.cuda_graph:
            cuda["enable_cuda_graph"] = "1"
        return [("CUDAExecutionProvider", cuda), ("CPUExecutionProvider", {})]
    cache = Path(opts.engine_cache_dir) if opts.engine_cache_dir else cache_root / "ort-trt"
    weak = opts.trt_typing != "strong"  # strongly typed: the precision is in the model
    trt = {
        **device,
        "trt_fp16_enable": str(bool(opts.fp16) and weak),
        "trt_int8_enable": str(bool(opts.int8) and weak),
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache),
        # A timing cache makes a rebuild pick the kernels timed the first time: reproducible.
        "trt_timing_cache_enable": str(opts.reuse_timing_cache),
        "trt_timing_cache_path": str(cache),
    }
    if opts.int8 and weak and opts.int8_calibration_table:
        trt["trt_int8_calibration_table_name"] = opts.int8_calibration_table
    if opts.dla_core is not None:
        trt["trt_dla_enable"] = "True"
        trt["trt_dla_core"] = str(opts.dla_core)
    if opts.cuda_graph:
        trt["trt_cuda_graph_enable"] = "True"
    # Layers TensorRT cannot take fall back to the CUDA provider, then the CPU one.
    return [("TensorrtExecutionProvider", trt), ("CUDAExecutionProvider", cuda),
            ("CPUExecutionProvider", {})]


def _thread_affinities(cores: tuple[int, ...], threads: int) -> str:
    """ORT's affinity string for the pool threads (all but the caller's): 1-based core ids."""
    return ";".join(str(cores[i % len(cores)] + 1) for i in range(1, threads))


class OrtRunner(Runner):
    """One session, one batch size, input and outputs bound once to preallocated buffers."""

    engine = "onnxruntime"

    def __init__(self, session: Any, unit: Unit, batch: int, input_shape: tuple[int, ...],
                 opts: OrtOptions, data: str, started: float,
                 input_specs: tuple[TensorSpec, ...] = (), length: int | None = None) -> None:
        import onnxruntime as ort

        self.unit = unit
        self.batch = batch
        self.input_shape = input_shape
        self.input_specs = input_specs
        self.length = length
        self.options = {**opts.model_dump(), "precision": _precision(opts, unit)}
        self._session = session
        metas = session.get_inputs()
        if input_specs and [m.name for m in metas] != [t.name for t in input_specs]:
            raise RunError(f"the ONNX file's inputs {[m.name for m in metas]} are not the "
                           f"model's {[t.name for t in input_specs]}")
        self._input_name = metas[0].name
        rng = np.random.default_rng(0)
        # One host buffer per input: runnable values (ids within the vocabulary, masks of ones)
        # for a model of several inputs, normal floats for one.
        self._xs: list[np.ndarray] = []
        for i, meta in enumerate(metas if input_specs else metas[:1]):
            dtype = _NP_TYPES.get(meta.type, np.float32)
            if input_specs:
                self._xs.append(input_specs[i].generate(batch, {}, rng).astype(dtype))
            else:
                self._xs.append(rng.standard_normal((batch, *input_shape)).astype(dtype))
        self._x = self._xs[0]
        on_gpu = opts.provider != "cpu"
        device_id = unit.index if unit.kind == "cuda" else 0
        names = [m.name for m in metas[: len(self._xs)]]
        # Outputs' shapes from one plain run; then everything is bound once.
        first = session.run(None, dict(zip(names, self._xs, strict=True)))
        self._binding = session.io_binding()
        self._x_value: Any
        if on_gpu and data == "device":
            self._x_values = [ort.OrtValue.ortvalue_from_numpy(x, "cuda", device_id)
                              for x in self._xs]
            self._y_values = [ort.OrtValue.ortvalue_from_shape_and_type(
                y.shape, y.dtype, "cuda", device_id) for y in first]
            self._y = [np.empty_like(y) for y in first]
        else:
            # OrtValues that share the numpy buffers' memory.
            self._x_values = [ort.OrtValue.ortvalue_from_numpy(x) for x in self._xs]
            self._y = [np.empty_like(y) for y in first]
            self._y_values = [ort.OrtValue.ortvalue_from_numpy(y) for y in self._y]
        self._x_value = self._x_values[0]
        self._on_device = on_gpu and data == "device"
        for name, value in zip(names, self._x_values, strict=True):
            self._binding.bind_ortvalue_input(name, value)
        for meta_out, value in zip(session.get_outputs(), self._y_values, strict=True):
            self._binding.bind_ortvalue_output(meta_out.name, value)
        for _ in range(max(1, opts.warmup_iters)):
            self.run()
        self.build_s = time.perf_counter() - started

    def run(self) -> BatchTiming:
        """One batch through the session; the copies a GPU provider makes are inside the time."""
        start = time.perf_counter_ns()
        self._session.run_with_iobinding(self._binding)
        if self._on_device:
            self._binding.synchronize_outputs()
        latency = time.perf_counter_ns() - start
        return BatchTiming(latency_ns=latency, compute_ns=latency)

    def set_input(self, batch: np.ndarray) -> None:
        """Copy `batch` into the bound input buffer."""
        expected = (self.batch, *self.input_shape)
        if tuple(batch.shape) != expected:
            raise UsageError(f"batch of shape {tuple(batch.shape)} given, runner takes {expected}")
        if self._on_device:
            self._x[...] = batch
            self._x_value.update_inplace(self._x)
        else:
            self._x[...] = batch

    def set_inputs(self, arrays: Any) -> None:
        """Copy one batch of every input (in the model's order) into the bound buffers."""
        if not self.input_specs:
            super().set_inputs(arrays)
            return
        self.check_inputs(arrays)
        for x, value, array in zip(self._xs, self._x_values, arrays, strict=True):
            x[...] = array
            if self._on_device:
                value.update_inplace(x)

    def compute(self, x: Any) -> list[Any]:
        """`Runner.compute`: one copy into the bound input, outputs returned without a copy.

        The outputs are torch views of the bound output buffers (host units), valid until the
        next batch; GPU units get them on the unit's device.
        """
        import torch

        self.set_input(host_array(x))
        self.run()
        if self._on_device:
            outs = [torch.from_numpy(v.numpy()) for v in self._y_values]
        else:
            outs = [torch.from_numpy(y) for y in self._y]
        device = compute_device(self.unit)
        return outs if device.type == "cpu" else [t.to(device) for t in outs]

    def outputs(self) -> list[np.ndarray]:
        """The last batch's outputs (`host_output`: floats as float32)."""
        if self._on_device:
            return [host_output(v.numpy()) for v in self._y_values]
        return [host_output(y) for y in self._y]

    def close(self) -> None:
        """Drop the binding and the session."""
        self._binding = None
        self._session = None


def _precision(opts: OrtOptions, unit: Unit) -> str:
    if opts.int8:
        return "int8"
    if opts.fp16:
        return "fp16"
    return "tf32" if unit.mode == "tf32" else "fp32"


@register_engine
class OrtEngine(Engine):
    """ONNX Runtime on `cpu`, `cuda:N/*` and `dla:N/*` units."""

    name = "onnxruntime"
    unit_kinds = ("cpu", "cuda", "dla")

    requires = ("onnxruntime",)
    install_hint = "pip install 'infermux[onnx]' (onnxruntime-gpu for GPUs)"
    options_model = OrtOptions
    takes_io = True

    def unsupported_reason(self, unit: Unit) -> str:
        """Why `unit` cannot run here ("" when it can): GPU units need onnxruntime-gpu."""
        why = super().unsupported_reason(unit)
        if why or unit.kind == "cpu":
            return why
        import onnxruntime as ort

        needed = ("TensorrtExecutionProvider" if unit.kind == "dla" or unit.mode in ("fp16", "int8")
                  else "CUDAExecutionProvider")
        if needed not in ort.get_available_providers():
            return f"{unit.id} needs ONNX Runtime's {needed}: pip install onnxruntime-gpu"
        return ""

    def resolve_options(self, options: dict[str, Any] | None, unit: Unit, model: LoadedModel,
                        data: str) -> OrtOptions:
        """Parsed, with defaults resolved for the unit (provider, threads)."""
        opts = parse_options(OrtOptions, "onnxruntime", options).resolve(unit)
        if opts.quantize_method is None and opts.int8:
            # Calibration feeds one float input; token ids and masks get dynamic int8.
            method = "minmax" if model.spec_io.simple or opts.provider != "cpu" else "dynamic"
            opts = opts.model_copy(update={"quantize_method": method})
        if opts.cuda_graph and data != "device":
            raise UsageError("option cuda_graph=true needs inputs and outputs in device memory "
                             "(ONNX Runtime replays fixed addresses): add --data device")
        return opts

    def _build(self, model: LoadedModel, unit: Unit, batch: int, opts: OrtOptions, data: str,
               instance: int) -> OrtRunner:
        """A session for `unit` (one per instance: each owns its intra-op pool) at `batch`."""
        return self._build_io(model, unit, batch, opts, data, instance, None)

    def _build_io(self, model: LoadedModel, unit: Unit, batch: int, opts: OrtOptions,
                  data: str, instance: int, length: int | None) -> OrtRunner:
        """A session at (`batch`, `length`): the file's dynamic dims take the bound shapes."""
        import onnxruntime as ort

        io = model.spec_io
        dims = {} if io.simple else io.dims_for(length)
        specs = () if io.simple else io.resolved(dims)
        dynamic = opts.provider == "cpu" and opts.quantize_method == "dynamic"
        if specs and model_precision(unit, opts) != "fp32" and not dynamic:
            hint = (f"drop quantize_method={opts.quantize_method} (int8 is then dynamic, with "
                    "no calibration)" if opts.provider == "cpu" else "use an fp32 unit")
            raise UsageError(f"{model.name!r} takes several or integer inputs; the {unit.id} "
                             "precision needs a calibrated or cast model, which infermux makes "
                             f"for one float input only: {hint}")

        provider = _PROVIDER_NAMES[opts.provider or "cpu"]
        if provider not in ort.get_available_providers():
            raise UsageError(
                f"unit {unit.id!r} needs ONNX Runtime's {provider}, which this install lacks "
                f"(it has {', '.join(ort.get_available_providers())}): pip install onnxruntime-gpu"
            )
        started = time.perf_counter()
        onnx_file = self.onnx_for(model, opts.opset)
        precision_info: dict[str, Any] = {}
        if opts.transformer_fusion:
            from infermux.engines.onnxruntime_fusion import fuse_transformer

            shape = getattr(model.module, "attention_shape", None)
            onnx_file, fused = fuse_transformer(onnx_file, shape() if shape else None)
            precision_info["fused_operators"] = fused
        precision = model_precision(unit, opts)
        if precision != "fp32":
            from infermux.quantize import model_at_precision

            onnx_file, info = model_at_precision(
                onnx_file, precision, model.input_shape, calibration_data=opts.calibration_data,
                calibration_items=opts.calibration_items,
                method=opts.quantize_method or "minmax", tool=opts.quantize_tool)
            precision_info.update(info)
        so = ort.SessionOptions()
        so.intra_op_num_threads = opts.intra_op_threads or 1
        so.inter_op_num_threads = opts.inter_op_threads or 1
        so.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[opts.graph_optimization]
        so.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if opts.execution_mode == "parallel"
                             else ort.ExecutionMode.ORT_SEQUENTIAL)
        so.add_session_config_entry("session.intra_op.allow_spinning",
                                    "1" if opts.allow_spinning else "0")
        threads = opts.intra_op_threads or 1
        if opts.pin_threads and unit.cores and threads > 1:
            so.add_session_config_entry("session.intra_op.thread_affinities",
                                        _thread_affinities(unit.cores, threads))
        so.log_severity_level = 3
        providers = provider_config(unit, opts, cache_dir())
        try:
            session = ort.InferenceSession(str(onnx_file.path), sess_options=so,
                                           providers=[p for p, _ in providers],
                                           provider_options=[o for _, o in providers])
        except Exception as exc:  # onnxruntime raises its own pybind types (Fail, InvalidGraph…)
            raise RunError(
                f"ONNX Runtime cannot load {onnx_file.path.name} for {unit.id}: "
                f"{first_line(exc)}; check the file with onnx.checker or re-export it"
            ) from exc
        check_batch_dim(session.get_inputs()[0].shape, batch, onnx_file.path)
        try:
            runner = OrtRunner(session, unit, batch, model.input_shape, opts, data, started,
                               input_specs=specs, length=next(iter(dims.values()), None))
        except UsageError:
            raise
        except Exception as exc:
            raise RunError(f"onnxruntime failed to run {model.name} on {unit.id} at batch "
                           f"{batch}: {first_line(exc)}") from exc
        runner.options["onnx_file"] = str(onnx_file.path)
        runner.options["onnx_sha256"] = onnx_file.digest
        runner.options.update(precision_info)
        return runner


def check_batch_dim(shape: list[Any], batch: int, path: Path) -> None:
    """A file with a fixed batch dimension runs only that batch: say so before running."""
    first = shape[0] if shape else None
    if isinstance(first, int) and first > 0 and first != batch:
        raise UsageError(
            f"ONNX file {path.name!r} has a fixed batch of {first}, not {batch}: "
            f"pass --batch {first} or export it with a dynamic batch axis"
        )


