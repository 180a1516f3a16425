"""int8 for characterization: the Q/DQ model of `infermux.quantize`, run by ONNX Runtime or OpenVINO.

The int8 model is made from the model's ONNX export by post-training static quantization
(`infermux.quantize.quantize_qdq`: QDQ format, int8 weights per output channel, uint8
activations, MinMax ranges observed on the calibration split, held out from the evaluated items),
cached by (model, data, method). Both ONNX engines run the same quantized file: ONNX Runtime's
CPU provider with its int8 kernels, and OpenVINO, whose CPU plugin folds the
QuantizeLinear/DequantizeLinear pairs into u8 convolutions; the `cpu/int8` units of `bench`,
`run` and `tune` run the very same file. No engine option is involved here: the quantized file is
a model like any ONNX file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from infermux.errors import RunError, UsageError
from infermux.quantize import quantize_qdq

__all__ = ["INT8_ENGINES", "quantize_onnx"]

#: Engines that run the quantized file (on `cpu` and `openvino:*` units).
INT8_ENGINES = ("onnxruntime", "openvino")


def quantize_onnx(onnx_path: Path, calibration: np.ndarray, out_dir: Path,
                  input_name: str = "input") -> Path:
    """Quantize `onnx_path` to int8 (QDQ) with ranges from `calibration`; return the new file.

    `out_dir` is the cache root (the file goes to its `onnx-int8` folder); `input_name` is
    read from the model and kept for callers of the earlier signature.
    """
    if len(calibration) == 0:
        raise UsageError("int8 needs calibration items and the data has none: raise "
                         "--calibration-items, or pass --no-int8")
    try:
        return quantize_qdq(onnx_path, calibration, method="minmax", root=out_dir).path
    except RunError as exc:
        raise RunError(f"{exc}; or pass --no-int8 to characterize the float engines only") from exc
