"""`infermux serve --fronts N`: the HTTP and gRPC fronts in N processes of their own.

One asyncio loop cannot parse more than a few thousand requests a second, and in the server
process it shares its interpreter lock with the GPU workers. With `--fronts N` the server
process (the *runtime process*: dispatcher, workers, CUDA) does no protocol work: N front
processes each listen on the same HTTP and gRPC ports (SO_REUSEPORT: the kernel spreads the
connections), decode and validate requests with the same handlers (serve/http.py,
serve/grpc_front.py, talking to a `serve.proxy.RuntimeProxy`), write each request's rows into
a slab of shared memory the runtime process maps, and send a 24-byte descriptor; the runtime
process submits the rows where they lie (no copy, no pickling), writes the outputs into the
same slots and answers with the request's id. Descriptors and answers of one event-loop turn
travel in one frame.

`FrontHub` is the runtime process's side: it reserves the ports, makes each front's slabs (one
per model, sized from the model's admission limit and the memory `/dev/shm` has), starts the
fronts (`python -m infermux.serve.fronts FD`), submits their descriptors to the core, pushes
readiness and statistics to them, restarts a front that dies (with new slabs: the dead
front's requests still in the runtime finish into the old ones), and on shutdown tells every
front to drain. It presents the two objects `InferenceServer` shuts down (an HTTP server's
`should_exit`, a task that ends when the fronts have; a gRPC server's `stop(grace)`), so the
server's shutdown path is the same with or without front processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import pickle
import signal
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from infermux.errors import UsageError
from infermux.serve import loops
from infermux.serve.core import DATATYPES, BatchSink, ProtocolError
from infermux.serve.proxy import (
    DTYPE_CODES,
    REFUSALS,
    REQUEST,
    STATE_PERIOD_S,
    FrameReader,
    Kind,
    Link,
    RuntimeProxy,
    frame,
)
from infermux.serve.shm import SHM_DIR, Segment, SlabLayout
from infermux.serve.steer import Steering, listening_sockets
from infermux.units.cpu import default_fronts

__all__ = ["FrontHub", "default_fronts", "reuse_port_socket"]  # default_fronts: units.cpu's

#: How long the fronts may take to start (import, bind, listen) before the server gives up.
_START_TIMEOUT_S = 120.0
#: Share of /dev/shm's free space the fronts' slabs may take.
_SHM_SHARE = 0.5


def reuse_port_socket(host: str, port: int, *, listen: bool) -> socket.socket:
    """A TCP socket bound with SO_REUSEPORT (listening if asked), so processes share the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets whose proto says TCP.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(2048)
        sock.setblocking(False)
    return sock


def _layout(info: Any, fronts: int) -> SlabLayout:
    """Where model `info`'s requests lie in its slabs (every input of a model of several).

    A sequence dim (-1) is given room at the longest length compiled; a model with one and no
    such length cannot be sized, and is one line naming `--fronts`.
    """
    dtypes = tuple("<f4" if o.datatype in ("FP32", "FP16", "FP64") else DATATYPES[o.datatype].str
                   for o in info.outputs)
    if info.io is None:
        return SlabLayout(tuple(info.inputs[0].shape), tuple(tuple(o.shape) for o in info.outputs),
                          output_dtypes=dtypes)
    if any(-1 in t.shape for t in info.inputs) and info.max_length is None:
        raise UsageError(f"--fronts {fronts}: model {info.name!r} has a sequence dimension and no "
                         "longest length to size its shared memory by: give its plan entry "
                         "seq_buckets, or serve it with --fronts 1")
    return SlabLayout((), info.output_room,
                      tuple((tuple(t.shape), DATATYPES[t.datatype].str) for t in info.inputs),
                      info.max_length or 1, fixed_outputs=info.fixed_outputs,
                      output_dtypes=dtypes)


# -- the runtime process's side ---------------------------------------------------------------

