"""The KServe v2 REST front: an ASGI application served by uvicorn.

Routes (every one also under `/v2/models/{m}/versions/{v}/...`):
`GET /v2/health/live`, `/v2/health/ready`, `/v2`, `/v2/models/{m}`, `/v2/models/{m}/ready`,
`/v2/models/{m}/config`, `/v2/models/{m}/stats`, `/v2/models/stats`,
`POST /v2/models/{m}/infer`, `POST /v2/repository/index`.

`infer` takes JSON tensors and the binary tensor data extension: the JSON header's length in
`Inference-Header-Content-Length`, then each input's raw little-endian bytes in order
(`parameters.binary_data_size`); outputs come back binary when the request says
`binary_data_output` (or per output `binary_data`), else as JSON. Bodies may be gzip or
deflate encoded. Every malformed request gets a 4xx with a JSON `error` naming the field.

`handle()` is independent of the server library (it maps a method, path, headers and body to
a status, headers and body); `HttpFront` adapts it to ASGI.

Large bodies: uvicorn hands an ASGI app the body in pieces of at most 64 KiB, pausing and
resuming the socket and waking the app for each, then copies every piece twice; at 4.8 MB
per request (8 ResNet images) that per-piece Python on the event loop capped the server near
1.1 GB/s. `body_protocol()` is uvicorn's httptools protocol with one change: a body whose
Content-Length is within the limit is written straight into one buffer of that size and the
app is woken once, when it is complete (docs/architecture-serve.md, "Large requests").
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import weakref
import zlib
from typing import Any, cast

import numpy as np

from infermux.serve.core import (
    DATATYPES,
    InferenceCore,
    ModelInfo,
    ProtocolError,
    tensor_from_bytes,
    tensor_from_list,
)
from infermux.serve.shm import OutputTarget, SharedMemoryRegions, output_target

__all__ = ["BodyBudget", "CoalescingTransport", "HttpFront", "Reply", "body_budget", "body_limit",
           "handle", "inflate", "request_limit"]

#: (status, headers, body)
Reply = tuple[int, list[tuple[bytes, bytes]], bytes]
_JSON = (b"content-type", b"application/json")
#: Bytes a request body may have beyond its model's largest batch of inputs: the JSON header
#: (names, shapes, parameters, an id), a few hundred bytes from any v2 client.
_HEADER_ALLOWANCE = 64 << 10
#: Characters a JSON-encoded number may take ("-1.2345678901234567e-308, ").
_JSON_EXPANSION = 25
#: Bytes per value of the widest datatype accepted (FP64): the exact size of the largest
#: binary request.
_WIDEST_ITEMSIZE = max(dtype.itemsize for dtype in DATATYPES.values())
#: Compressed bodies are inflated this many bytes at a time, so that a body inflating past its
#: limit is stopped there, not after it has filled memory.
_INFLATE_STEP = 1 << 20
#: Compressed bodies larger than this are inflated on a thread, not on the event loop.
_INFLATE_INLINE_MAX = 64 << 10


def _json(status: int, payload: Any, extra: list[tuple[bytes, bytes]] | None = None) -> Reply:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return status, [_JSON, *(extra or [])], body


def error_reply(exc: ProtocolError) -> Reply:
    """A ProtocolError as `{"error": ...}` with its status (and Retry-After on a 503)."""
    extra = []
    if exc.retry_after_s is not None:
        extra.append((b"retry-after", str(max(1, round(exc.retry_after_s))).encode()))
    if exc.status == 401:
        extra.append((b"www-authenticate", b"Bearer"))
    return _json(exc.status, {"error": exc.message}, extra)


def _values(info: ModelInfo) -> int:
    """Input values of the model's largest request (every input at its max batch)."""
    longest = info.max_length or 1  # a dynamic dim (-1) at the longest length compiled
    return info.max_batch_size * sum(int(np.prod([longest if d == -1 else d for d in t.shape]))
                                     for t in info.inputs)


def request_limit(info: ModelInfo, *, binary: bool) -> int:
    """The largest body a request of model `info` can need, its JSON header included.

    Binary tensors count at their exact size in the widest datatype accepted (FP64, 8 bytes a
    value); JSON numbers at `_JSON_EXPANSION` characters each.
    """
    return _values(info) * (_WIDEST_ITEMSIZE if binary else _JSON_EXPANSION) + _HEADER_ALLOWANCE


