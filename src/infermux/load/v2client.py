"""A KServe v2 load client: closed-loop concurrency or Poisson arrivals, over HTTP or gRPC.

It speaks only the v2 protocol (`POST /v2/models/M/infer` with the binary tensor extension, or
gRPC `ModelInfer` with raw contents), so it drives any v2 server: `infermux serve`, KServe's
ModelServer, Triton. A request carries every input of the model, each with its own datatype
and shape (token ids, masks, a sequence length per request); the client cycles through the
requests it was given. Throughput counts answered requests over the measuring window, after a
warm-up; latency is per request, from send to the last byte of the answer (with Poisson
arrivals from the scheduled arrival, as MLPerf LoadGen counts it). 503s / UNAVAILABLE are
counted apart from errors.

`closed_loop_peak` finds the highest closed-loop throughput within a p99 bound, the figure
perf_analyzer's concurrency sweeps give: it is what `infermux tune --served` ranks plans by.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import itertools
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GrpcClient", "HttpClient", "LevelResult", "V2Tensor", "as_datatypes",
           "closed_loop_peak", "model_datatypes", "perf_analyzer_figures", "requests_from_samples",
           "run_level", "v2_datatype"]

#: numpy dtype name → the v2 protocol's datatype.
_V2 = {"float32": "FP32", "float16": "FP16", "float64": "FP64", "int64": "INT64",
       "int32": "INT32", "bool": "BOOL", "uint8": "UINT8", "int8": "INT8"}


def v2_datatype(array: np.ndarray) -> str:
    """The v2 datatype of an array's dtype (FP32, INT64, ...)."""
    try:
        return _V2[array.dtype.name]
    except KeyError:
        raise ValueError(f"dtype {array.dtype.name} has no v2 datatype here: use one of "
                         f"{', '.join(_V2)}") from None


def model_datatypes(host: str, http_port: int, model: str, timeout_s: float = 10.0,
                    ) -> dict[str, str]:
    """Each input's datatype as the server's model metadata states it (`GET /v2/models/M`)."""
    import urllib.request

    url = f"http://{host}:{http_port}/v2/models/{model}"
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        meta = json.loads(answer.read())
    return {t["name"]: t["datatype"] for t in meta.get("inputs", [])}


def as_datatypes(requests: Sequence[Sequence[V2Tensor]], datatypes: dict[str, str],
                 ) -> list[list[V2Tensor]]:
    """The requests with each tensor cast to the datatype the server states for its input.

    A client must send what the model takes (an fp16 plan's server takes FP16: half the bytes);
    a datatype numpy has no dtype for (BF16) leaves the tensor as it is.
    """
    dtypes = {v: np.dtype(k) for k, v in _V2.items()}
    return [[V2Tensor(t.name, t.array.astype(dtypes[datatypes[t.name]], copy=False))
             if datatypes.get(t.name) in dtypes else t for t in tensors] for tensors in requests]


@dataclass(frozen=True)
class V2Tensor:
    """One input of one request: its name and its values, batch axis first."""

    name: str
    array: np.ndarray

    @property
    def datatype(self) -> str:
        """Its v2 datatype."""
        return v2_datatype(self.array)


def requests_from_samples(names: Sequence[str], arrays: Sequence[np.ndarray],
                          lengths: np.ndarray | None = None,
                          dynamic_axes: Sequence[Sequence[int]] | None = None,
                          ) -> list[list[V2Tensor]]:
    """One single-item request per sample, from per-input sample arrays (`IOSamples`' layout).

    `arrays[i]` holds input i's samples, `(count, ...)`. With `lengths`, sample s is cut to its
    own length along each of input i's `dynamic_axes[i]` (axes of one item, 1-based as in the
    batch array), so a server sees requests of the lengths a client sends, unpadded.
    """
    out: list[list[V2Tensor]] = []
    for s in range(len(arrays[0])):
        tensors = []
        for i, (name, array) in enumerate(zip(names, arrays, strict=True)):
            part = array[s:s + 1]
            if lengths is not None and dynamic_axes is not None:
                cut = [slice(None)] * part.ndim
                for axis in dynamic_axes[i]:
                    cut[axis] = slice(0, int(lengths[s]))
                part = part[tuple(cut)]
            tensors.append(V2Tensor(name, np.ascontiguousarray(part)))
        out.append(tensors)
    return out


@dataclass
class LevelResult:
    """One load level: what was sent, answered and refused, and request latencies (ms)."""

    protocol: str
    concurrency: int | None
    rate_qps: float | None
    duration_s: float
    ok: int = 0
    rejected: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    first_error: str | None = None

    def summary(self) -> dict[str, Any]:
        """Counts, throughput (answered requests/s) and latency percentiles."""
        lat = np.asarray(self.latencies_ms) if self.latencies_ms else np.zeros(1)
        out = {k: v for k, v in asdict(self).items() if k != "latencies_ms"}
        out.update(throughput_rps=self.ok / self.duration_s,
                   p50_ms=float(np.percentile(lat, 50)), p90_ms=float(np.percentile(lat, 90)),
                   p95_ms=float(np.percentile(lat, 95)), p99_ms=float(np.percentile(lat, 99)))
        return out


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


