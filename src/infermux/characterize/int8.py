"""int8 through ONNX Runtime's post-training static quantization, run by ONNX Runtime or OpenVINO.

OpenVINO's own post-training quantization lives in NNCF, which infermux does not depend on, so
the int8 model is made once per build from the model's ONNX export with
`onnxruntime.quantization.quantize_static`: QDQ format, int8 weights per output channel, uint8
activations, MinMax ranges observed on the calibration split (held out from the evaluated items).
Both ONNX engines then run the same quantized file: ONNX Runtime's CPU provider with its int8
kernels, and OpenVINO, whose CPU plugin folds the QuantizeLinear/DequantizeLinear pairs into u8
convolutions. No engine option is involved: the quantized file is a model like any ONNX file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from infermux.errors import RunError, UsageError

__all__ = ["INT8_ENGINES", "quantize_onnx"]

#: Engines that run the quantized file (on `cpu` and `openvino:*` units).
INT8_ENGINES = ("onnxruntime", "openvino")
_CALIBRATION_BATCH = 16


def quantize_onnx(onnx_path: Path, calibration: np.ndarray, out_dir: Path,
                  input_name: str = "input") -> Path:
    """Quantize `onnx_path` to int8 (QDQ) with ranges from `calibration`; return the new file."""
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
                         "pip install 'infermux[onnx]', or pass --no-int8") from None
    if len(calibration) == 0:
        raise UsageError("int8 needs calibration items and the data has none: raise "
                         "--calibration-items, or pass --no-int8")

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches: Iterator[dict[str, Any]] = iter(
                {input_name: np.ascontiguousarray(calibration[i:i + _CALIBRATION_BATCH])}
                for i in range(0, len(calibration), _CALIBRATION_BATCH))

        def get_next(self) -> dict[str, Any] | None:
            return next(self._batches, None)

    out_dir.mkdir(parents=True, exist_ok=True)
    prepared = out_dir / f"{onnx_path.stem}-prep.onnx"
    source = onnx_path
    try:  # shape inference and graph clean-up, as ONNX Runtime recommends before quantizing
        from onnxruntime.quantization.shape_inference import quant_pre_process

        quant_pre_process(str(onnx_path), str(prepared))
        source = prepared
    except Exception:  # noqa: BLE001 - optional step: quantize the plain export instead
        source = onnx_path
    target = out_dir / f"{onnx_path.stem}-int8.onnx"
    try:
        quantize_static(str(source), str(target), _Reader(), quant_format=QuantFormat.QDQ,
                        per_channel=True, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise RunError(f"int8 quantization of {onnx_path.name} failed: {first}; pass --no-int8 "
                       "to characterize the float engines only") from exc
    return target
