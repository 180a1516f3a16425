"""Precision set in the ONNX model itself: fp16/bf16 casts, and int8 by explicit Q/DQ nodes.

TensorRT 11 builds strongly typed networks only: the builder flags that let it pick fp16 or
int8 kernels (`BuilderFlag.FP16`, `INT8`) and the int8 calibrators are gone, and the precision
of every tensor comes from the ONNX model. This module makes those models, once, cached on disk:

- `convert_precision(onnx, "fp16" | "bf16")`: weights and activations cast to the low type, with
  fp32 islands for the operators whose range or accumulation needs it (normalisations, softmax,
  exponentials, reductions), and fp32 inputs and outputs so the runners' buffers do not change.
  infermux's own graph pass, not onnxconverter-common's `float16` module: that one writes fp16
  only (no bf16) and is one more dependency, and the pass is ~150 lines whose islands are listed
  here. NVIDIA ModelOpt's AutoCast is used instead where it is installed and asked for
  (`tool="modelopt"`).
- `quantize_qdq(onnx, calibration, method)`: post-training static quantization that writes a
  Q/DQ model (int8 weights per output channel, uint8 activations) from calibration data, with
  ONNX Runtime's `quantize_static`, or ModelOpt's ONNX PTQ where installed and asked for. The
  same file runs on ONNX Runtime's CPU provider, OpenVINO (which folds the Q/DQ pairs into u8
  kernels) and TensorRT (explicit quantization). Cached by (model, data, method, tool).
- `quantize_dynamic_int8(onnx)`: dynamic quantization, the recipe for transformer encoders on
  the CPU: the weights of every MatMul (and of ONNX Runtime's fused Attention) become int8 per
  output channel, the activations are quantized per batch as they come (no calibration data,
  so it works for token ids and masks), with ONNX Runtime's `quantize_dynamic`. ONNX Runtime
  only (its MatMulInteger/DynamicQuantizeMatMul kernels).
- `load_calibration(spec, input_shape, items)`: calibration data from an image folder, a `.npy`
  file, or `random` (seeded noise: fine for timing, meaningless for accuracy).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infermux.cache import bound_after_write, touch
from infermux.errors import RunError, UsageError, first_line
from infermux.export import ExportedModel, cache_dir, file_digest, write_atomic

__all__ = [
    "FP32_ISLANDS",
    "LOW_PRECISIONS",
    "QUANT_METHODS",
    "QUANT_TOOLS",
    "PrecisionConfig",
    "calibration_batches",
    "calibration_identity",
    "cast_model",
    "convert_precision",
    "has_qdq",
    "load_calibration",
    "model_at_precision",
    "quantize_dynamic_int8",
    "quantize_qdq",
    "run_precision",
    "tensor_types",
]

#: Low precisions a model can be cast to, and their ONNX element types.
LOW_PRECISIONS = {"fp16": 10, "bf16": 16}  # onnx.TensorProto.FLOAT16, BFLOAT16
#: Calibration methods (ONNX Runtime's names; ModelOpt has minmax as `max`, entropy as such),
#: and `dynamic`: no calibration, activations quantized per batch (`quantize_dynamic_int8`).
QUANT_METHODS = ("minmax", "entropy", "percentile", "dynamic")
#: Who quantizes: ONNX Runtime's tools (always there with the onnx extra) or NVIDIA ModelOpt.
QUANT_TOOLS = ("onnxruntime", "modelopt")
#: Operators kept in fp32 in a cast model: normalisations and softmax (ranges, sums of squares),
#: exponentials and logarithms (overflow), reductions that sum many values, and resize (its
#: scales input is float32 by the ONNX spec).
FP32_ISLANDS = frozenset({
    "BatchNormalization", "LayerNormalization", "GroupNormalization", "InstanceNormalization",
    "LpNormalization", "MeanVarianceNormalization", "Softmax", "LogSoftmax", "Exp", "Log", "Pow",
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp", "Resize",
    "Upsample", "RoiAlign", "NonMaxSuppression", "Range", "TopK", "CumSum", "Einsum",
})
#: Operators whose output type does not follow their float inputs: left as they are.
_NEUTRAL = frozenset({
    "Cast", "CastLike", "Shape", "Size", "Constant", "ConstantOfShape", "EyeLike", "RandomNormal",
    "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "QuantizeLinear",
    "DequantizeLinear", "DynamicQuantizeLinear", "NonZero", "Bernoulli",
})
#: bf16 for Conv, pooling and HardSwish came with opset 22: a bf16 model is moved there.
_BF16_MIN_OPSET = 22
#: Bumped when the cast pass or the quantization recipe changes what they write.
_RECIPE = 2
_FLOAT = 1  # onnx.TensorProto.FLOAT
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
#: ImageNet normalisation applied to calibration images (what torchvision classifiers expect).
_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise UsageError("setting a model's precision needs the onnx package: "
                         "pip install 'infermux[onnx]'") from None
    return onnx


# --- fp16 / bf16 --------------------------------------------------------------------------------

def cast_model(model: Any, precision: str, islands: frozenset[str] = FP32_ISLANDS) -> Any:
    """A copy of ONNX `model` computing in `precision` (fp16 | bf16), fp32 at its edges.

    Every float tensor produced by an operator outside `islands` (and `_NEUTRAL`) becomes the
    low type; float initializers read by such operators get a low copy (no run-time cast);
    anything else that crosses between the two worlds gets one Cast node. Graph inputs and
    outputs stay float32. Control flow (If, Loop, Scan) is refused: its subgraphs have types of
    their own.
    """
    onnx = _onnx()
    from onnx import helper, numpy_helper, shape_inference

    if precision not in LOW_PRECISIONS:
        raise UsageError(f"precision {precision!r} cannot be set in a model: use "
                         f"{' or '.join(LOW_PRECISIONS)}")
    low = LOW_PRECISIONS[precision]
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    subgraphs = sorted({n.op_type for n in graph.node if n.op_type in ("If", "Loop", "Scan")})
    if subgraphs:
        raise UsageError(f"the model has control flow ({', '.join(subgraphs)}), which the "
                         f"{precision} cast cannot type: give an ONNX file already in {precision}")
    if precision == "bf16":
        model = _at_least_opset(model, _BF16_MIN_OPSET)
        graph = model.graph
    types = tensor_types(shape_inference.infer_shapes(model))
    initializers = {t.name: t for t in graph.initializer}
    dtype: dict[str, int] = dict(types)  # what each tensor holds in the new graph
    casts: dict[tuple[str, int], str] = {}
    low_copies: dict[str, str] = {}
    new_nodes: list[Any] = []
    new_inits: list[Any] = []

    def as_type(name: str, want: int) -> str:
        have = dtype.get(name)
        if have not in (_FLOAT, low) or have == want or not name:
            return name
        if name in initializers and want == low:  # a low copy of the weight, once
            if name not in low_copies:
                array = numpy_helper.to_array(initializers[name]).astype(np.float32)
                copy = _low_tensor(array, f"{name}__{precision}", precision)
                new_inits.append(copy)
                low_copies[name] = copy.name
                dtype[copy.name] = low
            return low_copies[name]
        key = (name, want)
        if key not in casts:
            out = f"{name}__to_{'fp32' if want == _FLOAT else precision}"
            new_nodes.append(helper.make_node("Cast", [name], [out], to=want, name=out))
            casts[key] = out
            dtype[out] = want
        return casts[key]

    for node in graph.node:
        float_inputs = [i for i in node.input if types.get(i) == _FLOAT]
        lowered = (node.op_type not in islands and node.op_type not in _NEUTRAL
                   and node.domain in ("", "ai.onnx") and bool(float_inputs))
        if node.op_type not in _NEUTRAL:
            want = low if lowered else _FLOAT
            for k, name in enumerate(node.input):
                if name in dtype and dtype[name] in (_FLOAT, low):
                    node.input[k] = as_type(name, want)
        for out in node.output:
            if types.get(out) == _FLOAT:
                dtype[out] = low if lowered else _FLOAT
        new_nodes.append(node)
    # Graph outputs computed in the low type: a last Cast writes the fp32 output under its name.
    renames: dict[str, str] = {}
    for output in graph.output:
        if dtype.get(output.name) == low:
            renames[output.name] = f"{output.name}__{precision}"
    if renames:
        for node in new_nodes:
            for k, name in enumerate(node.output):
                if name in renames:
                    node.output[k] = renames[name]
            for k, name in enumerate(node.input):
                if name in renames:
                    node.input[k] = renames[name]
        for original, renamed in renames.items():
            new_nodes.append(helper.make_node("Cast", [renamed], [original], to=_FLOAT,
                                              name=f"{original}__to_fp32"))
    del graph.node[:]
    graph.node.extend(new_nodes)
    used = {i for n in graph.node for i in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept + [t for t in new_inits if t.name in used])
    del graph.value_info[:]  # stale types; inference below writes the new ones
    model = shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model)
    return model


def _low_tensor(array: np.ndarray, name: str, precision: str) -> Any:
    from onnx import TensorProto, helper, numpy_helper

    if precision == "fp16":
        return numpy_helper.from_array(array.astype(np.float16), name)
    # bf16: the upper 16 bits of the fp32 pattern, rounded to nearest even.
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return helper.make_tensor(name, TensorProto.BFLOAT16, array.shape, rounded.tobytes(),
                              raw=True)


def _at_least_opset(model: Any, opset: int) -> Any:
    from onnx import version_converter

    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if current >= opset:
        return model
    try:
        return version_converter.convert_version(model, opset)
    except Exception as exc:  # onnx raises its own C++ errors for ops it cannot convert
        raise RunError(f"moving the model from opset {current} to {opset} (bf16 needs it) "
                       f"failed: {first_line(exc)}; export it at opset {opset} instead") from exc


def tensor_types(model: Any) -> dict[str, int]:
    """ONNX element type of every named tensor: inputs, outputs, values, initializers."""
    types: dict[str, int] = {}
    graph = model.graph
    for info in [*graph.input, *graph.output, *graph.value_info]:
        if info.type.HasField("tensor_type"):
            types[info.name] = info.type.tensor_type.elem_type
    for tensor in graph.initializer:
        types[tensor.name] = tensor.data_type
    for node in graph.node:  # Constant outputs are not always in value_info
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    types.setdefault(node.output[0], attr.t.data_type)
    return types


def convert_precision(source: ExportedModel | Path, precision: str, tool: str = "infermux",
                      root: Path | None = None) -> ExportedModel:
    """`source` cast to `precision` (see `cast_model`), cached by its digest and the recipe."""
    onnx = _onnx()
    path, digest = _source(source)
    if precision == "fp32":
        return source if isinstance(source, ExportedModel) else ExportedModel(
            path, digest, None, exported=False)
    if tool not in ("infermux", "modelopt"):
        raise UsageError(f"precision tool {tool!r} unknown: use infermux or modelopt")
    key = hashlib.sha256(f"{digest}|{precision}|{tool}|{_RECIPE}".encode()).hexdigest()[:20]
    target = (root or cache_dir()) / "onnx-precision" / f"{path.stem[:40]}-{precision}-{key}.onnx"
    if not _cached(target):
        if tool == "modelopt":
            proto = _modelopt_autocast(path, precision)
        else:
            proto = cast_model(onnx.load(str(path)), precision)
        _save_atomic(proto, target)
        _written(target)
    return ExportedModel(target, file_digest(target), None, exported=False)


def _modelopt_autocast(path: Path, precision: str) -> Any:
    try:
        from modelopt.onnx import autocast
    except ImportError:
        raise UsageError("precision tool modelopt needs NVIDIA ModelOpt: pip install "
                         "nvidia-modelopt, or use the default tool (infermux)") from None
    return autocast.convert_to_mixed_precision(onnx_path=str(path), low_precision_type=precision,
                                               keep_io_types=True)


# --- calibration data ----------------------------------------------------------------------------

def calibration_batches(data: str, input_shape: tuple[int, ...], batch: int,
                        items: int) -> Iterator[np.ndarray]:
    """Float32 batches for calibration: images resized and normalised, a .npy file, or noise.

    Images are read with Pillow, resized to the model's input (H, W) and normalised with
    ImageNet statistics; a source with fewer items than `items` is cycled.
    """
    count = max(1, -(-items // batch))
    if data == "random":
        rng = np.random.default_rng(0)
        for _ in range(count):
            yield rng.standard_normal((batch, *input_shape)).astype(np.float32)
        return
    if data.endswith(".npy"):
        array = _read_npy(data, input_shape)
        for k in range(count):
            rows = [(k * batch + j) % len(array) for j in range(batch)]
            yield np.ascontiguousarray(array[rows], dtype=np.float32)
        return
    folder = Path(data)
    if not folder.is_dir():
        raise UsageError(f"calibration data {data!r} is not a folder or a .npy file: pass a "
                         "folder of .jpg/.png images, an (N, *input) .npy array, or 'random'")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
    if not files:
        raise UsageError(f"calibration folder {data!r} has no .jpg/.png images")
    if len(input_shape) != 3 or input_shape[0] not in (1, 3):
        raise UsageError(f"image calibration needs a (C, H, W) input with 1 or 3 channels, not "
                         f"{input_shape}: use calibration_data=random or an .npy file")
    from PIL import Image  # a torchvision dependency

    mode = "RGB" if input_shape[0] == 3 else "L"
    mean = _MEAN if input_shape[0] == 3 else _MEAN[:1]
    std = _STD if input_shape[0] == 3 else _STD[:1]
    height, width = input_shape[1:]
    i = 0
    for _ in range(count):
        out = np.empty((batch, *input_shape), dtype=np.float32)
        for j in range(batch):
            with Image.open(files[i % len(files)]) as image:
                resized = image.convert(mode).resize((width, height), Image.Resampling.BILINEAR)
            pixels = np.asarray(resized, dtype=np.float32).reshape(height, width, -1) / 255.0
            out[j] = (pixels.transpose(2, 0, 1) - mean[:, None, None]) / std[:, None, None]
            i += 1
        yield out


def _read_npy(data: str, input_shape: tuple[int, ...]) -> np.ndarray:
    try:
        array = np.load(data, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise UsageError(f"calibration file {data!r} cannot be read as a numpy array ({exc}): "
                         "save it with numpy.save") from None
    if tuple(array.shape[1:]) != tuple(input_shape) or len(array) == 0:
        raise UsageError(f"calibration file {data!r} holds shape {tuple(array.shape)}; the model "
                         f"takes items of shape {tuple(input_shape)}: save (N, "
                         f"{', '.join(map(str, input_shape))})")
    return array


def load_calibration(data: str, input_shape: tuple[int, ...], items: int) -> np.ndarray:
    """`items` calibration inputs (float32, `(items, *input_shape)`) from `data`."""
    return np.concatenate(list(calibration_batches(data, input_shape, items, items)))[:items]


def calibration_identity(data: str | None) -> str:
    """What calibration data is, for cache keys.

    A folder's file names, sizes and times; a file's digest; or 'random'.
    """
    if data is None or data == "random":
        return str(data)
    path = Path(data)
    if path.is_file():
        return file_digest(path)
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
    h = hashlib.sha256(str(path.resolve()).encode())
    for p in files:
        stat = p.stat()
        h.update(f"{p.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


# --- int8 by Q/DQ --------------------------------------------------------------------------------

def quantize_qdq(source: ExportedModel | Path, calibration: np.ndarray, method: str = "minmax",
                 tool: str = "onnxruntime", root: Path | None = None,
                 per_channel: bool = True) -> ExportedModel:
    """A Q/DQ int8 model of `source`, its ranges calibrated on `calibration` (float32 items).

    Cached by (model digest, data digest, method, tool, per-channel): the same inputs give the
    same file without calibrating again.
    """
    if method not in QUANT_METHODS or method == "dynamic":
        raise UsageError(f"calibration method {method!r} unknown: use one of "
                         f"{', '.join(QUANT_METHODS[:-1])}")
    if tool not in QUANT_TOOLS:
        raise UsageError(f"quantization tool {tool!r} unknown: use one of {', '.join(QUANT_TOOLS)}")
    calibration = np.ascontiguousarray(calibration, dtype=np.float32)
    if len(calibration) == 0:
        raise UsageError("int8 needs calibration items and got none: pass calibration data "
                         "with at least one item")
    path, digest = _source(source)
    data_digest = hashlib.sha256(
        str(calibration.shape).encode() + calibration.tobytes()).hexdigest()[:20]
    key = hashlib.sha256(f"{digest}|{data_digest}|{method}|{tool}|{per_channel}|{_RECIPE}"
                         .encode()).hexdigest()[:20]
    target = (root or cache_dir()) / "onnx-int8" / f"{path.stem[:40]}-int8-{key}.onnx"
    if not _cached(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            if tool == "modelopt":
                written = _modelopt_quantize(path, calibration, method, Path(work))
            else:
                written = _ort_quantize(path, calibration, method, per_channel, Path(work))
            os.replace(written, target)
        _written(target)
    return ExportedModel(target, file_digest(target), None, exported=False)


def _ort_quantize(path: Path, calibration: np.ndarray, method: str, per_channel: bool,
                  work: Path) -> Path:
    try:
        from onnxruntime.quantization import (
            CalibrationDataReader,
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_static,
        )
    except ImportError as exc:
        raise UsageError(f"int8 needs onnxruntime's quantization tools ({exc}): "
                         "pip install 'infermux[onnx]'") from None
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    input_name = proto.graph.input[0].name
    batch = 16

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches: Iterator[dict[str, Any]] = iter(
                {input_name: calibration[i:i + batch]} for i in range(0, len(calibration), batch))

        def get_next(self) -> dict[str, Any] | None:
            return next(self._batches, None)

    source = path
    prepared = work / "prepared.onnx"
    try:  # shape inference and graph clean-up, as ONNX Runtime recommends before quantizing
        from onnxruntime.quantization.shape_inference import quant_pre_process

        quant_pre_process(str(path), str(prepared))
        source = prepared
    except Exception:  # noqa: BLE001 - an optional step: quantize the plain export instead
        source = path
    target = work / "int8.onnx"
    calibrate = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                 "percentile": CalibrationMethod.Percentile}[method]
    try:
        quantize_static(str(source), str(target), _Reader(), quant_format=QuantFormat.QDQ,
                        per_channel=per_channel, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8, calibrate_method=calibrate,
                        # 7-bit weights: on x86 CPUs without VNNI (AVX2 only), ONNX Runtime's
                        # u8 x s8 kernels sum pairs of products into int16, which saturates at
                        # full 8-bit range (digits-cnn on an AVX2-only EPYC: 98% top-1 fp32,
                        # 39% int8); one bit less keeps the sums in range on every CPU.
                        reduce_range=True)
    except Exception as exc:
        raise RunError(f"int8 quantization of {path.name} ({method}) failed: "
                       f"{first_line(exc)}; try another quantize_method") from exc
    return target


def quantize_dynamic_int8(source: ExportedModel | Path, root: Path | None = None) -> ExportedModel:
    """`source` with int8 weights in its MatMuls (and fused Attention), activations dynamic.

    Per output channel, 7-bit weights (`reduce_range`, for the same reason as `quantize_qdq`:
    AVX2 CPUs without VNNI saturate the int16 sums of full-range u8 x s8 products). Only
    MatMuls with a constant weight are quantized: attention's activation x activation products
    stay fp32. Cached by the source's digest and the recipe.
    """
    try:
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError as exc:
        raise UsageError(f"int8 needs onnxruntime's quantization tools ({exc}): "
                         "pip install 'infermux[onnx]'") from None
    path, digest = _source(source)
    key = hashlib.sha256(f"{digest}|dynamic|{_RECIPE}".encode()).hexdigest()[:20]
    target = (root or cache_dir()) / "onnx-int8" / f"{path.stem[:40]}-dyn-int8-{key}.onnx"
    if not _cached(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            written = Path(work) / "int8.onnx"
            try:
                quantize_dynamic(str(path), str(written), weight_type=QuantType.QInt8,
                                 per_channel=True, reduce_range=True,
                                 op_types_to_quantize=["MatMul", "Attention"],
                                 # ORT's fused operators have no ONNX type inference: their
                                 # outputs are float.
                                 extra_options={"DefaultTensorType": _FLOAT,
                                                "MatMulConstBOnly": True})
            except Exception as exc:  # the quantizer raises whatever its graph walk hits
                raise RunError(f"dynamic int8 quantization of {path.name} failed: "
                               f"{first_line(exc)}") from exc
            os.replace(written, target)
        _written(target)
    return ExportedModel(target, file_digest(target), None, exported=False)


def _modelopt_quantize(path: Path, calibration: np.ndarray, method: str, work: Path) -> Path:
    try:
        from modelopt.onnx.quantization import quantize
    except ImportError:
        raise UsageError("quantization tool modelopt needs NVIDIA ModelOpt: pip install "
                         "nvidia-modelopt, or use quantize_tool=onnxruntime") from None
    if method == "percentile":
        raise UsageError("ModelOpt calibrates int8 by minmax or entropy, not percentile")
    target = work / "int8.onnx"
    try:
        quantize(str(path), quantize_mode="int8", calibration_data=calibration,
                 calibration_method="max" if method == "minmax" else "entropy",
                 output_path=str(target))
    except Exception as exc:
        raise RunError(f"ModelOpt int8 quantization of {path.name} failed: "
                       f"{first_line(exc)}") from exc
    return target


# --- what the engines call ---------------------------------------------------------------------

_MEMO: dict[tuple[Any, ...], tuple[ExportedModel, dict[str, Any]]] = {}


def has_qdq(path: Path) -> bool:
    """Whether an ONNX file is already quantized (QuantizeLinear/DequantizeLinear nodes)."""
    onnx = _onnx()
    proto = onnx.load(str(path), load_external_data=False)
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in proto.graph.node)


def model_at_precision(source: ExportedModel, precision: str, input_shape: tuple[int, ...], *,
                       calibration_data: str | None = None, calibration_items: int = 256,
                       method: str = "minmax", tool: str = "onnxruntime",
                       precision_tool: str = "infermux") -> tuple[ExportedModel, dict[str, Any]]:
    """The ONNX model whose own types say `precision` (fp32 | fp16 | bf16 | int8), and how.

    int8: a file that already holds Q/DQ nodes is used as is; otherwise it is quantized with
    `calibration_items` items of `calibration_data` (None: seeded noise, right for timing and
    wrong for accuracy, so the record says `random`), or, with `method="dynamic"`, without
    calibration (`quantize_dynamic_int8`). The second value is what goes into a
    runner's options: the precision set in the model and the calibration that set it.
    """
    data = calibration_data or "random"
    key = (source.digest, precision, data, calibration_items, method, tool, precision_tool,
           calibration_identity(data) if precision == "int8" else "")
    if key in _MEMO and _MEMO[key][0].path.is_file():
        return _MEMO[key]
    info: dict[str, Any] = {"model_precision": precision, "source_onnx": str(source.path)}
    if precision == "int8":
        if has_qdq(source.path):
            result, how = source, "given"
        elif method == "dynamic":
            if tool != "onnxruntime":
                raise UsageError(f"quantize_method=dynamic is ONNX Runtime's: drop "
                                 f"quantize_tool={tool}")
            result, how = quantize_dynamic_int8(source), tool
            info.update(quantize_method="dynamic")
        else:
            items = load_calibration(data, input_shape, calibration_items)
            result, how = quantize_qdq(source, items, method=method, tool=tool), tool
            info.update(calibration_data=data, calibration_items=calibration_items,
                        quantize_method=method)
        info["quantized_by"] = how
    elif precision in LOW_PRECISIONS:
        result = convert_precision(source, precision, tool=precision_tool)
        info["precision_tool"] = precision_tool
    elif precision in ("fp32", "tf32"):
        result = source
    else:
        raise UsageError(f"precision {precision!r} cannot be set in an ONNX model: use fp32, "
                         "fp16, bf16 or int8")
    _MEMO[key] = (result, info)
    return result, info


# --- one call for the command line -------------------------------------------------------------

@dataclass
class PrecisionConfig:
    """`infermux quantize`: a model written with its precision set (fp16, bf16 or int8)."""

    model: Any  # a ModelSpec
    precision: str = "int8"
    calibration_data: str | None = None
    calibration_items: int = 256
    method: str = "minmax"
    tool: str = "onnxruntime"
    precision_tool: str = "infermux"
    output: str | None = None

    def validate(self) -> None:
        """One clear line for a bad value, before anything is loaded."""
        if self.precision not in ("fp16", "bf16", "int8"):
            raise UsageError(f"--precision {self.precision!r}: use fp16, bf16 or int8")
        if self.calibration_items < 1:
            raise UsageError(f"--calibration-items {self.calibration_items} must be at least 1")
        if self.method not in QUANT_METHODS:
            raise UsageError(f"--method {self.method!r}: use one of {', '.join(QUANT_METHODS)}")
        if self.tool not in QUANT_TOOLS:
            raise UsageError(f"--tool {self.tool!r}: use one of {', '.join(QUANT_TOOLS)}")


def run_precision(config: PrecisionConfig, store: Any = None,
                  progress: Callable[[str, float], None] | None = None,
                  command: str = "") -> dict[str, Any]:
    """Export the model, set its precision (cached), copy it to `output`; record the run."""
    from infermux.export import export_onnx
    from infermux.models import load_model
    from infermux.store import recording

    config.validate()
    say = progress or (lambda _label, _fraction: None)
    settings = {"model": config.model.ref, "precision": config.precision,
                "calibration_data": config.calibration_data or "random",
                "calibration_items": config.calibration_items, "method": config.method,
                "tool": config.tool, "precision_tool": config.precision_tool}
    with recording(store, "quantize", settings, command) as rec:
        started = time.perf_counter()
        say(f"loading {config.model.ref}", 0.05)
        model = load_model(config.model)
        if (config.precision == "int8" and config.method != "dynamic"
                and not model.spec_io.simple):
            raise UsageError(f"--method {config.method}: {model.name!r} takes several or integer "
                             "inputs, and calibration is made for one float input: use "
                             "--method dynamic")
        say("exporting to ONNX", 0.15)
        source = export_onnx(model)
        say(f"setting {config.precision} in the model", 0.3)
        result, info = model_at_precision(
            source, config.precision, model.input_shape, calibration_data=config.calibration_data,
            calibration_items=config.calibration_items, method=config.method, tool=config.tool,
            precision_tool=config.precision_tool)
        path = result.path
        if config.output:
            target = Path(config.output)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            path = target
        proto = _onnx().load(str(path), load_external_data=False)
        ops = Counter(n.op_type for n in proto.graph.node)
        names = {1: "float32", 10: "float16", 16: "bfloat16", 2: "uint8", 3: "int8"}
        types = Counter(names.get(t, str(t)) for t in tensor_types(proto).values())
        summary = {**settings, **info, "onnx_file": str(path), "onnx_sha256": result.digest,
                   "source_sha256": source.digest, "seconds": time.perf_counter() - started,
                   "quantize_nodes": ops.get("QuantizeLinear", 0),
                   "cast_nodes": ops.get("Cast", 0), "tensor_types": dict(types)}
        rec.summary = summary
        say("done", 1.0)
    return {**summary, "run_id": rec.run_id}


# --- helpers -------------------------------------------------------------------------------------

def _source(source: ExportedModel | Path) -> tuple[Path, str]:
    if isinstance(source, ExportedModel):
        return source.path, source.digest
    return Path(source), file_digest(Path(source))


def _cached(path: Path) -> bool:
    """Whether the cache holds `path` whole; a hit is marked used, so pruning takes it last."""
    if path.is_file() and path.stat().st_size > 0:
        touch(path)
        return True
    return False


def _written(target: Path) -> None:
    """After a new file in a kind folder of a cache root: keep the root's size bound."""
    bound_after_write(target.parents[1], target)


def _save_atomic(proto: Any, path: Path) -> None:
    write_atomic(path, proto.SerializeToString())