def body_limit(core: InferenceCore, *, binary: bool = False) -> int:
    """The largest request body of any model (JSON, or `binary` tensors only, as gRPC sends)."""
    return max([request_limit(info, binary=binary) for info in core.models.values()]
               or [_HEADER_ALLOWANCE])


def body_budget(core: InferenceCore) -> int:
    """Bytes of request bodies the HTTP front holds at once, over every connection.

    What admission can take (each model's `max_queue_items` in the widest datatype) plus the
    largest single body, so one request of any model always fits in an idle server.
    """
    admitted = sum(info.max_queue_items * _values(info) // max(1, info.max_batch_size)
                   * _WIDEST_ITEMSIZE for info in core.models.values())
    return admitted + body_limit(core)


class BodyBudget:
    """Bytes of request bodies held at once; a body that does not fit is refused (503).

    Thread-safe: a body's bytes are given back when its buffer is freed, which may happen on a
    worker thread (a request's rows are views of its body until its batch has run).
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Reserve `n` bytes; False (nothing reserved) when they do not fit."""
        with self._lock:
            if self.held_bytes + n > self.limit_bytes:
                return False
            self.held_bytes += n
            return True

    def give(self, n: int) -> None:
        """Give back `n` reserved bytes."""
        with self._lock:
            self.held_bytes -= n

    def refusal(self, n: int) -> ProtocolError:
        """The 503 for a body of `n` bytes that does not fit."""
        return ProtocolError(503, f"the server holds {self.held_bytes} bytes of request bodies, "
                                  f"its limit is {self.limit_bytes}; a body of {n} bytes does not "
                                  "fit now: retry later", retry_after_s=1.0)


async def handle(core: InferenceCore, method: str, path: str, headers: dict[str, str],
                 body: bytes | bytearray | memoryview, api_key: str | None = None) -> Reply:
    """Answer one request; never raises for a bad request (a 4xx reply instead)."""
    try:
        return await _route(core, method, path.rstrip("/") or "/", headers, body, api_key)
    except ProtocolError as exc:
        return error_reply(exc)
    except RecursionError:
        # Anything walking a body's nesting (the JSON parser, numpy's conversion) stops here.
        return error_reply(ProtocolError(400, "the request's JSON is nested too deeply: send "
                                              "tensors flat, with their shape"))


def _check_key(headers: dict[str, str], api_key: str) -> None:
    given = headers.get("x-api-key")
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    if given is None or not hmac.compare_digest(given.encode(), api_key.encode()):
        raise ProtocolError(401, "missing or wrong API key: send `Authorization: Bearer KEY` "
                                 "or `X-API-Key: KEY`")


async def _route(core: InferenceCore, method: str, path: str, headers: dict[str, str],
                 body: bytes | bytearray | memoryview, api_key: str | None) -> Reply:
    parts = path.strip("/").split("/")
    if not parts or parts[0] != "v2":
        raise ProtocolError(404, f"no route {path!r}: the API is under /v2")
    rest = parts[1:]
    if rest[:1] == ["health"] and len(rest) == 2 and rest[1] in ("live", "ready"):
        _method(method, "GET", path)
        ok = core.live() if rest[1] == "live" else core.ready()
        return (200 if ok else 503), [], b""
    if api_key is not None:
        _check_key(headers, api_key)
    if not rest:
        _method(method, "GET", path)
        return _json(200, core.server_metadata())
    if rest[:1] in (["systemsharedmemory"], ["cudasharedmemory"]):
        return await _shared_memory(core, method, rest, body)
    if rest == ["models", "stats"]:
        _method(method, "GET", path)
        return _json(200, {"model_stats": [m.statistics() for m in core.models.values()]})
    if rest == ["repository", "index"]:
        _method(method, "POST", path)
        return _json(200, [{"name": m.name, "version": m.version,
                            "state": "READY" if core.model_ready(m.name) else "UNAVAILABLE"}
                           for m in core.models.values()])
    if rest[:1] != ["models"] or len(rest) < 2:
        raise ProtocolError(404, f"no route {path!r}")
    name, tail = rest[1], rest[2:]
    version = None
    if tail[:1] == ["versions"]:
        if len(tail) < 2:
            raise ProtocolError(404, f"no route {path!r}: give a version after /versions/")
        version, tail = tail[1], tail[2:]
    info = core.model(name, version)
    action = tail[0] if len(tail) == 1 else ("" if not tail else None)
    if action == "":
        _method(method, "GET", path)
        return _json(200, info.metadata())
    if action == "ready":
        _method(method, "GET", path)
        if core.model_ready(info.name):
            return 200, [], b""
        return _json(503, {"error": core.not_ready_reason(info.name)})
    if action == "config":
        _method(method, "GET", path)
        return _json(200, info.config())
    if action == "stats":
        _method(method, "GET", path)
        return _json(200, {"model_stats": [info.statistics()]})
    if action == "infer":
        _method(method, "POST", path)
        return await _infer(core, info, headers, body)
    raise ProtocolError(404, f"no route {path!r}")


