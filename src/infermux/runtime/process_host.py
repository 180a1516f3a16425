"""The process host: a CPU worker's runners in a pinned child process, driven over two pipes.

`ProcessHost` starts the child (`runtime._child`), hands it what to build (`RunnerSpec`), and
relays batches to it: sample indices, or a served batch's own rows (`ServedRows`) through shared
memory; `ProxyRunner` stands in for each of the child's runners in this process, so the worker
loops (`runtime.worker`) drive a process-hosted runner like any other. Why CPU workers are
processes by default, and how the relay keeps the child busy: `runtime.worker`'s docstring.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from infermux.engines.base import BatchTiming, Runner
from infermux.errors import DeviceOutOfMemoryError, RunError, UsageError
from infermux.runtime.zygote import ForkedChild, spawn_child

__all__ = [
    "BatchRaisedError",
    "ProcessHost",
    "ProxyRunner",
    "RunnerSpec",
    "ServedRows",
    "WorkerDiedError",
    "host_of",
]


class BatchRaisedError(RunError):
    """A worker's process raised on one batch and is still running (it answers the others)."""


class WorkerDiedError(RunError):
    """A worker's process ended (killed by a signal, crashed, exited).

    Nothing it was given is known to be wrong, so what it held may wait for its restart.
    """


@dataclass(frozen=True)
class RunnerSpec:
    """What a child process needs to build one model's runners (everything picklable)."""

    model: str
    ref: str
    weights: str | None
    input_shape: tuple[int, ...] | None
    engine: str
    unit: str
    buckets: tuple[int, ...]
    options: dict[str, Any]
    data: str
    instance: int
    pool_count: int
    seed: int
    #: A model of several inputs: the sequence lengths compiled and the queries' lengths.
    seq_buckets: tuple[int, ...] | None = None
    lengths: int | str | None = None


@dataclass(frozen=True)
class ServedRows:
    """A served batch's own input rows, sent to the child instead of sample indices."""

    rows: Any


class ProxyRunner(Runner):
    """Stands in, in this process, for a runner that lives in a `ProcessHost`'s child."""

    def __init__(self, host: ProcessHost, model: str, bucket: int, info: dict[str, Any]) -> None:
        self._host = host
        self._model = model
        self.batch = bucket
        self.engine = info["engine"]
        self.unit = info["unit"]
        self.input_shape = tuple(info["input_shape"])
        self.options = info["options"]
        self.build_s = info["build_s"]
        #: The child's runner takes several inputs: served rows go as each item's inputs.
        self.io = bool(info.get("io"))
        self._indices: list[int] = []
        self._rows: Any = None
        self._outputs: list[np.ndarray] = []
        #: `launch()` returns once the batch is in the child's pipe, and the worker loop keeps
        #: a second one there while the first runs (`Worker._loop_relayed`).
        self.asynchronous = host.depth > 1

    def pool_layout(self) -> tuple[str, ...]:
        """One layout of its own: the samples live in the child."""
        return ("in-child",)

    def prepare_pool(self, samples: np.ndarray) -> Any:
        """Nothing here: the child prepared its own pool."""
        return None  # the child holds its own copy of the sample library

    def gather_input(self, pool: Any, indices: Sequence[int]) -> None:
        """Keep the batch's sample indices (or its served rows) for `launch` to send."""
        if isinstance(pool, ServedRows):
            self._rows = pool.rows
            return
        self._rows = None
        self._indices = list(indices)

    def set_input(self, batch: np.ndarray) -> None:
        """Refused: the child gathers its own inputs."""
        raise RunError("a process-hosted runner takes sample indices (gather_input), not arrays")

    def launch(self) -> None:
        """Send the batch to the child (returns once it is in the pipe)."""
        if self._rows is not None:
            self._host.send_rows(self._model, self.batch, self._rows)
        else:
            self._host.send(self._model, self.batch, self._indices)

    def collect(self) -> BatchTiming:
        """The child's answer to the oldest batch sent: its timing (and outputs)."""
        timing, outputs = self._host.receive(keep_alive=True)
        self._outputs = outputs or []
        return timing

    def run(self) -> BatchTiming:
        """Send one batch and wait for its answer."""
        self.launch()
        return self.collect()

    def outputs(self) -> list[np.ndarray]:
        """The outputs of the last batch collected (served rows only)."""
        return self._outputs


