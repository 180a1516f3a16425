"""The HTTP stack of `infermux serve`, measured: uvicorn (ASGI) against aiohttp.web.

Both fronts run the same protocol code (`infermux.serve.http.handle`) on the same runtime and
core (one plan, built once), one after the other, in this process; bench/serve_load.py drives
each from another process at a few concurrencies. Reported per front and level: requests/s,
p50/p99 latency, and the server process's CPU time per request (the cost of the front, the
dispatcher and the worker threads together: what competes for the GIL with the dispatcher).

A third row, "runtime only", submits the same requests to the core from this process with no
HTTP at all: the ceiling the fronts are measured against.

    python bench/serve_stack.py --model mobilenet_v3_small --concurrency 1,8 --duration 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _drive(port: int, model: str, shape: str, concurrency: int, duration: float,
                 ) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "bench" / "serve_load.py"), "--url", f"127.0.0.1:{port}",
           "--model", model, "--input-shape", shape, "--concurrency", str(concurrency),
           "--duration", str(duration), "--warmup", "1", "--json"]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    cpu0 = time.process_time()
    out, _ = await proc.communicate()
    cpu = time.process_time() - cpu0
    row = json.loads(out)[0]
    requests = row["ok"] / duration * (duration + 1)  # the warm-up second is served too
    row["server_cpu_ms_per_request"] = cpu * 1e3 / max(1.0, requests)
    return row


async def _uvicorn(core: Any, port: int, run: Any) -> Any:
    import uvicorn

    from infermux.serve.http import HttpFront

    config = uvicorn.Config(HttpFront(core), host="127.0.0.1", port=port, lifespan="off",
                            log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    server.capture_signals = _no_signals  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        return await run()
    finally:
        server.should_exit = True
        await task


async def _aiohttp(core: Any, port: int, run: Any) -> Any:
    from aiohttp import web

    from infermux.serve.http import handle

    async def endpoint(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {k.lower(): v for k, v in request.headers.items()}
        status, out_headers, payload = await handle(core, request.method, request.path,
                                                    headers, body)
        return web.Response(status=status, body=payload,
                            headers={k.decode(): v.decode() for k, v in out_headers})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", endpoint)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        return await run()
    finally:
        await runner.cleanup()


def _no_signals() -> Any:
    import contextlib

    return contextlib.nullcontext()


async def _runtime_only(core: Any, info: Any, concurrency: int, duration: float,
                        ) -> dict[str, Any]:
    x = np.random.default_rng(0).standard_normal((1, *info.inputs[0].shape), dtype=np.float32)
    latencies: list[float] = []
    end = time.perf_counter() + duration
    cpu0 = time.process_time()

    async def stream() -> None:
        while time.perf_counter() < end:
            t = time.perf_counter()
            await core.infer(info, x)
            latencies.append((time.perf_counter() - t) * 1e3)

    await asyncio.gather(*(stream() for _ in range(concurrency)))
    cpu = time.process_time() - cpu0
    lat = np.asarray(latencies)
    return {"throughput_rps": len(lat) / duration, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)),
            "server_cpu_ms_per_request": cpu * 1e3 / max(1, len(lat))}


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    from infermux.runtime import parse_plan, start_runtime
    from infermux.serve.core import InferenceCore

    plan = parse_plan({"name": "stack", "models": [{"name": "m", "model": args.model, "replicas": [
        {"unit": args.unit, "engine": args.engine, "instances": 1, "batch": args.batch}]}],
        "dispatcher": {"max_queue_delay_ms": 2}, "load": {"sample_pool": 4}})
    runtime = await asyncio.to_thread(start_runtime, plan)
    rows = []
    try:
        core = InferenceCore(runtime, plan)
        await core.probe_outputs()
        info = core.models["m"]
        shape = "x".join(map(str, info.inputs[0].shape))
        for c in [int(v) for v in args.concurrency.split(",")]:
            for name, front in (("uvicorn", _uvicorn), ("aiohttp", _aiohttp)):
                port = _free_port()
                row = await front(core, port, lambda p=port, cc=c: _drive(p, "m", shape, cc,
                                                                          args.duration))
                rows.append({"front": name, "concurrency": c, **row})
            rows.append({"front": "runtime only", "concurrency": c,
                         **await _runtime_only(core, info, c, args.duration)})
            for r in rows[-3:]:
                print(f"{r['front']:>13} c{c}: {r['throughput_rps']:7.1f} req/s  p50 "
                      f"{r['p50_ms']:6.2f}  p99 {r['p99_ms']:6.2f} ms  server CPU "
                      f"{r['server_cpu_ms_per_request']:.2f} ms/request", flush=True)
    finally:
        runtime.stop(drain=False)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mobilenet_v3_small")
    p.add_argument("--unit", default="cpu:1")
    p.add_argument("--engine", default="onnxruntime")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