async def _shared_memory(core: InferenceCore, method: str, rest: list[str],
                   body: bytes | bytearray | memoryview) -> Reply:
    """Triton's system and CUDA shared-memory routes (serve/shm.py)."""
    regions: SharedMemoryRegions | None = getattr(core, "shared_memory", None)
    if regions is None:
        raise ProtocolError(404, f"no route /v2/{'/'.join(rest)}: shared memory is not served "
                                 "by this server")
    status, payload = await regions.http_route(method, rest, body)
    return _json(status, payload) if payload is not None else (status, [], b"")


def _method(given: str, wanted: str, path: str) -> None:
    if given != wanted:
        raise ProtocolError(405, f"{given} {path}: this route takes {wanted}")


async def _decode(headers: dict[str, str], body: bytes | bytearray | memoryview, limit: int,
                  ) -> bytes | bytearray | memoryview:
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise ProtocolError(400, f"Content-Encoding {encoding!r} is not supported: use gzip, "
                                 "deflate or none")
    if len(body) <= _INFLATE_INLINE_MAX:
        return inflate(body, encoding, limit)
    return await asyncio.to_thread(inflate, body, encoding, limit)


def inflate(body: bytes | bytearray | memoryview, encoding: str, limit: int) -> bytes:
    """`body` inflated (gzip or deflate), `_INFLATE_STEP` bytes at a time, at most `limit`.

    A body that would inflate past `limit` is a 413 as soon as the limit is passed: a 100 KB
    gzip body can hold 100 MB of spaces.
    """
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    pieces: list[bytes] = []
    size = 0
    pending: bytes | bytearray | memoryview = body
    try:
        while True:
            piece = inflater.decompress(pending, _INFLATE_STEP)
            size += len(piece)
            if size > limit:
                raise ProtocolError(413, f"the {encoding} body inflates past the {limit} bytes "
                                         "the largest request of this model needs")
            pieces.append(piece)
            pending = inflater.unconsumed_tail
            if not pending and (inflater.eof or not piece):
                break
        if not inflater.eof:
            raise ProtocolError(400, f"the body is not valid {encoding} data: it ends early")
    except zlib.error as exc:
        raise ProtocolError(400, f"the body is not valid {encoding} data: {exc}") from None
    return b"".join(pieces)