class _Refused(Exception):  # noqa: N818 - a 503 that also ended the connection
    pass


class _Failed(Exception):  # noqa: N818 - an answer other than 200 or 503, with its text
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


class HttpClient:
    """One keep-alive connection per concurrent stream; binary tensors both ways."""

    protocol = "http"

    def __init__(self, host: str, port: int, model: str,
                 requests: Sequence[Sequence[V2Tensor]]) -> None:
        self.host, self.port = host, port
        self.requests = [self._encode(model, r) for r in requests]
        self._next = itertools.cycle(self.requests)
        self._open: list[Any] = []

    def _encode(self, model: str, tensors: Sequence[V2Tensor]) -> bytes:
        header = json.dumps({
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.array.shape),
                        "parameters": {"binary_data_size": t.array.nbytes}} for t in tensors],
            "parameters": {"binary_data_output": True}}).encode()
        body = header + b"".join(t.array.tobytes() for t in tensors)
        return (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Inference-Header-Content-Length: {len(header)}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    async def connect(self) -> Any:
        """A new keep-alive connection: (reader, writer)."""
        conn = await asyncio.open_connection(self.host, self.port)
        self._open.append(conn[1])
        return conn

    async def call(self, conn: Any) -> int:
        """Send the next request on `conn`; its status (a 503 raises, having closed it)."""
        reader, writer = conn
        writer.write(next(self._next))
        status, body = await _read_response(reader)
        if status == 503:  # a server may close the connection after refusing (uvicorn does)
            writer.close()
            raise _Refused
        if status != 200:
            raise _Failed(status, body[:200].decode("utf-8", "replace"))
        return status

    async def finish(self) -> None:
        """Close every connection this client opened."""
        writers, self._open = self._open, []
        for writer in writers:
            writer.close()


class GrpcClient:
    """One channel per concurrent stream (as perf_analyzer opens them); raw contents."""

    protocol = "grpc"

    def __init__(self, target: str, model: str,
                 requests: Sequence[Sequence[V2Tensor]]) -> None:
        from tritonclient.grpc import service_pb2

        self.target = target
        self.requests = []
        for tensors in requests:
            request = service_pb2.ModelInferRequest(model_name=model)
            for t in tensors:
                request.inputs.add(name=t.name, datatype=t.datatype, shape=list(t.array.shape))
                request.raw_input_contents.append(t.array.tobytes())
            self.requests.append(request)
        self._next = itertools.cycle(self.requests)
        self._channels: list[Any] = []

    async def connect(self) -> Any:
        """A stub on a new channel."""
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        channel = grpc.aio.insecure_channel(self.target, options=[
            ("grpc.max_receive_message_length", 1 << 30),
            ("grpc.max_send_message_length", 1 << 30)])
        self._channels.append(channel)
        return service_pb2_grpc.GRPCInferenceServiceStub(channel)

    async def call(self, stub: Any) -> int:
        """Send the next request through `stub`: 200, or 503 for UNAVAILABLE."""
        import grpc

        try:
            await stub.ModelInfer(next(self._next))
            return 200
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return 503
            raise _Failed(500, f"{exc.code().name}: {exc.details()}") from None

    async def finish(self) -> None:
        """Close every channel this client opened."""
        channels, self._channels = self._channels, []
        for channel in channels:
            await channel.close()


async def _call(client: Any, conn: Any) -> tuple[int, Any, str | None]:
    """One call: (status, the connection to reuse or None, error text).

    503s and broken connections are not reused.
    """
    try:
        return await client.call(conn), conn, None
    except _Refused:
        return 503, None, None
    except _Failed as exc:
        return exc.status, conn, str(exc)
    except (OSError, asyncio.IncompleteReadError) as exc:
        return 0, None, f"connection: {exc!r}"


async def run_level(client: Any, *, concurrency: int | None = None,
                    rate_qps: float | None = None, duration_s: float, warmup_s: float,
                    seed: int = 0) -> LevelResult:
    """One load level; its counts and latencies over the window after the warm-up."""
    if (concurrency is None) == (rate_qps is None):
        raise ValueError("give a concurrency or a rate, one of them")
    start = time.perf_counter()
    t0, t1 = start + warmup_s, start + warmup_s + duration_s
    result = LevelResult(client.protocol, concurrency, rate_qps, duration_s)

    def record(status: int, began: float, ended: float, error: str | None) -> None:
        if not t0 <= began < t1:
            return
        if status == 200:
            result.ok += 1
            result.latencies_ms.append((ended - began) * 1e3)
        elif status == 503:
            result.rejected += 1
        else:
            result.errors += 1
            result.first_error = result.first_error or error

    if concurrency is not None:
        async def stream() -> None:
            conn = None
            while time.perf_counter() < t1:
                began = time.perf_counter()
                try:
                    conn = conn or await client.connect()
                except OSError as exc:
                    record(0, began, time.perf_counter(), f"connection: {exc!r}")
                    await asyncio.sleep(0.01)
                    continue
                status, conn, error = await _call(client, conn)
                record(status, began, time.perf_counter(), error)

        try:
            await asyncio.gather(*(stream() for _ in range(concurrency)))
        finally:
            await client.finish()
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
        except OSError as exc:
            record(0, due, time.perf_counter(), f"connection: {exc!r}")
            return
        status, kept, error = await _call(client, conn)
        record(status, due, time.perf_counter(), error)
        if kept is not None:
            pool.put_nowait(kept)

    while at < t1:
        at += rng.expovariate(rate_qps)
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(at)))
    try:
        await asyncio.gather(*tasks)
    finally:
        await client.finish()
    return result


