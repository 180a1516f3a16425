"""`infermux serve`: the KServe v2 / Triton inference protocol (HTTP, gRPC) on the runtime.

    from infermux.runtime import load_plan
    from infermux.serve import ServeSettings, serve_plan
    serve_plan(load_plan("plan.yaml"), ServeSettings(http_port=8000))   # until SIGTERM

The server's libraries (uvicorn, grpcio, tritonclient's stubs, prometheus-client) are the
`serve` extra and are imported only when a server starts.
"""

from infermux.serve.core import (
    InferenceCore,
    ModelInfo,
    ProtocolError,
    ServedModelSummary,
    TensorSpec,
)
from infermux.serve.server import InferenceServer, ServeSettings, ServeSummary, serve_plan

__all__ = [
    "InferenceCore",
    "InferenceServer",
    "ModelInfo",
    "ProtocolError",
    "ServeSettings",
    "ServeSummary",
    "ServedModelSummary",
    "TensorSpec",
    "serve_plan",
]