async def _infer(core: InferenceCore, info: ModelInfo, headers: dict[str, str],
                 body: bytes | bytearray | memoryview) -> Reply:
    binary_request = "inference-header-content-length" in headers
    body = await _decode(headers, body, request_limit(info, binary=binary_request))
    length = headers.get("inference-header-content-length")
    if length is None:
        header_bytes, binary = bytes(body), memoryview(b"")
    else:
        try:
            size = int(length)
        except ValueError:
            raise ProtocolError(400, f"Inference-Header-Content-Length {length!r} is not an "
                                     "integer") from None
        if not 0 < size <= len(body):
            raise ProtocolError(400, f"Inference-Header-Content-Length {size} is outside the "
                                     f"body's {len(body)} bytes")
        header_bytes, binary = bytes(body[:size]), memoryview(body)[size:]
    try:
        request = json.loads(header_bytes)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(400, f"the request's JSON header is not valid JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError(400, "the request's JSON is nested too deeply: send tensors flat, "
                                 "with their shape") from None
    if not isinstance(request, dict):
        raise ProtocolError(400, "the request's JSON header must be an object with `inputs`")
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError(400, f"id must be a string, not {type(request_id).__name__}")
    params = _params(request.get("parameters"), "parameters")
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError(400, "inputs must be a non-empty list of tensors")
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for k, tensor in enumerate(inputs):
        if not isinstance(tensor, dict):
            raise ProtocolError(400, f"inputs[{k}] must be an object with name, datatype, shape")
        spec, shape = info.check_input(tensor.get("name"), tensor.get("datatype"),
                                       tensor.get("shape"))
        if spec.name in tensors:
            raise ProtocolError(400, f"input {spec.name!r} is given twice")
        tparams = _params(tensor.get("parameters"), f"inputs[{k}].parameters")
        nbytes = tparams.get("binary_data_size")
        regions = getattr(core, "shared_memory", None)
        from_region = None if regions is None else regions.input(
            spec.name, tensor["datatype"], shape, tparams)
        if from_region is not None:
            tensors[spec.name] = from_region
        elif nbytes is not None:
            if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
                raise ProtocolError(400, f"input {spec.name!r} parameters.binary_data_size "
                                         f"{nbytes!r} is not a byte count")
            if "data" in tensor:
                raise ProtocolError(400, f"input {spec.name!r} has both data and "
                                         "binary_data_size: give one")
            if offset + nbytes > len(binary):
                raise ProtocolError(400, f"input {spec.name!r} declares {nbytes} bytes of binary "
                                         f"data, {len(binary) - offset} follow the JSON header")
            tensors[spec.name] = tensor_from_bytes(spec.name, tensor["datatype"], shape,
                                                   binary[offset:offset + nbytes])
            offset += nbytes
        elif "data" in tensor:
            tensors[spec.name] = tensor_from_list(spec.name, tensor["datatype"], shape,
                                                  tensor["data"])
        else:
            raise ProtocolError(400, f"input {spec.name!r} has neither data nor "
                                     "parameters.binary_data_size")
    if offset != len(binary):
        raise ProtocolError(400, f"{len(binary)} bytes follow the JSON header, the inputs "
                                 f"declare {offset}")
    missing = [t.name for t in info.inputs if t.name not in tensors]
    if missing:
        raise ProtocolError(400, f"inputs {missing} are missing")
    wanted, targets = _requested_outputs(info, request.get("outputs"),
                                         _flag(params, "binary_data_output", "parameters"))
    batch = {len(t) for t in tensors.values()}
    if len(batch) > 1:
        raise ProtocolError(400, f"inputs have different batch sizes {sorted(batch)}")
    outputs = await core.infer(info, tensors if info.io is not None
                               else tensors[info.inputs[0].name])
    return _response(info, request_id, outputs, wanted, targets, getattr(core, "shared_memory",
                                                                          None))


