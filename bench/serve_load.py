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
from typing import Any

import numpy as np

from infermux.load.v2client import GrpcClient, HttpClient, LevelResult, V2Tensor, _read_response
from infermux.load.v2client import run_level as _run_level

Result = LevelResult  # the name bench scripts import


async def _metadata(host: str, port: int, model: str) -> tuple[str, list[int]]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET /v2/models/{model} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    status, body = await _read_response(reader)
    writer.close()
    if status != 200:
        raise SystemExit(f"model {model!r}: metadata answered {status}: {body[:200]!r}")
    tensor = json.loads(body)["inputs"][0]
    return tensor["name"], [int(d) for d in tensor["shape"][1:]]


def _Http(host: str, port: int, model: str, name: str, x: np.ndarray) -> HttpClient:  # noqa: N802
    """A one-input HTTP client sending `x` (batch axis first) in every request."""
    return HttpClient(host, port, model, [[V2Tensor(name, x)]])


def _Grpc(target: str, model: str, name: str, x: np.ndarray) -> GrpcClient:  # noqa: N802
    """A one-input gRPC client sending `x` (batch axis first) in every request."""
    return GrpcClient(target, model, [[V2Tensor(name, x)]])


async def run_level(client: Any, *, concurrency: int | None, rate_qps: float | None,
                    duration_s: float, warmup_s: float, protocol: str = "",
                    seed: int = 0) -> LevelResult:
    """One load level (`infermux.load.v2client.run_level`)."""
    return await _run_level(client, concurrency=concurrency, rate_qps=rate_qps,
                            duration_s=duration_s, warmup_s=warmup_s, seed=seed)


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
                              warmup_s=args.warmup)
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