class ProcessHost:
    """A child process pinned to `cores` that builds and runs one worker's runners.

    The child talks over two pipes. It is forked from a template process that has imported
    torch and the engines already (`runtime.zygote`), else a fresh interpreter (`python -m
    infermux.runtime._child`); not a multiprocessing child: spawning through multiprocessing
    re-imports the caller's main script, which breaks scripts and notebooks without a main
    guard.

    Batches go in with `send`/`send_rows` and their answers come back, in the order sent, from
    `receive`; up to `depth` may be in the child at once. With 2 the worker sends the next batch
    while the child runs one, so the child finds it in its pipe instead of idling for the
    relay (the answer crossing the pipe, the worker thread waking and taking the next batch).
    """

    def __init__(self, name: str, cores: Sequence[int], specs: Sequence[RunnerSpec], *,
                 call_timeout_s: float = 600.0, depth: int = 2) -> None:
        if depth not in (1, 2):
            raise UsageError(f"worker {name}: {depth} batches in flight per process; use 1 or 2")
        self.name = name
        self.cores = tuple(cores)
        self.specs = list(specs)
        #: The longest one batch may take in the child before it is taken for hung and stopped.
        self.call_timeout_s = call_timeout_s
        #: Batches the child may hold at once (the one it runs and the next, waiting).
        self.depth = depth
        self.info: dict[str, dict[int, dict[str, Any]]] = {}
        self._proc: subprocess.Popen[bytes] | ForkedChild | None = None
        self._conn_in: Connection | None = None
        self._conn_out: Connection | None = None
        #: Per model and slot, the shared memory a served batch's rows go through (`send_rows`):
        #: one slot per batch in flight, so rows of the next never overwrite those in use.
        self._shm: dict[tuple[str, int], Any] = {}
        self._sent = 0
        self._in_flight = 0
        #: The child's account of its batches: answered, found waiting in the pipe when the
        #: previous one ended, and its idle time waiting for the others (the relay's cost).
        self.relay_stats: dict[str, int] = {"batches": 0, "waiting": 0, "idle_ns": 0}

    def start(self) -> None:
        """Start the child; it loads the models and builds runners while others do the same."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        paths = [p for p in sys.path if p]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        try:
            self._proc = spawn_child(to_child_r, from_child_w, env)
        except BaseException:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            raise
        os.close(to_child_r)
        os.close(from_child_w)
        self._conn_out = Connection(to_child_w, readable=False)
        self._conn_in = Connection(from_child_r, writable=False)
        self._conn_out.send((self.cores, self.specs))

    def _recv(self, timeout_s: float | None = None) -> Any:
        if self._conn_in is None:
            raise RunError(f"worker {self.name}: its process was stopped")
        if timeout_s is not None and not self._conn_in.poll(timeout_s):
            raise TimeoutError
        return self._conn_in.recv()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Wait for the child's runners; a build failure is raised here with its message."""
        try:
            msg = self._recv(timeout_s)
        except TimeoutError:
            self.close()
            raise RunError(f"worker {self.name}: its process built nothing in {timeout_s:g}s") from None
        except (EOFError, OSError):
            self.close()
            raise RunError(f"worker {self.name}: its process exited while building") from None
        if msg[0] == "error":
            self.close()
            _raise_child_error(self.name, msg)
        self.info = msg[1]

    def runners(self) -> dict[str, dict[int, Runner]]:
        """Proxy runners, per model and bucket."""
        return {m: {b: ProxyRunner(self, m, b, info) for b, info in per.items()}
                for m, per in self.info.items()}

    @property
    def in_flight(self) -> int:
        """Batches sent whose answers have not been received yet."""
        return self._in_flight

    def call(self, model: str, bucket: int, indices: list[int]) -> BatchTiming:
        """Run one batch in the child; its failures come back as RunError/DeviceOutOfMemoryError.

        A child that fails a batch, or answers none within `call_timeout_s`, is stopped: the
        worker is out of service either way.
        """
        self._idle("call")
        self.send(model, bucket, indices)
        return self.receive()[0]

    def call_rows(self, model: str, bucket: int,
                  rows: np.ndarray) -> tuple[BatchTiming, list[np.ndarray]]:
        """Run one batch of given input rows in the child; its timing and outputs (a row each)."""
        self._idle("call_rows")
        self.send_rows(model, bucket, rows)
        timing, outputs = self.receive()
        return timing, outputs or []

    def _idle(self, what: str) -> None:
        if self._in_flight:
            raise RunError(f"worker {self.name}: {what}() while {self._in_flight} batches are in "
                           "its process; receive() their answers first")

    def send(self, model: str, bucket: int, indices: Sequence[int]) -> None:
        """Queue one batch of sample indices in the child; its answer comes from `receive()`."""
        self._send(("run", model, bucket, list(indices)))

    def send_rows(self, model: str, bucket: int, rows: np.ndarray | Sequence[np.ndarray]) -> None:
        """Queue one batch of given input rows in the child (outputs come with its answer).

        The rows go through shared memory, only its name and the shape through the pipe: a
        ResNet-sized batch of 4 (2.4 MB) took 6.3 ms to cross the pipe and back on the 2-core
        dev machine, about half of the batch's compute. Each batch in flight has its own block.
        """
        if self.info.get(model, {}).get(bucket, {}).get("io"):  # every input of each item
            self.send_io_rows(model, bucket, rows)
            return
        first = np.asarray(rows[0])
        shape = (len(rows), *first.shape)
        shm = self._block(model, int(np.prod(shape)) * 4)
        block = np.ndarray(shape, np.float32, buffer=shm.buf)
        if isinstance(rows, np.ndarray):
            block[...] = rows
        else:
            for i, row in enumerate(rows):  # straight into the block: no stacked copy first
                block[i] = row
        del block
        self._send(("shm", model, bucket, (shm.name, shape)))

    def send_io_rows(self, model: str, bucket: int, rows: Any) -> None:
        """Queue one served batch of a model of several inputs: every input of each item.

        Items of one shape per input (a fixed length: the usual case) are stacked per input
        straight into the batch's shared memory block, and only the block's name and each
        input's dtype, shape and offset cross the pipe: one copy per input, in C, and the child
        pads them as they are (`StackedRows`). Items of differing lengths are pickled as they
        are into the block instead (a Python loop over every array). Through the pipe itself,
        a batch of 32 BERT items (98 KB) filled it while the child was writing the previous
        batch's outputs into the other pipe: each waited for the other to read, for good.
        """
        first = [np.asarray(a) for a in rows[0]]
        sizes = [len(rows) * a.nbytes for a in first]
        # Twice the size: the next batches' lengths vary, and each new block is a new mapping
        # in the child.
        shm = self._block(model, sum(sizes), room=2)
        specs: list[tuple[str, tuple[int, ...], int]] = []
        offset = 0
        try:
            for j, (a, size) in enumerate(zip(first, sizes, strict=True)):
                shape = (len(rows), *a.shape)
                out = np.ndarray(shape, a.dtype, buffer=shm.buf, offset=offset)
                np.stack([row[j] for row in rows], out=out)
                del out
                specs.append((a.dtype.str, shape, offset))
                offset += size
        except (ValueError, TypeError):  # items of differing shapes: pickled as they are
            specs = []
        if specs:
            self._send(("arrays", model, bucket, (shm.name, specs)))
            return
        payload = pickle.dumps([tuple(np.asarray(a) for a in row) for row in rows],
                               protocol=pickle.HIGHEST_PROTOCOL)
        shm = self._block(model, len(payload), room=2)
        block = np.ndarray((len(payload),), np.uint8, buffer=shm.buf)
        block[...] = np.frombuffer(payload, np.uint8)
        del block
        self._send(("rows", model, bucket, (shm.name, len(payload))))

    def _block(self, model: str, nbytes: int, room: int = 1) -> Any:
        """The shared memory block of the next batch in flight, holding at least `nbytes`.

        Each batch in flight has its own (`depth` per model); one too small is replaced by one
        of `room` × `nbytes`.
        """
        from multiprocessing.shared_memory import SharedMemory

        key = (model, self._sent % self.depth)
        shm = self._shm.get(key)
        if shm is None or shm.size < nbytes:
            if shm is not None:
                _release(shm)
            shm = self._shm[key] = SharedMemory(create=True, size=max(1, room * nbytes))
        return shm

    def _send(self, request: tuple[Any, ...]) -> None:
        if self._conn_out is None:
            raise RunError(f"worker {self.name}: its process was stopped")
        if self._in_flight >= self.depth:
            raise RunError(f"worker {self.name}: {self._in_flight} batches are in its process "
                           f"already, the most it holds")
        try:
            self._conn_out.send(request)
        except OSError:
            raise WorkerDiedError(f"worker {self.name}: {self.death()}") from None
        self._sent += 1
        self._in_flight += 1

    def answer_ready(self, timeout_s: float = 0.0) -> bool:
        """Whether the oldest batch's answer (or the child's end) arrives within `timeout_s`."""
        if self._conn_in is None or not self._in_flight:
            return False
        try:
            return self._conn_in.poll(timeout_s)
        except (EOFError, OSError):
            return True  # receive() reports it

    def receive(self, *, keep_alive: bool = False) -> tuple[BatchTiming, list[np.ndarray] | None]:
        """The oldest batch's timing and outputs (rows sent with `send_rows`), in send order.

        A child that fails a batch, or answers none within `call_timeout_s`, is stopped: the
        worker is out of service either way. A child that died raises WorkerDiedError. With
        `keep_alive`, a child whose engine raised on the batch (and that is still running)
        is kept, and BatchRaisedError says so: the batch's input may have been at fault.
        """
        if not self._in_flight:
            raise RunError(f"worker {self.name}: no batch is in its process to answer")
        try:
            msg = self._recv(self.call_timeout_s)
        except TimeoutError:
            self.close(timeout_s=1.0)
            raise RunError(
                f"worker {self.name}: its process answered no batch in {self.call_timeout_s:g}s "
                "and was stopped as hung; if batches this slow are expected, use smaller batches"
            ) from None
        except (EOFError, OSError):
            raise WorkerDiedError(f"worker {self.name}: {self.death()}") from None
        self._in_flight -= 1
        if msg[0] == "error":
            if keep_alive and not msg[1]:  # the engine raised; the child runs on
                raise BatchRaisedError(f"worker {self.name}: {msg[2]}")
            # A batch still in the child would run first: its worker is out of service anyway.
            self.close(timeout_s=1.0 if self._in_flight else 10.0)
            _raise_child_error(self.name, msg)
        _, times, outputs, (waiting, idle_ns) = msg
        stats = self.relay_stats
        stats["batches"] += 1
        stats["waiting"] += int(waiting)
        stats["idle_ns"] += int(idle_ns)
        return BatchTiming(*times), outputs

    @property
    def pid(self) -> int | None:
        """The child's process id (None before `start`)."""
        return self._proc.pid if self._proc is not None else None

    def exited(self) -> int | None:
        """The child's exit code once it has ended (negative: the signal), else None."""
        return self._proc.poll() if self._proc is not None else None

    def death(self) -> str:
        """How the child ended, in words (its exit code, or the signal that killed it)."""
        code = None
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._proc.wait(1.0)
        if code is not None and code < 0:
            import signal

            with contextlib.suppress(ValueError):
                return f"its process died (killed by {signal.Signals(-code).name})"
        return f"its process died (exit code {code})"

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the child to exit (after the batches it holds); kill it if it does not."""
        if self._conn_out is not None:
            with contextlib.suppress(Exception):
                self._conn_out.send(("close",))
        if self._proc is not None:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        for conn in (self._conn_in, self._conn_out):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        self._conn_in = self._conn_out = None
        self._in_flight = 0
        for shm in self._shm.values():
            _release(shm)
        self._shm.clear()


def _release(shm: Any) -> None:
    with contextlib.suppress(Exception):
        shm.close()
    with contextlib.suppress(Exception):
        shm.unlink()


def _raise_child_error(name: str, msg: tuple) -> None:
    _, oom, text = msg
    if oom:
        raise DeviceOutOfMemoryError(f"worker {name}: {text}")
    raise RunError(f"worker {name}: {text}")


def host_of(runners: dict[str, dict[int, Runner]]) -> ProcessHost | None:
    """The process that hosts every one of `runners` (proxies of one `ProcessHost`), else None."""
    hosts = {id(r._host): r._host for rs in runners.values() for r in rs.values()
             if isinstance(r, ProxyRunner)}
    every = all(isinstance(r, ProxyRunner) for rs in runners.values() for r in rs.values())
    return next(iter(hosts.values())) if every and len(hosts) == 1 else None