def _params(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(400, f"{where} must be an object, not {type(value).__name__}")
    return value


def _flag(params: dict[str, Any], key: str, where: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise ProtocolError(400, f"{where}.{key} must be true or false, not {value!r}")
    return value


def _requested_outputs(info: ModelInfo, requested: Any, binary: bool,
                       ) -> tuple[list[tuple[int, bool]], dict[int, OutputTarget]]:
    """(output index, as binary) for each output to return, in the order asked.

    With them, the shared-memory region of each output whose parameters name one.
    """
    names = {t.name: i for i, t in enumerate(info.outputs)}
    targets: dict[int, OutputTarget] = {}
    if requested is None:
        return [(i, binary) for i in range(len(info.outputs))], targets
    if not isinstance(requested, list):
        raise ProtocolError(400, "outputs must be a list of {name, parameters}")
    wanted = []
    for k, out in enumerate(requested):
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise ProtocolError(400, f"outputs[{k}] must be an object with a name")
        if out["name"] not in names:
            raise ProtocolError(400, f"output name {out['name']!r} is not an output of model "
                                     f"{info.name!r}; outputs: {', '.join(names)}")
        params = _params(out.get("parameters"), f"outputs[{k}].parameters")
        if "classification" in params:
            raise ProtocolError(400, f"outputs[{k}].parameters.classification is not supported: "
                                     "ask for the tensor and take its top-k")
        as_binary = _flag(params, "binary_data", f"outputs[{k}].parameters") \
            if "binary_data" in params else binary
        target = output_target(params, f"outputs[{k}].parameters")
        if target is not None:
            targets[names[out["name"]]] = target
        wanted.append((names[out["name"]], as_binary))
    return wanted, targets


def _response(info: ModelInfo, request_id: str | None, outputs: list[np.ndarray],
              wanted: list[tuple[int, bool]], targets: dict[int, OutputTarget] | None = None,
              regions: SharedMemoryRegions | None = None) -> Reply:
    entries = []
    chunks = []
    for index, as_binary in wanted:
        spec, y = info.outputs[index], outputs[index]
        entry: dict[str, Any] = {"name": spec.name, "datatype": spec.datatype,
                                 "shape": list(y.shape)}
        target = (targets or {}).get(index)
        if target is not None:
            if regions is None:
                raise ProtocolError(400, "shared memory is not served here")
            # As Triton answers: no parameters (its clients read any `parameters` of an
            # output as binary data's).
            regions.write_output(spec.name, y, target, DATATYPES[spec.datatype])
        elif as_binary:
            raw = np.ascontiguousarray(y, dtype=DATATYPES[spec.datatype]).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = np.asarray(y, dtype=DATATYPES[spec.datatype]).ravel().tolist()
        entries.append(entry)
    payload: dict[str, Any] = {"model_name": info.name, "model_version": info.version,
                               "outputs": entries}
    if request_id is not None:
        payload["id"] = request_id
    header = json.dumps(payload, separators=(",", ":")).encode()
    if not chunks:
        return 200, [_JSON], header
    return 200, [(b"content-type", b"application/octet-stream"),
                 (b"inference-header-content-length", str(len(header)).encode())], \
        b"".join([header, *chunks])


class HttpFront:
    """The ASGI application: reads the body (bounded), calls `handle`, sends the reply.

    Memory held for request bodies is bounded twice: each body by the largest request its
    model can need (`request_limit`; 413 before it is read), and all bodies held at once by
    `budget` (503 with Retry-After before a body that does not fit is read).
    """

    def __init__(self, core: InferenceCore, api_key: str | None = None,
                 budget_bytes: int | None = None) -> None:
        self.core = core
        self.api_key = api_key
        self.max_body = body_limit(core)
        self.budget = BodyBudget(budget_bytes if budget_bytes is not None
                                 else body_budget(core))
        #: (model, binary) → `request_limit`, computed once per model.
        self._limits: dict[tuple[str, bool], int] = {}

    def limit(self, path: str, headers: dict[str, str]) -> tuple[int, ProtocolError | None]:
        """(the largest body `path` takes, or the 413 its headers already earn)."""
        parts = path.strip("/").split("/")
        info = self.core.models.get(parts[2]) if parts[:2] == ["v2", "models"] \
            and len(parts) > 2 else None
        if info is None or parts[-1] != "infer":
            return _HEADER_ALLOWANCE, None  # routes that read no tensors (or a 400 to come)
        header = headers.get("inference-header-content-length")
        if header is not None and header.isdigit() and int(header) > _HEADER_ALLOWANCE:
            return 0, ProtocolError(413, f"the JSON header of {header} bytes is larger than the "
                                         f"{_HEADER_ALLOWANCE} allowed beside binary tensors")
        binary = header is not None
        limit = self._limits.get((info.name, binary))
        if limit is None:  # a model's limits do not change while it is served
            limit = self._limits[info.name, binary] = request_limit(info, binary=binary)
        return limit, None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI entry point (lifespan events are acknowledged, nothing else is served)."""
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        reserved = [0]  # bytes of a body read here (not collected whole) taken from the budget
        try:
            reply, body = await self._read(headers, receive, scope, reserved)
            if reply is None:
                reply = await handle(self.core, scope["method"], scope["path"], headers, body,
                                     self.api_key)
            del body
        finally:
            if reserved[0]:
                self.budget.give(reserved[0])
        status, out_headers, payload = reply
        out_headers = [*out_headers, (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": out_headers})
        await send({"type": "http.response.body", "body": payload})

    async def _read(self, headers: dict[str, str], receive: Any, scope: dict[str, Any],
                    reserved: list[int]) -> tuple[Reply | None, bytes | memoryview]:
        """(None, the body); or (a 413 or 503 reply, b"") without reading it."""
        limit, refused = self.limit(scope["path"], headers)
        if refused is not None:
            return error_reply(refused), b""
        too_large = ProtocolError(413, f"the request body is larger than the {limit} bytes "
                                       "the largest request of this model needs")
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return error_reply(too_large), b""
        whole = _body_of(scope)
        if whole is None and declared is not None and declared.isdigit() and int(declared):
            # Not collected by `body_protocol` (no room in the budget then, or another
            # protocol): the declared bytes are reserved before any is read.
            if not self.budget.take(int(declared)):
                return error_reply(self.budget.refusal(int(declared))), b""
            reserved[0] = int(declared)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return error_reply(too_large), b""
            if size > reserved[0] and whole is None:  # chunked: reserved as it comes
                if not self.budget.take(size - reserved[0]):
                    return error_reply(self.budget.refusal(size)), b""
                reserved[0] = size
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if whole is not None and whole.complete:
            return None, whole.view()
        return None, b"".join(chunks)


#: The scope extension under which `body_protocol()` leaves a request's collected body.
_BODY_EXTENSION = "infermux.body"


class _Body:
    """A request body collected in one buffer of its declared length.

    A numpy buffer: not zero-filled first (a `bytearray` of 4.8 MB was), and the copy of each
    piece into it releases the GIL, so the worker threads run meanwhile. Its bytes were taken
    from a `BodyBudget` and go back to it when the buffer is freed: a request's rows are views
    of it until their batch has run, so that is when the memory is really given back.
    """

    __slots__ = ("buffer", "filled")

    def __init__(self, size: int, budget: BodyBudget | None = None) -> None:
        self.buffer = np.empty(size, dtype=np.uint8)
        self.filled = 0
        if budget is not None:
            weakref.finalize(self.buffer, budget.give, size)

    def add(self, piece: bytes) -> None:
        end = self.filled + len(piece)
        self.buffer[self.filled:end] = np.frombuffer(piece, dtype=np.uint8)
        self.filled = end

    @property
    def complete(self) -> bool:
        return self.filled == len(self.buffer)

    def view(self) -> memoryview:
        return self.buffer.data


def _body_of(scope: Any) -> _Body | None:
    body: _Body | None = (scope.get("extensions") or {}).get(_BODY_EXTENSION)
    return body


#: Above this many bytes a turn's writes are sent as they came: joining them would copy a
#: large body to save one send, which only small responses notice.
_COALESCE_MAX_BYTES = 64 << 10


class CoalescingTransport:
    """A transport whose writes of one event-loop turn leave in one send.

    uvicorn writes a response's status line and headers at `http.response.start` and its body
    at `http.response.body`: two sends, two TCP segments and two wake-ups of the client for
    every response. Held until the turn ends (`call_soon`), they leave as one (as they came
    when they add up to more than `_COALESCE_MAX_BYTES`). `close()` sends what is held first;
    every other attribute is the wrapped transport's.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self._held_bytes = 0

    def write(self, data: bytes) -> None:
        """Hold `data` until the turn ends (the first write of a turn schedules the send)."""
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)
        self._held_bytes += len(data)

    def flush(self) -> None:
        """Send what the turn wrote (nothing once the connection is closing)."""
        held, self._held = self._held, []
        size, self._held_bytes = self._held_bytes, 0
        if not held or self._transport.is_closing():
            return
        if len(held) == 1 or size > _COALESCE_MAX_BYTES:
            for data in held:
                self._transport.write(data)
        else:
            self._transport.write(b"".join(held))

    def close(self) -> None:
        """Send what is held, then close."""
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def body_protocol(front: HttpFront) -> Any:
    """The httptools protocol of uvicorn, collecting bodies whole and coalescing writes.

    A request with a Content-Length within its model's limit (`HttpFront.limit`) that fits in
    the front's budget gets a buffer of that size (scope extension `infermux.body`); each
    piece read is copied into it, the socket is not paused per 64 KiB, and the app's
    `receive()` returns once the body is complete. Anything else (chunked bodies, larger ones,
    ones that do not fit now; the app answers the last two with 413 and 503) goes uvicorn's
    own way. A response leaves in one send (`CoalescingTransport`). None when uvicorn's
    httptools protocol is not there (uvicorn then picks its own).
    """
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools is not installed: uvicorn's own h11 protocol serves
        return None

    class WholeBodyProtocol(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            # A stand-in with the transport's interface (its other attributes pass through).
            self.transport = cast("asyncio.Transport", CoalescingTransport(transport, self.loop))

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            cycle = getattr(self, "cycle", None)
            if cycle is None or cycle.scope is not self.scope:
                return
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in self.headers
                       if k in (b"content-length", b"inference-header-content-length")}
            length = headers.get("content-length", "")
            if not length.isdigit() or int(length) == 0:
                return
            limit, refused = front.limit(cycle.scope.get("path", ""), headers)
            if refused is not None or int(length) > limit \
                    or not front.budget.take(int(length)):
                return  # the app answers 413 or 503 before reading the body
            extensions: dict[str, Any] = cycle.scope.setdefault("extensions", {})
            extensions[_BODY_EXTENSION] = _Body(int(length), front.budget)

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            whole = _body_of(cycle.scope) if cycle is not None else None
            if whole is None or cycle.response_complete \
                    or whole.filled + len(body) > len(whole.buffer):
                super().on_body(body)
                return
            whole.add(body)

    return WholeBodyProtocol
