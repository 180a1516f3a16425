"""A plain KServe v2 load client: closed-loop concurrency or Poisson arrivals, HTTP or gRPC.

It speaks only the v2 protocol (`POST /v2/models/M/infer` with the binary tensor extension, or
gRPC ModelInfer with raw contents), so it drives any v2 server: `infermux serve`, KServe's
ModelServer, Triton. Throughput counts answered requests over the measuring window (after a
warm-up); latency is per request, from send to the last byte of the answer (Poisson mode: from
the scheduled arrival, as MLPerf LoadGen counts it). 503s are counted apart.

    python bench/serve_load.py --url 127.0.0.1:8000 --model net --concurrency 1,4,16
    python bench/serve_load.py --url 127.0.0.1:8001 --protocol grpc --concurrency 8 --json
    python bench/serve_load.py --url 127.0.0.1:8000 --model net --rate 400 --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class Result:
    """One load level: what was sent, answered and refused, and request latencies (ms)."""

    protocol: str
    concurrency: int | None
    rate_qps: float | None
    duration_s: float
    ok: int = 0
    rejected: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Counts, throughput (answered requests/s) and latency percentiles."""
        lat = np.asarray(self.latencies_ms) if self.latencies_ms else np.zeros(1)
        out = {k: v for k, v in asdict(self).items() if k != "latencies_ms"}
        out.update(throughput_rps=self.ok / self.duration_s,
                   p50_ms=float(np.percentile(lat, 50)), p90_ms=float(np.percentile(lat, 90)),
                   p95_ms=float(np.percentile(lat, 95)), p99_ms=float(np.percentile(lat, 99)))
        return out


async def _metadata(host: str, port: int, model: str) -> tuple[str, list[int]]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET /v2/models/{model} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    status, body = await _read_response(reader)
    writer.close()
    if status != 200:
        raise SystemExit(f"model {model!r}: metadata answered {status}: {body[:200]!r}")
    tensor = json.loads(body)["inputs"][0]
    return tensor["name"], [int(d) for d in tensor["shape"][1:]]


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length, chunked = 0, False
    for line in lines[1:]:
        key, _, value = line.partition(":")
        if key.lower() == "content-length":
            length = int(value)
        elif key.lower() == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    if not chunked:
        return status, (await reader.readexactly(length) if length else b"")
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        parts.append(await reader.readexactly(size + 2))
        if size == 0:
            return status, b"".join(p[:-2] for p in parts)


class _Http:
    """One keep-alive connection per concurrent stream; binary tensors both ways."""

    def __init__(self, host: str, port: int, model: str, name: str, x: np.ndarray) -> None:
        header = json.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape),
                                         "parameters": {"binary_data_size": x.nbytes}}],
                             "parameters": {"binary_data_output": True}}).encode()
        body = header + x.tobytes()
        self.request = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {host}\r\n"
                        f"Inference-Header-Content-Length: {len(header)}\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        self.host, self.port = host, port

    async def connect(self) -> Any:
        return await asyncio.open_connection(self.host, self.port)

    async def call(self, conn: Any) -> int:
        reader, writer = conn
        writer.write(self.request)
        status, _ = await _read_response(reader)
        if status == 503:  # a server may close the connection after refusing (uvicorn does)
            writer.close()
            raise _Refused
        return status


class _Refused(Exception):  # noqa: N818 - a 503 that also ended the connection
    pass


class _Grpc:
    def __init__(self, target: str, model: str, name: str, x: np.ndarray) -> None:
        from tritonclient.grpc import service_pb2

        self.target = target
        request = service_pb2.ModelInferRequest(model_name=model)
        request.inputs.add(name=name, datatype="FP32", shape=list(x.shape))
        request.raw_input_contents.append(x.tobytes())
        self.request = request

    async def connect(self) -> Any:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        channel = grpc.aio.insecure_channel(self.target, options=[
            ("grpc.max_receive_message_length", 1 << 30),
            ("grpc.max_send_message_length", 1 << 30)])
        return service_pb2_grpc.GRPCInferenceServiceStub(channel)

    async def call(self, stub: Any) -> int:
        import grpc

        try:
            await stub.ModelInfer(self.request)
            return 200
        except grpc.aio.AioRpcError as exc:
            return 503 if exc.code() == grpc.StatusCode.UNAVAILABLE else 500