@dataclass(eq=False)
class _Generation:
    """One front process and what it was given: its link, its slabs, its requests in flight."""

    slot: int
    segments: list[Segment]
    process: asyncio.subprocess.Process | None = None
    link: Link | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    pid: int = 0
    in_flight: int = 0
    done: bytearray = field(default_factory=bytearray)
    errors: list[list[Any]] = field(default_factory=list)
    #: Where the core delivers the answers of this front's requests.
    sink: BatchSink | None = None
    #: Requests of models of several inputs in flight: id → (model index, first slot, items).
    #: Their outputs' shapes are known when they are answered (they follow the length).
    several: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    #: Such requests answered, with their outputs' shapes, for the next SHAPED frame.
    shaped: list[list[Any]] = field(default_factory=list)
    #: (model index, dtype code) → one `SlabRow` per slot of that slab (made when first used).
    rows: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    #: model index → its slab's output region as rows (a model of one output), or None.
    outs: dict[int, Any] = field(default_factory=dict)
    started_s: float = field(default_factory=time.monotonic)
    #: Its gRPC connections with calls lately, as it last reported (`Kind.PEERS`): its load,
    #: as the steering of new connections reads it (serve/steer.py).
    load: float = 0.0


class FrontHub:
    """The runtime process's side of `--fronts N`; see the module docstring."""

    def __init__(self, core: Any, settings: Any, count: int, http_sock: socket.socket) -> None:
        self.core = core
        self.settings = settings
        self.count = count
        self.http_port = http_sock.getsockname()[1]
        self.host = settings.host
        self._grpc_reservation = reuse_port_socket(settings.host, settings.grpc_port,
                                                   listen=False)
        self.grpc_port = self._grpc_reservation.getsockname()[1]
        self.models = list(core.models.values())
        self.layouts = [_layout(m, count) for m in self.models]
        self.slots = self._slab_slots()
        self.layouts = [replace(lay, slots=n) for lay, n in zip(self.layouts, self.slots,
                                                                 strict=True)]
        self.fronts: list[_Generation] = []
        self.retired: list[_Generation] = []
        self.restarts = 0
        #: Triton shared-memory regions the clients registered, by name (every front maps them).
        self.regions: dict[str, dict[str, Any]] = {}
        self._closing = False
        #: INFER frames read in this turn of the loop, submitted together at its end.
        self._frames: list[tuple[_Generation, list[Any], dict[int, dict[str, int]]]] = []
        self._stopped = asyncio.Event()
        self._watchers: list[asyncio.Task[None]] = []
        self._pusher: asyncio.Task[None] | None = None
        self.http_task: asyncio.Task[Any] | None = None
        #: Which front's socket is at which index of the gRPC port's group (serve/steer.py);
        #: None once a front opened other than one socket there (no index is known then).
        self.steering: Steering | None = Steering() if count > 1 else None
        self._steer: list[list[float]] | None = None

    def _slab_slots(self) -> list[int]:
        """Slots per model per front: its admission limit, scaled down to fit /dev/shm.

        A front may hold up to the model's whole admission limit (connections are spread by
        hash, not by load); pages are touched only when used, but the space must exist.
        """
        wanted = [m.max_queue_items for m in self.models]
        total = self.count * sum(w * lay.slot_bytes for w, lay in zip(wanted, self.layouts,
                                                                       strict=True))
        stat = os.statvfs(SHM_DIR)
        budget = _SHM_SHARE * stat.f_bavail * stat.f_frsize
        scale = min(1.0, budget / total) if total else 1.0
        slots = [max(1, math.floor(w * scale)) for w in wanted]
        for m, s in zip(self.models, slots, strict=True):
            if s < m.max_batch_size:
                raise UsageError(
                    f"--fronts {self.count}: {SHM_DIR} has room for {s} items of model "
                    f"{m.name!r} per front, fewer than its largest batch {m.max_batch_size}: "
                    f"pass fewer --fronts, a smaller --max-queue, or enlarge {SHM_DIR}")
        return slots

    # -- starting ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every front and wait until each listens.

        The processes start together; they open the gRPC port one after another (`LISTEN`,
        then wait for the front's READY), so the order of their sockets in the port's group is
        known (serve/steer.py).
        """
        self.fronts = [await self._spawn(i, listen=False) for i in range(self.count)]

        async def in_turn() -> None:
            for gen in self.fronts:
                if gen.link is not None:
                    gen.link.send(Kind.LISTEN, b"")
                await gen.ready.wait()

        try:
            await asyncio.wait_for(in_turn(), _START_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise UsageError(f"the {self.count} front processes did not start within "
                             f"{_START_TIMEOUT_S:.0f} s") from None
        self._pusher = asyncio.create_task(self._push_state())
        self.http_task = asyncio.create_task(self._stopped.wait())

    async def _spawn(self, slot: int, *, listen: bool = True) -> _Generation:
        segments = [Segment.new(f"infermux-front{slot}-{m.name}", n * lay.slot_bytes)
                    for m, n, lay in zip(self.models, self.slots, self.layouts, strict=True)]
        gen = _Generation(slot, segments)
        gen.sink = self.core.batch_sink(functools.partial(self._answered, gen))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        loop = asyncio.get_running_loop()
        init = {"models": self.models,
                "slabs": [(s.name, n) for s, n in zip(segments, self.slots, strict=True)],
                "layouts": self.layouts, "settings": replace(self.settings, fronts=self.count),
                "slot": slot,
                "http_port": self.http_port, "grpc_port": self.grpc_port,
                "server_metadata": self.core.server_metadata()}
        ours.sendall(frame(Kind.INIT, pickle.dumps(init)))
        if listen:  # a restarted front: its socket joins the group last, whenever it is ready
            ours.sendall(frame(Kind.LISTEN, b""))
        ours.setblocking(False)
        _, gen.link = await loop.create_unix_connection(
            lambda: Link(functools.partial(self._on_frame, gen),
                         functools.partial(self._on_lost, gen)), sock=ours)
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        gen.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "infermux.serve.fronts", str(theirs.fileno()),
            pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        gen.pid = gen.process.pid
        self._watchers.append(asyncio.create_task(self._watch(gen)))
        return gen

    async def _watch(self, gen: _Generation) -> None:
        """Restart the front when its process ends, unless the server is stopping."""
        assert gen.process is not None
        await gen.process.wait()
        if self._closing:
            return
        self.restarts += 1
        uptime_s = time.monotonic() - gen.started_s
        if self.steering is not None:
            self.steering.leave(gen)
            self._resteer()
        self._retire(gen)
        # A front that dies at once again and again is not restarted in a tight loop.
        await asyncio.sleep(0.1 if uptime_s > 10 else min(5.0, 0.5 * self.restarts))
        if self._closing:
            return
        new = await self._spawn(gen.slot)
        self.fronts[gen.slot] = new

    def _retire(self, gen: _Generation) -> None:
        for s in gen.segments:
            s.unlink()  # the mapping stays until the runtime's last view of it goes
        self.retired.append(gen)
        if gen.link is not None and gen.link.transport is not None:
            gen.link.transport.close()

    # -- requests -----------------------------------------------------------------------------------

    def _on_frame(self, gen: _Generation, kind: int, payload: bytes) -> None:
        if kind == Kind.INFER:
            # A frame's requests are admitted and submitted together (one lock, one submit);
            # their outputs are written by the runtime's callback straight into their slots.
            read_ns = time.perf_counter_ns()
            trace = self.core.trace
            traces: dict[int, dict[str, int]] = {}
            requests = []
            for rid, index, code, start, n, length, clients in REQUEST.iter_unpack(payload):
                layout, segment = self.layouts[index], gen.segments[index]
                if trace is not None and trace.wants(rid):
                    traces[rid] = {"front": gen.pid, "id": rid, "frame_read": read_ns}
                if layout.several:  # one array per input, at the request's length
                    # Outputs of one shape whatever the length go straight into the
                    # request's slots; others come back as arrays, written at their shapes.
                    out = layout.outputs(segment.map, start, n) if layout.fixed_outputs else None
                    requests.append((self.models[index],
                                     layout.several_inputs(segment.map, start, n, length or None),
                                     out, rid, clients))
                    if out is None:
                        gen.several[rid] = (index, start, n)
                    continue
                # The request's rows are a slice of the slab's rows, each knowing its slot:
                # no array per request, and the runner gathers a batch by slot index.
                rows = gen.rows.get((index, code))
                if rows is None:
                    rows = gen.rows[index, code] = layout.rows(segment.map, DTYPE_CODES[code],
                                                               (id(segment), code))
                outs = gen.outs.get(index, False)
                if outs is False:
                    outs = gen.outs[index] = layout.output_rows(segment.map)
                requests.append((self.models[index], rows[start:start + n],
                                 layout.outputs(segment.map, start, n) if outs is None
                                 else [outs[start:start + n]], rid, clients))
            # Submitted at the end of this turn of the loop, with the frames of the other
            # fronts read in the same turn: one admission, one submit and one wake-up of the
            # runtime's workers for them all, not one per frame (about one request each).
            self._frames.append((gen, requests, traces))
            if len(self._frames) == 1:
                asyncio.get_running_loop().call_soon(self._submit_frames)
        elif kind == Kind.PEERS:
            gen.load = float(json.loads(payload)["connections"])
            self._resteer()
        elif kind == Kind.REFUSED:
            for index, count in REFUSALS.iter_unpack(payload):
                self.core.count_refused(self.models[index], count)
        elif kind == Kind.REGIONS:
            self._on_regions(gen, json.loads(payload))
        elif kind == Kind.READY:
            listeners = json.loads(payload).get("grpc_listeners")
            if self.steering is not None and listeners is not None:
                if listeners == 1:
                    self.steering.join(gen)
                    self._resteer()
                else:  # which socket is whose is not known: the kernel's hash alone
                    self.steering = self._steer = None
            gen.ready.set()
            self._send_state(gen, self._state())

    def _submit_frames(self) -> None:
        frames, self._frames = self._frames, []
        refusals = self.core.submit_frames([(requests, gen.sink, traces)
                                            for gen, requests, traces in frames])
        for (gen, requests, _), refused in zip(frames, refusals, strict=True):
            gen.in_flight += len(requests) - len(refused)
            if refused:
                gen.errors.extend([rid, e.status, e.message, e.retry_after_s]
                                  for rid, e in refused)
                self._reply(gen)

    def _on_regions(self, gen: _Generation, op: dict[str, Any]) -> None:
        """A front's client (un)registered a shared-memory region: every front is told."""
        error = None
        name, kind = op.get("name"), op.get("kind")
        if op.get("op") == "register":
            if name in self.regions:
                error = [400, f"shared memory region {name!r} is already registered: "
                              "unregister it first"]
            else:
                self.regions[str(name)] = {k: v for k, v in op.items() if k not in ("id", "op")}
        else:
            for n in [n for n, d in self.regions.items()
                      if d["kind"] == kind and name in (None, n)]:
                del self.regions[n]
        state = self._state()
        for front in self.fronts:
            if front.ready.is_set():
                self._send_state(front, state)
        if gen.link is not None:
            gen.link.send(Kind.ACK, json.dumps({"id": op.get("id"), "error": error}).encode())

    def _answered(self, gen: _Generation, answers: list[tuple[int, Any]]) -> None:
        """Answers of the runtime (one wake-up of this loop per runtime batch): to the front."""
        gen.in_flight -= len(answers)
        for rid, result in answers:
            several = gen.several.pop(rid, None) if gen.several else None
            if isinstance(result, ProtocolError):
                gen.errors.append([rid, result.status, result.message, result.retry_after_s])
            elif several is not None:  # into its slots, at the shapes its length gave
                index, start, n = several
                shapes = [tuple(y.shape[1:]) for y in result]
                try:
                    views = self.layouts[index].outputs(gen.segments[index].map, start, n,
                                                        shapes)
                except ValueError as exc:
                    gen.errors.append([rid, 500, str(exc), None])
                    continue
                for view, y in zip(views, result, strict=True):
                    view[...] = y
                gen.shaped.append([rid, shapes])
            else:  # the outputs are in the request's slots already
                gen.done += rid.to_bytes(8, "little")
        # Written at once: this is already one wake-up per runtime batch, and a lone request
        # would wait another loop turn for the link's own grouping.
        self._reply(gen, now=True)

    def _reply(self, gen: _Generation, *, now: bool = False) -> None:
        if gen.link is None:
            return
        if gen.shaped:
            gen.link.send(Kind.SHAPED, json.dumps(gen.shaped).encode(),
                          now=now and not gen.errors and not gen.done)
            gen.shaped = []
        if gen.done:
            gen.link.send(Kind.DONE, gen.done, now=now and not gen.errors)
            gen.done = bytearray()
        if gen.errors:
            gen.link.send(Kind.ERROR, json.dumps(gen.errors).encode(), now=now)
            gen.errors = []

    def _on_lost(self, gen: _Generation) -> None:
        gen.link = None  # its process's exit is noticed by `_watch`

    # -- readiness and statistics -------------------------------------------------------------------

    def _state(self) -> bytes:
        core = self.core
        closing = self._closing
        models = {}
        for m in self.models:
            reason = core.not_ready_reason(m.name)
            models[m.name] = (not reason and not closing, reason, m.statistics())
        return json.dumps({"closing": closing, "models": models,
                           "regions": self.regions}).encode()

    @staticmethod
    def _send_state(gen: _Generation, state: bytes) -> None:
        if gen.link is not None:
            gen.link.send(Kind.STATE, state)

    def _resteer(self) -> None:
        """A front's load or the group changed: a new table, if it differs, to one front.

        Any socket of the group attaches the group's program, so one front is told.
        """
        if self.steering is None or self._closing:
            return
        table = self.steering.table({g: g.load for g in self.steering.members})
        if table is None or table == self._steer:
            return
        self._steer = table
        for gen in self.steering.members:
            if gen.link is not None:
                gen.link.send(Kind.STEER, json.dumps(table).encode())
                return

    async def _push_state(self) -> None:
        while True:
            state = self._state()
            for gen in self.fronts:
                if gen.ready.is_set():
                    self._send_state(gen, state)
            await asyncio.sleep(STATE_PERIOD_S)

    # -- what `InferenceServer` shuts down ------------------------------------------------------

    @property
    def should_exit(self) -> bool:
        """Whether the fronts were told to drain (uvicorn's flag, for the server's shutdown)."""
        return self._closing

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value and not self._closing:
            self._closing = True
            self._drain()

    def _drain(self) -> None:
        """Tell every front to stop accepting and answer what it admitted."""
        state = self._state()
        for gen in self.fronts:
            self._send_state(gen, state)
            if gen.link is not None:
                gen.link.send(Kind.DRAIN, b"")

    async def stop(self, grace_s: float | None) -> None:
        """Drain every front (at most `grace_s`), then end those left and free the slabs."""
        self.should_exit = True
        procs = [g.process for g in self.fronts if g.process is not None]
        if grace_s:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), grace_s + 5)
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
        if self._pusher is not None:
            self._pusher.cancel()
        for task in self._watchers:
            task.cancel()
        self._stopped.set()
        if grace_s == 0:
            self.close()

    def close(self) -> None:
        """Unlink and unmap every slab; release the reserved gRPC port."""
        for gen in [*self.fronts, *self.retired]:
            for s in gen.segments:
                s.unlink()
                s.close()
        self._grpc_reservation.close()

    def summary(self) -> dict[str, Any]:
        """For the ready line and the stored run."""
        return {"fronts": self.count, "front_restarts": self.restarts,
                "front_pids": [g.pid for g in self.fronts],
                "front_slab_items": {m.name: n for m, n in zip(self.models, self.slots,
                                                                strict=True)}}


