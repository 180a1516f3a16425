"""Optional inference runtimes: TensorRT, ONNX Runtime, OpenVINO, LiteRT. Probed lazily, never required."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__all__ = ["probe_runtimes"]


def _version(module: Any) -> str:
    return str(getattr(module, "__version__", "unknown"))


def probe_runtimes() -> dict[str, dict[str, Any]]:
    """Each runtime's version and devices/providers, or why it is not usable."""
    found: dict[str, dict[str, Any]] = {}
    try:
        ort = importlib.import_module("onnxruntime")
        found["onnxruntime"] = {
            "available": True,
            "version": _version(ort),
            "providers": list(ort.get_available_providers()),
        }
    except ImportError as exc:
        found["onnxruntime"] = {"available": False, "reason": f"not installed ({exc})"}
    try:
        ov = importlib.import_module("openvino")
        core = ov.Core()
        found["openvino"] = {
            "available": True,
            "version": _version(ov),
            "devices": list(core.available_devices),
        }
    except ImportError as exc:
        found["openvino"] = {"available": False, "reason": f"not installed ({exc})"}
    except Exception as exc:  # noqa: BLE001 - a broken plugin must not stop discovery
        found["openvino"] = {"available": False, "reason": f"installed but failed: {exc}"}
    if importlib.util.find_spec("ai_edge_litert") is not None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            litert_version = version("ai-edge-litert")
        except PackageNotFoundError:  # a source build: importable, no distribution record
            litert_version = "unknown"
        from infermux.units.edgetpu import edgetpu_runtime

        ok, why = edgetpu_runtime()
        found["litert"] = {"available": True, "version": litert_version,
                           "devices": ["CPU (XNNPACK)"] + (["Edge TPU (libedgetpu)"] if ok else []),
                           "edgetpu_runtime": "libedgetpu.so.1" if ok else why}
    else:
        found["litert"] = {"available": False,
                           "reason": "not installed: pip install 'infermux[litert]'"}
    try:
        trt = importlib.import_module("tensorrt")
        info: dict[str, Any] = {"available": True, "version": _version(trt)}
        try:
            builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
            info["dla_cores"] = int(builder.num_DLA_cores)
        except Exception as exc:  # noqa: BLE001 - no GPU or driver: report, don't crash
            info["dla_cores"] = 0
            info["builder_error"] = str(exc)
        found["tensorrt"] = info
    except ImportError as exc:
        found["tensorrt"] = {"available": False, "reason": f"not installed ({exc})"}
    return found
