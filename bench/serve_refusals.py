"""What a refused gRPC call costs the front: CPU per call, against grpc's own floor.

Past saturation a front does little but refuse, so the calls it can take per second are one
over the CPU a refusal costs it; calls it cannot take wait in grpc and are reset by grpc
(docs/architecture-serve.md, "A saturated front refuses before decoding"). Two servers are
measured side by side, each with the same burst of `--calls` ModelInfer calls (`--in-flight`
at once over 8 channels, one-item requests of tests/engine_models/faulty.py's input):

- `floor`: a bare grpc.aio server whose handler only sets UNAVAILABLE with a `retry-after`
  trailer (no parsing, no work): what grpc itself costs per call;
- `infermux`: `infermux serve` with a model that holds 4 items for 0.4 s (`--max-queue 4`), so
  nearly every call is refused by admission.

CPU is the server process's user + system time over the burst (grpc's threads included, the
worker's child process not), per call; each server is measured `--rounds` times, best kept.

    python bench/serve_refusals.py --out /tmp/serve-refusals.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FAULTY = ROOT / "tests" / "engine_models" / "faulty.py"
SHAPE = [1, 3, 16, 16]


async def _burst(port: int, calls: int, in_flight: int) -> dict[str, Any]:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="net")
    request.inputs.add(name="input", datatype="FP32", shape=SHAPE)
    request.raw_input_contents.append(np.zeros(SHAPE, np.float32).tobytes())
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(8)]
    stubs = [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in channels]
    gate = asyncio.Semaphore(in_flight)
    codes: Counter[str] = Counter()

    async def one(k: int) -> None:
        async with gate:
            try:
                await stubs[k % 8].ModelInfer(request, timeout=120)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                hinted = any(key == "retry-after" for key, _ in exc.trailing_metadata() or ())
                codes[exc.code().name + ("" if hinted else " (no retry-after)")] += 1

    start = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(calls)))
    wall_s = time.perf_counter() - start
    for c in channels:
        await c.close()
    return {"codes": dict(codes), "wall_s": wall_s}


def _cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _measure(pid: int, port: int, calls: int, in_flight: int) -> dict[str, Any]:
    before = _cpu_s(pid)
    row = asyncio.run(_burst(port, calls, in_flight))
    cpu_s = _cpu_s(pid) - before
    row.update(cpu_s=cpu_s, cpu_us_per_call=cpu_s / calls * 1e6, calls=calls)
    return row


def _floor_server(ports: Any, stop: Any) -> None:
    import grpc
    from tritonclient.grpc import service_pb2

    async def refuse(request: bytes, context: Any) -> None:
        context.set_code(grpc.StatusCode.UNAVAILABLE)
        context.set_details("model 'net' holds its admission limit of 4 items: retry later")
        context.set_trailing_metadata((("retry-after", "1"),))

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(
            refuse, response_serializer=service_pb2.ModelInferResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService", {"ModelInfer": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.stop(0)

    asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON report path")
    p.add_argument("--calls", type=int, default=10_000)
    p.add_argument("--in-flight", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    report: dict[str, Any] = {"args": vars(args), "cores": os.cpu_count(),
                              "load_avg": os.getloadavg()}

    ports: Any = mp.Queue()
    stop = mp.Event()
    floor = mp.Process(target=_floor_server, args=(ports, stop))
    floor.start()
    try:
        port = ports.get(timeout=60)
        rounds = [_measure(floor.pid or 0, port, args.calls, args.in_flight)
                  for _ in range(args.rounds)]
        report["floor"] = min(rounds, key=lambda r: r["cpu_us_per_call"]) | {"rounds": rounds}
    finally:
        stop.set()
        floor.join(30)

    with tempfile.TemporaryDirectory() as tmp:
        plan = {"name": "refusals", "models": [{"name": "net", "model": f"{FAULTY}:slow",
                "replicas": [{"unit": "cpu:0", "engine": "torch", "instances": 1, "batch": 4}]}],
                "dispatcher": {"max_queue_delay_ms": 1}}
        plan_file = Path(tmp) / "plan.yaml"
        plan_file.write_text(json.dumps(plan))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
        proc = subprocess.Popen(
            [sys.executable, "-m", "infermux", "serve", str(plan_file), "--http-port", "0",
             "--grpc-port", "0", "--metrics-port", "0", "--json", "--telemetry", "off",
             "--db", str(Path(tmp) / "serve.db"), "--max-queue", "4"],
            stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise SystemExit("the server did not start")
            port = json.loads(line)["grpc_port"]
            rounds = [_measure(proc.pid, port, args.calls, args.in_flight)
                      for _ in range(args.rounds)]
            report["infermux"] = min(rounds, key=lambda r: r["cpu_us_per_call"]) | {
                "rounds": rounds}
        finally:
            proc.terminate()
            proc.wait(60)
    report["ratio_to_floor"] = (report["infermux"]["cpu_us_per_call"]
                                / report["floor"]["cpu_us_per_call"])
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"CPU per refused call: grpc floor {report['floor']['cpu_us_per_call']:.0f} µs, "
          f"infermux {report['infermux']['cpu_us_per_call']:.0f} µs "
          f"({report['ratio_to_floor']:.2f}×); codes {report['infermux']['codes']}")


if __name__ == "__main__":
    main()
