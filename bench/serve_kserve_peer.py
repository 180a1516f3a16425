"""The peer server: KServe's Python ModelServer (v2 REST and gRPC) on the same engine session.

Run in a venv of its own (kserve pins grpcio and FastAPI versions of its own), with infermux's
source on PYTHONPATH so `predict` calls exactly the runner infermux's plan builds:

    python3 -m venv /tmp/kserve-venv
    /tmp/kserve-venv/bin/pip install kserve torch torchvision onnx onnxruntime typer rich \
        pydantic pyyaml psutil
    PYTHONPATH=src /tmp/kserve-venv/bin/python bench/serve_kserve_peer.py --http-port 8080

`predict` is KServe's documented synchronous form: it runs each request's batch on the
engine's runner for the smallest bucket that holds it (padded, as the runtime does) and returns
the outputs as binary v2 tensors. KServe's Python server has no dynamic batcher of its own (its
batcher is the separate agent sidecar), so each request is one engine call.

`--workers N` is KServe's advice for CPU-bound models: N REST server processes (spawned,
each with its own engine session; gRPC stays in the parent). `--cores all` lets the peer's
processes use every core, as `infermux serve` does (its worker on the unit, its fronts on the
other cores); `--cores unit` pins the whole peer to the unit's cores.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np


def build_runners(model_ref: str, unit_id: str, engine_name: str, batch: int) -> dict[int, Any]:
    from infermux.engines import create_engine
    from infermux.models import ModelSpec, load_model
    from infermux.units import discover, select_units

    model = load_model(ModelSpec(model_ref))
    unit = select_units([unit_id], discover(with_runtimes=False))[0]
    engine = create_engine(engine_name)
    buckets = sorted({1 << i for i in range(batch.bit_length()) if (1 << i) <= batch} | {batch})
    return {b: engine.build(model, unit, b, {}) for b in buckets}


try:
    from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer
except ImportError:  # this script runs in a venv of its own (see the docstring)
    Model = object  # type: ignore[assignment,misc]


class Peer(Model):  # type: ignore[misc,valid-type]
    """The served model; its runners are built in each process that serves it.

    KServe's REST workers are spawned processes, each unpickling this object.
    """

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        super().__init__(name)
        self.spec = spec
        self._runners: dict[int, Any] | None = None
        self.ready = True

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_runners"] = None  # engine sessions do not cross processes
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.runners()  # a spawned REST worker builds its session before it serves

    def runners(self) -> dict[int, Any]:
        """The engine runners by batch bucket, built in this process on first use."""
        if self._runners is None:
            s = self.spec
            self._runners = build_runners(s["model"], s["unit"], s["engine"], s["batch"])
        return self._runners

    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None,
                ) -> InferResponse:
        """Run one request on the smallest bucket that holds it (padded)."""
        x = payload.inputs[0].as_numpy().astype(np.float32, copy=False)
        n = len(x)
        runners = self.runners()
        bucket = next(b for b in sorted(runners) if b >= n)
        runner = runners[bucket]
        rows = x if n == bucket else np.concatenate(
            [x, np.zeros((bucket - n, *x.shape[1:]), np.float32)])
        y = runner.infer(rows)[0][:n]
        out = InferOutput(name="output", shape=list(y.shape), datatype="FP32")
        out.set_data_from_numpy(y, binary_data=True)
        return InferResponse(payload.id or "", self.name, [out], use_binary_outputs=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="mobilenet")
    p.add_argument("--model", default="mobilenet_v3_small")
    p.add_argument("--unit", default="cpu:1")
    p.add_argument("--engine", default="onnxruntime")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--http-port", type=int, default=8080)
    p.add_argument("--grpc-port", type=int, default=8081)
    p.add_argument("--workers", type=int, default=1,
                   help="KServe's REST worker processes (its advice for CPU-bound models)")
    p.add_argument("--cores", choices=("unit", "all"), default="unit",
                   help="pin the server's processes to the unit's cores, or let them use all")
    args = p.parse_args()

    import os

    if Model is object:
        raise SystemExit("this peer needs the kserve package: run it in its own venv")
    cores = [int(c) for c in args.unit.split(":")[1].replace("-", ",").split(",")] \
        if args.unit.startswith("cpu:") else []
    if cores and args.cores == "unit":
        os.sched_setaffinity(0, set(range(min(cores), max(cores) + 1)))
    peer = Peer(args.name, {"model": args.model, "unit": args.unit, "engine": args.engine,
                            "batch": args.batch})
    peer.runners()  # this process serves gRPC (and REST with one worker)
    ModelServer(http_port=args.http_port, grpc_port=args.grpc_port, workers=args.workers,
                enable_latency_logging=False).start([peer])


if __name__ == "__main__":
    main()