# -- the front process --------------------------------------------------------------------------

def _read_init(sock: socket.socket) -> tuple[dict[str, Any], FrameReader, list[tuple[int, bytes]]]:
    """The INIT frame; the reader and the frames read with it, for the link to go on from.

    The runtime process may send more before this process has read its INIT (a front
    restarted just as the server stops gets DRAIN at once): those frames and any partial one
    are the link's first, not dropped.
    """
    reader = FrameReader()
    while True:
        data = sock.recv(1 << 20)
        if not data:
            raise SystemExit("the runtime process closed the link before sending INIT")
        frames = reader.feed(data)
        if frames:
            kind, payload = frames[0]
            if kind != Kind.INIT:
                raise SystemExit(f"expected INIT from the runtime process, got frame {kind}")
            init: dict[str, Any] = pickle.loads(payload)  # the parent process's own frame
            return init, reader, frames[1:]


async def _front(sock: socket.socket, init: dict[str, Any], reader: FrameReader | None = None,
                 early: list[tuple[int, bytes]] | None = None) -> int:
    from infermux.serve.server import InferenceServer, drain_fronts

    settings = init["settings"]
    settings = replace(settings, http_port=init["http_port"], grpc_port=init["grpc_port"])
    proxy = RuntimeProxy(init)
    drain = asyncio.Event()
    listen = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_frame(kind: int, payload: bytes) -> None:
        if kind == Kind.DRAIN:
            drain.set()
        elif kind == Kind.LISTEN:
            listen.set()
        else:
            proxy.on_frame(kind, payload)

    def on_lost() -> None:
        proxy.on_lost()
        drain.set()

    sock.setblocking(False)
    _, link = await loop.create_unix_connection(lambda: Link(on_frame, on_lost, reader),
                                                sock=sock)
    proxy.link = link
    for kind, payload in early or ():
        on_frame(kind, payload)
    if drain.is_set():  # told to stop before listening: nothing was admitted, nothing to drain
        proxy.close()
        return 0
    loop.add_signal_handler(signal.SIGTERM, drain.set)
    server = InferenceServer(None, settings, backend=_no_backend)
    http_sock = reuse_port_socket(settings.host, settings.http_port, listen=True)
    http, http_task = await server._start_http(proxy, http_sock)
    # The gRPC port is opened when the runtime process says so: the fronts join its group in
    # a known order (serve/steer.py).
    waiting = [asyncio.ensure_future(listen.wait()), asyncio.ensure_future(drain.wait())]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    for task in waiting:
        task.cancel()
    grpc_server, _ = await server._start_grpc(proxy)
    listeners = listening_sockets(settings.grpc_port)
    proxy.steer_socket = listeners[0] if len(listeners) == 1 else None
    link.send(Kind.READY, json.dumps({"pid": os.getpid(),
                                      "grpc_listeners": len(listeners)}).encode())
    await drain.wait()
    left = await drain_fronts(proxy, http, http_task, grpc_server, settings.drain_timeout_s)
    http_sock.close()
    for sock in listeners:
        sock.close()
    proxy.close()
    return 0 if left == 0 else 1


def _no_backend(progress: Any) -> Any:
    raise RuntimeError("a front process builds no runtime")


def main(argv: list[str]) -> int:
    """A front process: `python -m infermux.serve.fronts FD` (started by `FrontHub`)."""
    # Ctrl-C reaches the whole process group; the runtime process decides when fronts stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    init, reader, early = _read_init(sock)
    return loops.run(_front(sock, init, reader, early), init["settings"].loop)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
