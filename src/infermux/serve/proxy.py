"""A front process's stand-in for the runtime: the `InferenceCore` methods the fronts call.

serve/http.py and serve/grpc_front.py talk to an object with `models`, `model()`, `infer()`,
`live()`, `ready()`, `model_ready()`, `not_ready_reason()` and `server_metadata()`. In a front
process (`infermux serve --fronts N`) that object is a `RuntimeProxy`: `infer()` writes the
request's rows into the model's slab (shared memory the runtime process maps), sends a
24-byte descriptor over the link and awaits the answer, whose outputs the runtime wrote into
the same slots. Readiness, the shutting-down flag and the statistics are pushed by the
runtime process every `STATE_PERIOD_S` (and at once when it starts shutting down), so the
protocol handlers answer them without a round trip.

The link is a Unix stream socket carrying frames (`frame()`): a 5-byte header (payload bytes,
kind) and the payload. Descriptors sent in one event-loop turn go in one frame, and so do the
answers the runtime finished in one turn, so neither side pays a system call per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from infermux.serve.core import ModelInfo, ProtocolError, find_model
from infermux.serve.shm import Segment, SharedMemoryRegions, SlabLayout, SlotAllocator
from infermux.serve.steer import attach, program
from infermux.serve.trace import RequestTrace

__all__ = [
    "DTYPE_CODES",
    "REFUSALS",
    "REQUEST",
    "STATE_PERIOD_S",
    "FrameReader",
    "Kind",
    "Link",
    "RuntimeProxy",
    "frame",
]

#: How often the runtime process pushes readiness and statistics to the fronts.
STATE_PERIOD_S = 0.1
#: A front counts a gRPC connection as its load while calls came on it within this many state
#: periods (0.1–0.2 s). Longer, a front that has just lost connections to their age still
#: counts them while their clients reconnect, and the steering sends the new ones elsewhere.
PEER_TICKS = 2
_HEADER = struct.Struct("<IB")
#: A request's descriptor: id, model index, input dtype code, first slot, items, sequence
#: length (a model of several inputs with a sequence dim; else 0), and the client requests it
#: carries (a front's: 1; a Triton instance's: every request of its Triton batch), which the
#: statistics and metrics count.
REQUEST = struct.Struct("<QHBxIIII")
_ID = struct.Struct("<Q")
#: Requests of one model a front refused itself (its slab full, shutting down): index, count.
REFUSALS = struct.Struct("<HI")
#: Input dtypes a descriptor names by code (FP16 rows go as they are; the runner converts).
DTYPE_CODES: tuple[np.dtype, ...] = (np.dtype("<f4"), np.dtype("<f2"))


class Kind:
    """Frame kinds of the link."""

    INIT = 1      # runtime → front: models, slabs, settings (pickle, once)
    READY = 2     # front → runtime: the fronts listen (JSON: pid)
    INFER = 3     # front → runtime: REQUEST descriptors
    DONE = 4      # runtime → front: ids answered with outputs in their slots
    ERROR = 5     # runtime → front: JSON [[id, status, message, retry_after_s], ...]
    STATE = 6     # runtime → front: JSON readiness, statistics, shutting down
    DRAIN = 7     # runtime → front: stop accepting, answer what is admitted, exit
    REGIONS = 8   # front → runtime: JSON {id, op, ...}: a client (un)registered shared memory
    ACK = 9       # runtime → front: JSON {id, error}: every front has been told
    REFUSED = 10  # front → runtime: REFUSALS (model index, requests) the front answered 503
    SHAPED = 11   # runtime → front: JSON [[id, [shape of each output's item]], ...] answered
    #               (models of several inputs: the shapes follow the request's length)
    HELLO = 12    # Triton model instance → runtime: JSON {model, pid}, its first frame
    LISTEN = 13   # runtime → front: open the gRPC port now (the fronts join its group in turn)
    PEERS = 14    # front → runtime: JSON {connections}: gRPC connections with calls lately
    STEER = 15    # runtime → front: JSON [[socket index, share], ...] to attach to the group


def frame(kind: int, payload: bytes | bytearray) -> bytes:
    """One frame of the link."""
    return _HEADER.pack(len(payload), kind) + bytes(payload)


class FrameReader:
    """Splits a byte stream into frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The frames completed by `data`, (kind, payload) in order."""
        self._buf += data
        frames = []
        at = 0
        while len(self._buf) - at >= _HEADER.size:
            size, kind = _HEADER.unpack_from(self._buf, at)
            end = at + _HEADER.size + size
            if end > len(self._buf):
                break
            frames.append((kind, bytes(self._buf[at + _HEADER.size:end])))
            at = end
        if at:
            del self._buf[:at]
        return frames


class Link(asyncio.Protocol):
    """One end of the front ⇄ runtime socket: frames in to `on_frame`, batched frames out."""

    def __init__(self, on_frame: Callable[[int, bytes], None],
                 on_lost: Callable[[], None], reader: FrameReader | None = None) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        # `reader`: one that already read from this socket (a partial frame may be in it).
        self._reader = reader or FrameReader()
        self.transport: asyncio.Transport | None = None
        self._out: list[bytes] = []
        self._scheduled = False

    def connection_made(self, transport: Any) -> None:  # noqa: D102 - asyncio's protocol
        self.transport = transport

    def data_received(self, data: bytes) -> None:  # noqa: D102
        for kind, payload in self._reader.feed(data):
            self._on_frame(kind, payload)

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
        self.transport = None
        self._on_lost()

    def send(self, kind: int, payload: bytes | bytearray, *, now: bool = False) -> None:
        """Queue a frame; everything queued in this loop turn is written with one call.

        `now`: write it (and what is queued before it) at once, for a caller that has already
        gathered a loop turn's worth (a request waits on every turn it is held back).
        """
        self._out.append(frame(kind, payload))
        if now:
            self._flush()
        elif not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        out, self._out = self._out, []
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))


@dataclass
class _Slab:
    index: int
    segment: Segment
    allocator: SlotAllocator
    layout: SlabLayout


@dataclass
class _Waiting:
    future: asyncio.Future[list[np.ndarray]]
    slab: _Slab
    start: int
    items: int
    #: A model of several inputs: the request's sequence length (its outputs' -1 dims).
    length: int | None = None
    #: The request's stage stamps when it is traced (serve/trace.py), else None.
    trace: dict[str, int] | None = None


@dataclass
class FrontModel(ModelInfo):
    """A model as a front process knows it: the runtime's description, its statistics pushed."""

    remote_statistics: dict[str, Any] | None = None

    def statistics(self) -> dict[str, Any]:
        """The runtime's latest statistics record of this model."""
        if self.remote_statistics is not None:
            return self.remote_statistics
        return super().statistics()


