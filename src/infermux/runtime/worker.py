"""Workers: one per instance. Each pulls batches from the dispatcher and runs them on its unit.

Hosting, decided by measurement (docs/benchmarks.md, bench/runtime_cpu_modes.py):
- GPU workers are threads of the one process (one CUDA context). Each owns its runners: a CUDA
  stream, pinned host buffers and one captured CUDA graph per batch bucket. A GPU runner's
  `launch()` returns at once, so the worker gathers the next batch into the pinned buffer while
  the current one computes; copies of one worker overlap the compute of the others.
- CPU workers get an explicit, disjoint core set. By default each is a pinned child process
  (`ProcessHost`): threads stall on the GIL when per-batch Python work is large next to the
  kernels (2 pinned threads gave 1.08× one at batch 1, 2 processes 1.82×). The worker thread
  in this process only relays sample indices and timings through a pipe; the child holds its
  own runners and its own copy of the (seeded) sample library. `cpu_workers: thread` keeps
  them as pinned threads instead.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from infermux.engines.base import BatchTiming, Runner, is_out_of_memory
from infermux.errors import DeviceOutOfMemoryError, RunError
from infermux.runtime.dispatcher import Batch, Dispatcher, WorkerState

__all__ = ["ProcessHost", "RunnerSpec", "Worker"]


class Worker:
    """The thread that serves one worker: pull a batch, gather its samples, run, report."""

    def __init__(
        self,
        state: WorkerState,
        runners: dict[str, dict[int, Runner]],
        samples: dict[str, np.ndarray],
        dispatcher: Dispatcher,
        *,
        cores: Sequence[int] = (),
        threads: int | None = None,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self.state = state
        self.runners = runners
        self.samples = samples
        self.dispatcher = dispatcher
        self.cores = tuple(cores)
        self.threads = threads
        self.clock_ns = clock_ns
        self._pools: dict[tuple[str, tuple[str, ...]], Any] = {}
        self.thread = threading.Thread(target=self._main, name=f"infermux-{state.name}",
                                       daemon=True)

    def start(self) -> None:
        """Start serving."""
        self.thread.start()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the worker to exit."""
        self.thread.join(timeout_s)

    def _pool(self, model: str, runner: Runner) -> Any:
        key = (model, runner.pool_layout())
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = runner.prepare_pool(self.samples[model])
        return pool

    def _runner(self, batch: Batch) -> Runner:
        return self.runners[batch.model][batch.bucket]

    def _main(self) -> None:
        if self.cores:
            with contextlib.suppress(OSError):  # a core set this process may not use
                os.sched_setaffinity(0, self.cores)
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        asynchronous = any(r.asynchronous for rs in self.runners.values() for r in rs.values())
        if asynchronous:
            self._loop_pipelined()
        else:
            self._loop()

    def _loop(self) -> None:
        d, w = self.dispatcher, self.state
        while (batch := d.next_batch(w)) is not None:
            try:
                runner = self._runner(batch)
                start = self.clock_ns()
                runner.gather_input(self._pool(batch.model, runner), batch.samples)
                runner.launch()
                timing = runner.collect()
                end = self.clock_ns()
            except Exception as exc:  # noqa: BLE001 - every failure takes the worker out
                d.failed(w, [batch], _translate(exc, w))
                return
            d.finished(w, batch, start, end, timing)

    def _loop_pipelined(self) -> None:
        """Gather batch k+1 while batch k runs on the device, then collect k and launch k+1."""
        d, w = self.dispatcher, self.state
        pending: tuple[Batch, Runner, int] | None = None
        while True:
            batch = d.next_batch(w, block=pending is None)
            if batch is None and pending is None:
                return
            held = [b for b in (pending[0] if pending else None, batch) if b is not None]
            try:
                if batch is not None:
                    runner = self._runner(batch)
                    runner.gather_input(self._pool(batch.model, runner), batch.samples)
                done: tuple[Batch, int, int, BatchTiming] | None = None
                if pending is not None:
                    p_batch, p_runner, p_start = pending
                    timing = p_runner.collect()
                    done = (p_batch, p_start, self.clock_ns(), timing)
                pending = None
                if batch is not None:
                    start = self.clock_ns()
                    runner.launch()
                    pending = (batch, runner, start)
            except Exception as exc:  # noqa: BLE001 - every failure takes the worker out
                d.failed(w, held, _translate(exc, w))
                return
            if done is not None:
                d.finished(w, done[0], done[1], done[2], done[3])


