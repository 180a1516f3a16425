"""Engines compile a Model for a Unit into a Runner; a registry names them.

One small base class, one file per engine; optional dependencies are imported lazily inside the
engine, so the registry lists every engine and says which are usable here.
"""

from infermux.engines import litert as _litert  # noqa: F401 - registers the engine
from infermux.engines import onnxruntime as _onnxruntime  # noqa: F401 - registers the engine
from infermux.engines import openvino as _openvino  # noqa: F401 - registers the engine
from infermux.engines import pytorch as _pytorch  # noqa: F401 - registers the engine
from infermux.engines import tensorrt as _tensorrt  # noqa: F401 - registers the engine
from infermux.engines.base import (
    BatchTiming,
    Engine,
    Runner,
    create_engine,
    engine_status,
    list_engines,
    register_engine,
)

__all__ = [
    "BatchTiming",
    "Engine",
    "Runner",
    "create_engine",
    "engine_status",
    "list_engines",
    "register_engine",
]