class RuntimeProxy:
    """What the protocol handlers call in a front process; everything forwarded to the runtime."""

    def __init__(self, init: dict[str, Any]) -> None:
        self.models: dict[str, FrontModel] = {}
        self._slabs: dict[str, _Slab] = {}
        for index, (info, (name, slots), layout) in enumerate(zip(
                init["models"], init["slabs"], init["layouts"], strict=True)):
            fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
            self.models[info.name] = FrontModel(**fields)
            self._slabs[info.name] = _Slab(index, Segment(name, 0, create=False),
                                           SlotAllocator(slots), layout)
        self._server_metadata: dict[str, Any] = init["server_metadata"]
        #: Triton's shared-memory regions, registered with this front by its clients.
        self.shared_memory = SharedMemoryRegions()
        self.shared_memory.publish = self._publish
        self._acks: dict[int, asyncio.Future[None]] = {}
        self.link: Link | None = None
        self._pending: dict[int, _Waiting] = {}
        self._ids = itertools.count(1)
        self._state: dict[str, Any] = {"closing": False, "models": {}}
        self._batch = bytearray()
        self._refusals: dict[int, int] = {}
        self._scheduled = False
        self._idle: asyncio.Event | None = None
        self.runtime_gone = asyncio.Event()
        #: This front's part of the stage trace (`serve --trace-requests`), or None: off.
        self.trace: RequestTrace | None = None
        settings = init.get("settings")
        if settings is not None and settings.trace_requests:
            self.trace = RequestTrace(f"{settings.trace_path}.{os.getpid()}",
                                      settings.trace_requests)
        #: Traced records whose descriptors are in `_batch`, not yet sent.
        self._tracing: list[dict[str, int]] = []
        #: The gRPC connections this front's inference calls came on: peer → `tick` (the
        #: STATE frames so far) when last seen; the front's load, as the steering counts it.
        self.peers: dict[str, int] = {}
        self.tick = 0
        #: This front's socket in the gRPC port's group, to attach the steering's programs to
        #: (serve/steer.py); None: not steered.
        self.steer_socket: socket.socket | None = None

    # -- what the handlers read -------------------------------------------------------------------

    def model(self, name: str, version: str | None = None) -> ModelInfo:
        """The model called `name` (and `version`), or a 400 naming what exists."""
        return find_model(self.models, name, version)

    def live(self) -> bool:
        """The front answers (and its runtime is there)."""
        return not self.runtime_gone.is_set()

    def model_ready(self, name: str) -> bool:
        """As the runtime last said: a live worker serves it and the server is not closing."""
        if self._state["closing"] or self.runtime_gone.is_set():
            return False
        return bool(self._state["models"].get(name, (False, ""))[0])

    def not_ready_reason(self, name: str) -> str:
        """Why model `name` is not ready ("" when it is)."""
        if self._state["closing"]:
            return "the server is shutting down"
        if self.runtime_gone.is_set():
            return "the runtime process is gone"
        return str(self._state["models"].get(name, (False, "no state from the runtime yet"))[1])

    def ready(self) -> bool:
        """Every model is ready."""
        return all(self.model_ready(m) for m in self.models)

    def server_metadata(self) -> dict[str, Any]:
        """The runtime's server metadata, with this front's shared-memory extensions."""
        meta = dict(self._server_metadata)
        meta["extensions"] = [*meta["extensions"], *self.shared_memory.extensions()]
        return meta

    # -- requests ----------------------------------------------------------------------------------

    async def infer(self, info: ModelInfo, inputs: np.ndarray | Mapping[str, np.ndarray],
                    ) -> list[np.ndarray]:
        """Serve one request through the runtime process; outputs, a row per item, in order.

        A model of several inputs takes every input by name, checked here as in the server
        process (`ModelInfo.items`: a bad one is a 400 naming it); its outputs come back at
        the request's own sequence length.
        """
        received_ns = time.perf_counter_ns()
        slab = self._slabs[info.name]
        length: int | None = None
        if isinstance(inputs, Mapping):
            _, length = info.items(inputs)
        if self._state["closing"] or self.runtime_gone.is_set():
            self._refuse(slab.index)
            raise ProtocolError(503, "the server is shutting down and takes no new requests",
                                retry_after_s=1.0)
        if isinstance(inputs, Mapping):
            code = 0
            n = len(inputs[info.inputs[0].name])
        else:
            code = 1 if inputs.dtype == np.float16 else 0
            n = len(inputs)
        start = slab.allocator.take(n)
        if start is None:
            self._refuse(slab.index)
            raise ProtocolError(503, f"this front holds its most items of model {info.name!r} "
                                     f"({slab.allocator.slots}) unanswered: retry later",
                                retry_after_s=1.0)
        # The one copy of the rows on their way to the runtime: into the slab it maps (a
        # model of several inputs: each input as the model declares it, ids as int64).
        if isinstance(inputs, Mapping):
            for t, view in zip(info.inputs, slab.layout.several_inputs(
                    slab.segment.map, start, n, length), strict=True):
                view[...] = inputs[t.name]
        else:
            slab.layout.inputs(slab.segment.map, start, n, DTYPE_CODES[code])[...] = inputs
        rid = next(self._ids)
        future: asyncio.Future[list[np.ndarray]] = asyncio.get_running_loop().create_future()
        waiting = self._pending[rid] = _Waiting(future, slab, start, n, length)
        self._batch += REQUEST.pack(rid, slab.index, code, start, n, length or 0, 1)
        self._schedule()
        if self.trace is None or not self.trace.wants(rid):
            return await future
        record = waiting.trace = {"front": os.getpid(), "id": rid, "front_received": received_ns}
        self._tracing.append(record)
        outputs = await future
        record["front_resumed"] = time.perf_counter_ns()
        self.trace.add(record)
        return outputs

    def _refuse(self, index: int) -> None:
        """Count a request this front refused itself: the runtime's statistics include it."""
        self._refusals[index] = self._refusals.get(index, 0) + 1
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._send_batch)

    async def _publish(self, op: dict[str, Any]) -> None:
        """Tell the runtime process (and so every front) of a region change; wait until told."""
        if self.link is None or self.runtime_gone.is_set():
            raise ProtocolError(503, "the runtime process is gone")
        oid = next(self._ids)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._acks[oid] = future
        self.link.send(Kind.REGIONS, json.dumps({"id": oid, **op}).encode())
        await future

    def _send_batch(self) -> None:
        self._scheduled = False
        batch, self._batch = self._batch, bytearray()
        if self.link is not None and self._refusals:
            self.link.send(Kind.REFUSED, b"".join(REFUSALS.pack(index, count) for index, count
                                                  in self._refusals.items()))
        self._refusals = {}
        if self._tracing:  # stamped before the write: the runtime may read it at once
            now = time.perf_counter_ns()
            for record in self._tracing:
                record["front_sent"] = now
            self._tracing = []
        if self.link is not None and batch:
            self.link.send(Kind.INFER, batch, now=True)  # this turn's requests are all in it

    def on_frame(self, kind: int, payload: bytes) -> None:
        """A frame from the runtime."""
        if kind == Kind.DONE:
            for (rid,) in _ID.iter_unpack(payload):
                self._done(rid, None)
            self._check_idle()
        elif kind == Kind.SHAPED:
            for rid, shapes in json.loads(payload):
                self._done(rid, [tuple(s) for s in shapes])
            self._check_idle()
        elif kind == Kind.ERROR:
            for rid, status, message, retry_after_s in json.loads(payload):
                waiting = self._pending.pop(rid, None)
                if waiting is None:
                    continue
                waiting.slab.allocator.give(waiting.start, waiting.items)
                if not waiting.future.done():
                    waiting.future.set_exception(ProtocolError(status, message, retry_after_s))
            self._check_idle()
        elif kind == Kind.ACK:
            ack = json.loads(payload)
            future = self._acks.pop(ack["id"], None)
            if future is not None and not future.done():
                if ack["error"]:
                    future.set_exception(ProtocolError(*ack["error"]))
                else:
                    future.set_result(None)
        elif kind == Kind.STATE:
            state = json.loads(payload)
            self._state = state
            self.shared_memory.apply_table(state.get("regions", {}))
            for name, (_, _, stats) in state["models"].items():
                if name in self.models:
                    self.models[name].remote_statistics = stats
            self.tick += 1
            recent = self.tick - PEER_TICKS
            for peer in [p for p, t in self.peers.items() if t < recent]:
                del self.peers[peer]
            self._report_peers()
        elif kind == Kind.STEER:
            self._steer(json.loads(payload))

    def saw_peer(self, peer: str) -> None:
        """An inference call came on connection `peer`; a new one is reported at once."""
        known = peer in self.peers
        self.peers[peer] = self.tick
        if not known:
            self._report_peers()

    def _report_peers(self) -> None:
        if self.link is not None and self.steer_socket is not None:  # only a steered front's
            self.link.send(Kind.PEERS, json.dumps({"connections": len(self.peers)}).encode())

    def _steer(self, table: list[list[float]]) -> None:
        """Attach the steering table's program to the gRPC port's group (serve/steer.py)."""
        if self.steer_socket is None or not table:
            return
        try:
            attach(self.steer_socket, program([int(i) for i, _ in table],
                                              [w for _, w in table]))
        except OSError as exc:  # a kernel without it: the hash alone, said once
            print(f"infermux front {os.getpid()}: new gRPC connections are spread by the "
                  f"kernel's hash only: SO_ATTACH_REUSEPORT_CBPF failed ({exc})",
                  file=sys.stderr)
            self.steer_socket = None

    def _done(self, rid: int, shapes: list[tuple[int, ...]] | None) -> None:
        """Request `rid` was answered: its outputs (of `shapes`) are in its slots."""
        waiting = self._pending.pop(rid, None)
        if waiting is None:
            return
        if waiting.trace is not None:
            waiting.trace["front_got"] = time.perf_counter_ns()
        s = waiting.slab
        outputs = [y.copy() for y in s.layout.outputs(s.segment.map, waiting.start,
                                                       waiting.items, shapes)]
        s.allocator.give(waiting.start, waiting.items)
        if not waiting.future.done():
            waiting.future.set_result(outputs)

    def on_lost(self) -> None:
        """The runtime process closed the link: answer what waits, serve no more."""
        self.runtime_gone.set()
        for rid in list(self._pending):
            waiting = self._pending.pop(rid)
            if not waiting.future.done():
                waiting.future.set_exception(ProtocolError(503, "the runtime process is gone"))
        for future in self._acks.values():
            if not future.done():
                future.set_exception(ProtocolError(503, "the runtime process is gone"))
        self._acks.clear()
        self._check_idle()

    def begin_close(self) -> None:
        """Take no new requests (503); those sent to the runtime are still answered."""
        self._state = {**self._state, "closing": True}

    def _check_idle(self) -> None:
        if not self._pending and self._idle is not None:
            self._idle.set()

    async def drain(self, timeout_s: float) -> int:
        """Wait until every request sent to the runtime is answered; those left."""
        if self._pending:
            self._idle = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout_s)
        return len(self._pending)

    def close(self) -> None:
        """Unmap the slabs and the clients' regions; write this front's trace lines."""
        if self.trace is not None:
            self.trace.close()
        for slab in self._slabs.values():
            slab.segment.close()
        self.shared_memory.close()