#: A level whose refused or failed requests pass this share of those sent does not count,
#: whatever its p99: its latencies are those of the requests the server chose to answer.
REFUSED_SHARE = 0.01


def _within(row: dict[str, Any], bound_ms: float) -> bool:
    sent = row["ok"] + row["rejected"] + row["errors"]
    return (row["ok"] > 0 and row["p99_ms"] <= bound_ms
            and row["rejected"] + row["errors"] <= REFUSED_SHARE * sent)


def closed_loop_peak(measure: Callable[[int], dict[str, Any]], bound_ms: float, *,
                     max_concurrency: int = 512, plateau: float = 1.03,
                     refine: int = 2) -> dict[str, Any]:
    """The highest closed-loop throughput whose p99 is within `bound_ms`.

    `measure(c)` runs concurrency c and returns a `LevelResult.summary()`-like row
    (`throughput_rps`, `p99_ms`, `ok`, `rejected`, `errors`). Concurrency doubles from 1 while
    the p99 holds the bound and the throughput still rises (by `plateau` or more, at one of the
    last two levels: past the knee more streams only queue); between the last level within the
    bound and the first past it, up to `refine` midpoints are tried. Returns the peak row
    (`concurrency`, `throughput_rps`, `p99_ms`), every level measured in order (`levels`), and
    `reason` when no level held.
    """
    levels: list[dict[str, Any]] = []

    def run(c: int) -> dict[str, Any]:
        row = {**measure(c), "concurrency": c}
        row["within_bound"] = _within(row, bound_ms)
        levels.append(row)
        return row

    good: dict[str, Any] | None = None
    bad: int | None = None
    flat = 0
    c = 1
    while c <= max_concurrency:
        row = run(c)
        if not row["within_bound"]:
            bad = c
            break
        rising = good is None or row["throughput_rps"] >= plateau * good["throughput_rps"]
        if good is None or row["throughput_rps"] > good["throughput_rps"]:
            good = row
        flat = 0 if rising else flat + 1
        if flat == 2:  # two levels in a row: one may be a noisy one
            break
        c *= 2
    if good is not None and bad is not None:
        low = good["concurrency"]
        for _ in range(refine):
            mid = (low + bad) // 2
            if mid <= low:
                break
            row = run(mid)
            if row["within_bound"]:
                low = mid
                if row["throughput_rps"] > good["throughput_rps"]:
                    good = row
            else:
                bad = mid
    out: dict[str, Any] = {"p99_bound_ms": bound_ms, "levels": levels}
    if good is None:
        first = levels[0]
        sent = first["ok"] + first["rejected"] + first["errors"]
        if first["ok"] == 0 or first["rejected"] + first["errors"] > REFUSED_SHARE * sent:
            why = (f"{first['rejected'] + first['errors']} of {sent} requests refused or "
                   "failed at concurrency 1"
                   + (f" ({first['first_error']})" if first.get("first_error") else ""))
        else:
            why = (f"p99 {first['p99_ms']:.1f} ms at concurrency 1 is past the bound "
                   f"({bound_ms:g} ms)")
        return {**out, "peak_rps": None, "concurrency": None, "p99_ms": None, "reason": why}
    return {**out, "peak_rps": good["throughput_rps"], "concurrency": good["concurrency"],
            "p99_ms": good["p99_ms"], "reason": None}


def perf_analyzer_figures(csv_file: Path) -> dict[str, Any]:
    """perf_analyzer's CSV row (`-f FILE`): requests/s, p50 and p99, and where time went.

    The split (µs, perf_analyzer's averages, where the server reports statistics): the server's
    queue and compute, and the rest (`outside_us`): protocol, fronts, link, runtime process.
    """
    with Path(csv_file).open() as f:
        data = next(csv.DictReader(f))
    row: dict[str, Any] = {"requests_per_s": float(data["Inferences/Second"]),
                           "p50_ms": float(data["p50 latency"]) / 1e3,
                           "p99_ms": float(data["p99 latency"]) / 1e3}
    with contextlib.suppress(KeyError, ValueError):
        server = {k: float(data[f"Server {k.title()}"]) for k in
                  ("queue", "compute input", "compute infer", "compute output")}
        outside = float(data["Network+Server Send/Recv"])
        client = float(data["Client Send"]) + float(data["Client Recv"])
        row.update(avg_us=round(client + outside + sum(server.values()), 1),
                   server_queue_us=server["queue"],
                   server_compute_us=round(sum(server.values()) - server["queue"], 1),
                   outside_us=outside)
    return row
