"""The environment a result was measured in: library versions, CPU, GPUs, driver, clocks."""

from __future__ import annotations

import importlib
import platform
import sys
from typing import Any

from infermux.nvidia import nvml_info
from infermux.units.cpu import read_cpu_info

__all__ = ["capture_environment"]

_LIBRARIES = ("torch", "torchvision", "numpy", "onnxruntime", "openvino", "tensorrt", "timm",
              "pydantic", "optuna")


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - an odd install must not stop a run
        module = sys.modules.get(name)
        return getattr(module, "__version__", None) if module else None


def capture_environment() -> dict[str, Any]:
    """A snapshot for the store: what ran, on what, at which clocks (at the start of a run)."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "libraries": {name: v for name in _LIBRARIES if (v := _version(name))},
    }
    cpu = read_cpu_info()
    env["cpu"] = {k: cpu[k] for k in ("model", "arch", "logical_cores", "isa")}
    env["cpu"]["usable_cores"] = len(cpu["usable_cores"])
    torch = importlib.import_module("torch")
    env["cuda_runtime"] = torch.version.cuda
    if torch.cuda.is_available():
        env["cudnn"] = torch.backends.cudnn.version()
        env["gpus"] = [
            {"index": i, "name": torch.cuda.get_device_name(i), **nvml_info(i)}
            for i in range(torch.cuda.device_count())
        ]
    return env
