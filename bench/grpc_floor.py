r"""What a gRPC call costs grpc.aio alone, beside what it costs through an infermux front.

The floor is a v2 server with nothing behind it: grpc.aio, Triton's generated service, and a
ModelInfer that answers every call with the same ten-float response (digits-cnn's metadata,
so perf_analyzer drives it as it drives `infermux serve`). Against it, `infermux serve
--fronts 2` serving digits-cnn on the CPU. Both are driven by perf_analyzer over gRPC (inputs in
the request, single items, one concurrency), taking turns, and for each the CPU its serving
processes used per request over a window in the middle of the run (the floor's one process;
infermux's front processes, and beside them its runtime process and CPU worker).

`--floor-variant`: `plain` (grpc's defaults and the generated service), `infermux`
(infermux's server options and its ModelInfer registration with the zero-copy request parser).

    python bench/grpc_floor.py --perf-analyzer PA --json floor.json --rounds 2
    python bench/grpc_floor.py --perf-analyzer PA --json rate.json --rounds 2 --request-rate 1000

`--request-rate R`: perf_analyzer sends R requests/s to infermux and R / `--fronts` to the
floor, so that each serving process answers as many a second where infermux keeps up (the
report has the rates reached). A process's cost per call depends on its rate: at a low one
each call wakes its loop and grpc's poller on its own.
Without it, a concurrency drives both as fast as they answer.

The floor server alone (`--serve-floor PORT`) is how the bench starts it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_cores import fronts_and_others
from serve_gpu import cpu_s, perf_analyzer_env, plans, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
_SETTLE_S = 6.0
_WINDOW_S = 6.0


def _servicer() -> Any:
    import numpy as np
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    class Floor(pbg.GRPCInferenceServiceServicer):
        """Canned answers: the least a v2 server can do per call."""

        output = np.zeros((1, 10), np.float32).tobytes()

        async def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ServerReadyResponse(ready=True)

        async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ModelReadyResponse(ready=True)

        async def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ServerMetadataResponse(name="floor", version="1")

        async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
            meta = pb.ModelMetadataResponse(name="digits", versions=["1"], platform="floor")
            meta.inputs.add(name="input", datatype="FP32", shape=[-1, 1, 32, 32])
            meta.outputs.add(name="output", datatype="FP32", shape=[-1, 10])
            return meta

        async def ModelConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
            config = pb.ModelConfigResponse()
            config.config.name, config.config.max_batch_size = "digits", 64
            return config

        async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
            message = getattr(request, "message", request)  # infermux's parser wraps it
            response = pb.ModelInferResponse(model_name="digits", model_version="1",
                                             id=message.id)
            response.outputs.add(name="output", datatype="FP32", shape=[1, 10])
            response.raw_output_contents.append(self.output)
            return response

    return Floor()


async def _serve_floor(port: int, variant: str) -> None:
    import grpc
    from tritonclient.grpc import service_pb2_grpc as pbg

    from infermux.serve.grpc_front import _add_service, server_options

    server = grpc.aio.server(options=server_options(64 << 20) if variant == "infermux" else None)
    if variant == "infermux":
        _add_service(server, _servicer())
    else:
        pbg.add_GRPCInferenceServiceServicer_to_server(_servicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _drive(perf_analyzer: str, port: int, concurrency: int, sides: dict[str, list[int]],
           rate: float | None = None) -> dict[str, Any]:
    """Requests/s and each side's CPU µs per request, at `concurrency` or `rate` requests/s."""
    load = (["--request-rate-range", f"{rate:g}:{rate:g}"] if rate
            else ["--concurrency-range", f"{concurrency}:{concurrency}"])
    cmd = [perf_analyzer, "-m", "digits", "-u", f"127.0.0.1:{port}", "-i", "grpc", "-b", "1",
           *load, "--measurement-interval", "4000", "--stability-percentage", "50",
           "--max-trials", "3"]
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(_SETTLE_S)
    before = {k: cpu_s(v) for k, v in sides.items()}
    start = time.monotonic()
    time.sleep(_WINDOW_S)
    cores = {k: (cpu_s(v) - before[k]) / (time.monotonic() - start) for k, v in sides.items()}
    shown = client.communicate(timeout=240)[0]
    rate = next((float(line.split()[1]) for line in shown.splitlines()
                 if line.strip().startswith("Throughput:")), None)
    return {"requests_per_s": rate, "cores": cores,
            "cpu_us_per_request": {k: c / rate * 1e6 for k, c in cores.items()} if rate else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="where the report goes")
    p.add_argument("--perf-analyzer", help="path of perf_analyzer")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--floor-variant", choices=["plain", "infermux"], default="plain")
    p.add_argument("--fronts", type=int, default=2)
    p.add_argument("--request-rate", type=float,
                   help="requests/s to infermux (to the floor: this over --fronts) instead of "
                        "a concurrency")
    p.add_argument("--serve-floor", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_floor:
        asyncio.run(_serve_floor(args.serve_floor, args.floor_variant))
        return
    if not args.json or not args.perf_analyzer:
        p.error("--json and --perf-analyzer are needed")
    perf_analyzer_env(args.perf_analyzer)
    out = Path(args.json).resolve().parent / (Path(args.json).stem + "-logs")
    out.mkdir(parents=True, exist_ok=True)
    plan = plans("cpu")["digits"]
    plan.pop("load", None)
    plan_path = out / "digits.json"
    plan_path.write_text(json.dumps(plan))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    report: dict[str, Any] = {"concurrency": args.concurrency,
                              "request_rate": args.request_rate, "rows": []}
    for rnd in range(args.rounds):
        port = _free_port()
        floor = subprocess.Popen([sys.executable, __file__, "--serve-floor", str(port),
                                  "--floor-variant", args.floor_variant],
                                 stdout=subprocess.PIPE, text=True, env=env)
        assert floor.stdout is not None
        floor.stdout.readline()
        try:
            row = _drive(args.perf_analyzer, port, args.concurrency, {"floor": [floor.pid]},
                         args.request_rate / args.fronts if args.request_rate else None)
        finally:
            floor.terminate()
            floor.wait(timeout=30)
        report["rows"].append({"round": rnd, "server": f"floor ({args.floor_variant})", **row})
        server, ready = start_server(plan_path, out, args.fronts, tag=f"-r{rnd}")
        try:
            row = _drive(args.perf_analyzer, ready["grpc_port"], args.concurrency,
                         dict(zip(("fronts", "workers"), fronts_and_others(server.pid),
                                  strict=True), runtime=[server.pid]), args.request_rate)
        finally:
            stop_server(server)
        report["rows"].append({"round": rnd, "server": f"infermux --fronts {args.fronts}", **row})
        Path(args.json).write_text(json.dumps(report, indent=1))
        for r in report["rows"][-2:]:
            per = r["cpu_us_per_request"] or {}
            print(f"round {rnd} {r['server']:22s} {r['requests_per_s'] or 0:8.1f} requests/s; "
                  + ", ".join(f"{k} {v:.0f} µs/request" for k, v in per.items()), flush=True)


if __name__ == "__main__":
    main()