async def _call(client: Any, conn: Any) -> tuple[int, Any]:
    """(status, the connection to reuse or None): 503 and broken connections are not reused."""
    try:
        return await client.call(conn), conn
    except _Refused:
        return 503, None
    except (OSError, asyncio.IncompleteReadError):
        return 0, None


async def run_level(client: Any, *, concurrency: int | None, rate_qps: float | None,
                    duration_s: float, warmup_s: float, protocol: str, seed: int = 0) -> Result:
    """One load level; returns its counts and latencies over the window after the warm-up."""
    start = time.perf_counter()
    t0, t1 = start + warmup_s, start + warmup_s + duration_s
    result = Result(protocol, concurrency, rate_qps, duration_s)

    def record(status: int, began: float, ended: float) -> None:
        if not t0 <= began < t1:
            return
        if status == 200:
            result.ok += 1
            result.latencies_ms.append((ended - began) * 1e3)
        elif status == 503:
            result.rejected += 1
        else:
            result.errors += 1

    if concurrency is not None:
        async def stream() -> None:
            conn = None
            while time.perf_counter() < t1:
                began = time.perf_counter()
                conn = conn or await client.connect()
                status, conn = await _call(client, conn)
                record(status, began, time.perf_counter())

        await asyncio.gather(*(stream() for _ in range(concurrency)))
        return result
    assert rate_qps is not None
    # Poisson arrivals; a pool of connections large enough for the backlog.
    pool: asyncio.Queue[Any] = asyncio.Queue()
    rng = random.Random(seed)
    tasks = []
    at = start

    async def one(due: float) -> None:
        try:
            conn = pool.get_nowait() if not pool.empty() else await client.connect()
        except OSError:
            record(0, due, time.perf_counter())
            return
        status, kept = await _call(client, conn)
        record(status, due, time.perf_counter())
        if kept is not None:
            pool.put_nowait(kept)

    while at < t1:
        at += rng.expovariate(rate_qps)
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(at)))
    await asyncio.gather(*tasks)
    return result


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    host, port = args.url.rsplit(":", 1)
    meta_port = int(args.metadata_port or port)
    name, shape = ((args.input_name, [int(d) for d in args.input_shape.split("x")])
                   if args.input_shape else await _metadata(host, meta_port, args.model))
    x = np.random.default_rng(0).standard_normal((args.batch, *shape), dtype=np.float32)
    client = (_Grpc(args.url, args.model, name, x) if args.protocol == "grpc"
              else _Http(host, int(port), args.model, name, x))
    rows = []
    levels: list[tuple[int | None, float | None]] = (
        [(None, float(r)) for r in args.rate.split(",")] if args.rate
        else [(int(c), None) for c in args.concurrency.split(",")])
    for conc, rate in levels:
        res = await run_level(client, concurrency=conc, rate_qps=rate, duration_s=args.duration,
                              warmup_s=args.warmup, protocol=args.protocol)
        row = res.summary()
        rows.append(row)
        if not args.json:
            level = f"concurrency {conc}" if conc is not None else f"rate {rate:g}/s"
            print(f"{args.protocol} {level}: {row['throughput_rps']:.1f} req/s, p50 "
                  f"{row['p50_ms']:.2f} p99 {row['p99_ms']:.2f} ms, 503s {row['rejected']}, "
                  f"errors {row['errors']}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="127.0.0.1:8000", help="host:port of the v2 HTTP or gRPC endpoint")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http")
    p.add_argument("--model", default="net")
    p.add_argument("--metadata-port", help="HTTP port for model metadata when --protocol grpc")
    p.add_argument("--input-name", default="input")
    p.add_argument("--input-shape", help="one item, e.g. 3x224x224 (default: from metadata)")
    p.add_argument("--batch", type=int, default=1, help="items per request")
    p.add_argument("--concurrency", default="1", help="comma list of closed-loop levels")
    p.add_argument("--rate", help="comma list of Poisson rates (requests/s) instead")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