def _translate(exc: BaseException, w: WorkerState) -> BaseException:
    if isinstance(exc, RunError):
        return exc
    if is_out_of_memory(exc):
        return DeviceOutOfMemoryError(f"worker {w.name} on {w.unit} ran out of device memory")
    return RunError(f"worker {w.name} on {w.unit}: {type(exc).__name__}: {exc}")


# -- CPU workers as pinned processes ---------------------------------------------------------


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


class _ProxyRunner(Runner):
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
        self._indices: list[int] = []

    def pool_layout(self) -> tuple[str, ...]:
        return ("in-child",)

    def prepare_pool(self, samples: np.ndarray) -> Any:
        return None  # the child holds its own copy of the sample library

    def gather_input(self, pool: Any, indices: Sequence[int]) -> None:
        self._indices = list(indices)

    def set_input(self, batch: np.ndarray) -> None:
        raise RunError("a process-hosted runner takes sample indices (gather_input), not arrays")

    def run(self) -> BatchTiming:
        return self._host.call(self._model, self.batch, self._indices)

    def outputs(self) -> list[np.ndarray]:
        return []


class ProcessHost:
    """A child process pinned to `cores` that builds and runs one worker's runners.

    The child is a fresh interpreter (`python -m infermux.runtime._child`) talking over two
    pipes, not a multiprocessing child: spawning through multiprocessing re-imports the
    caller's main script, which breaks scripts and notebooks without a main guard.
    """

    def __init__(self, name: str, cores: Sequence[int], specs: Sequence[RunnerSpec]) -> None:
        self.name = name
        self.cores = tuple(cores)
        self.specs = list(specs)
        self.info: dict[str, dict[int, dict[str, Any]]] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn_in: Connection | None = None
        self._conn_out: Connection | None = None

    def start(self) -> None:
        """Start the child; it loads the models and builds runners while others do the same."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        paths = [p for p in sys.path if p]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "infermux.runtime._child", str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w), env=env,
            # The parent handles Ctrl-C and ends the children itself.
            start_new_session=True,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._conn_out = Connection(to_child_w, readable=False)
        self._conn_in = Connection(from_child_r, writable=False)
        self._conn_out.send((self.cores, self.specs))

    def _recv(self, timeout_s: float | None = None) -> Any:
        assert self._conn_in is not None
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
        return {m: {b: _ProxyRunner(self, m, b, info) for b, info in per.items()}
                for m, per in self.info.items()}

    def call(self, model: str, bucket: int, indices: list[int]) -> BatchTiming:
        """Run one batch in the child; its failures come back as RunError/DeviceOutOfMemoryError."""
        try:
            assert self._conn_out is not None
            self._conn_out.send(("run", model, bucket, indices))
            msg = self._recv()
        except (EOFError, OSError):
            code = self._proc.poll() if self._proc is not None else None
            raise RunError(f"worker {self.name}: its process died (exit code {code})") from None
        if msg[0] == "error":
            _raise_child_error(self.name, msg)
        return BatchTiming(*msg[1])

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the child to exit; kill it if it does not."""
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


def _raise_child_error(name: str, msg: tuple) -> None:
    _, oom, text = msg
    if oom:
        raise DeviceOutOfMemoryError(f"worker {name}: {text}")
    raise RunError(f"worker {name}: {text}")
