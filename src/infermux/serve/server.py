"""`infermux serve`: a plan's runtime behind the KServe v2 HTTP and gRPC fronts and `/metrics`.

One asyncio event loop (the main thread) runs uvicorn (HTTP, ASGI) and grpcio's asyncio server
side by side; the runtime's workers are threads (GPU units) and pinned processes (CPU units)
of their own, fed by the dispatcher; Prometheus is scraped from its own small HTTP thread.

Shutdown (SIGTERM, Ctrl-C or `stop()`): the fronts stop accepting, requests already admitted
are answered (new ones meanwhile get 503), then the runtime finishes what is queued and the
workers exit; the run is stored with its totals. A second signal stops at once and answers
what is left with an error; the run is then stored `interrupted` with the requests dropped.

Ready (`/v2/health/ready`, gRPC ServerReady) means every front asked for accepts connections
and every model has answered a request: the fronts are opened metrics first, HTTP last, each
checked by connecting to it, before the server says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from infermux.errors import UsageError
from infermux.runtime.plan import Plan
from infermux.serve import loops
from infermux.serve.loops import loop_factory
from infermux.store import Store

if TYPE_CHECKING:
    from infermux.cluster.runtime import ServedNodeSummary
    from infermux.serve.core import ServedModelSummary

__all__ = ["SWITCH_INTERVAL_S", "InferenceServer", "ServeSettings", "ServeSummary", "drain_fronts",
           "serve_plan"]

#: The longest queue delay `--triton-queue-delay` takes (ms): past it, each request waits
#: longer than most plans' batches run.
MAX_TRITON_QUEUE_DELAY_MS = 100.0

#: The interpreter's switch interval while a server runs (see `serve_plan`).
SWITCH_INTERVAL_S = 0.0005

#: Samples per model the runtime keeps for its own warm-up (a server's data comes in requests).
_SERVE_SAMPLE_POOL = 4


#: The keys of the front processes' part of a summary (`serve.fronts.FrontHub.summary()`).
_FRONT_KEYS = ("fronts", "front_restarts", "front_pids", "front_slab_items")


@dataclass(frozen=True, slots=True)
class ServeSummary:
    """What a server did over its life: the stored run's summary and `--json`'s last line.

    `to_dict()` is that JSON (absent parts leave their keys out), `from_dict()` reads it back.
    """

    models: dict[str, ServedModelSummary]
    #: The ports it listened on (`http`, `grpc`, `metrics`).
    ports: dict[str, int]
    served_s: float
    error: str | None
    run_id: int | None
    status: str  # complete | interrupted | failed
    #: Requests admitted but never answered (dropped at shutdown).
    requests_dropped: int
    #: Per worker: restarts, failed restarts and their errors (`runtime.Supervisor.summary()`).
    restarts: dict[str, Any]
    #: With front processes: their count, restarts, process ids and slab sizes.
    fronts: dict[str, Any] | None = None
    #: With request tracing: the trace file and its per-stage gaps (`serve.trace.summarize`).
    trace: dict[str, Any] | None = None
    #: Served by a cluster: each node's status and counts (`ClusterRuntime.nodes()`).
    nodes: list[ServedNodeSummary] | None = None
    #: The runtime process's garbage-collector pauses over the server's life
    #: (`runtime.gcpause`).
    gc: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The stored and printed form."""
        data: dict[str, Any] = {
            "models": {n: m.to_dict() for n, m in self.models.items()}, "ports": self.ports,
            "served_s": self.served_s, "error": self.error, "run_id": self.run_id,
            "status": self.status, "requests_dropped": self.requests_dropped,
            "restarts": self.restarts}
        if self.fronts is not None:
            data.update(self.fronts)
        if self.trace is not None:
            data["trace"] = self.trace
        if self.nodes is not None:
            data["nodes"] = [n.to_dict() for n in self.nodes]
        if self.gc is not None:
            data["gc"] = self.gc
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServeSummary:
        """A stored summary (a `serve` run's) as the type; other keys (`event`) are not its."""
        from infermux.serve.core import ServedModelSummary

        nodes = None
        if data.get("nodes") is not None:
            from infermux.cluster.runtime import ServedNodeSummary

            nodes = [ServedNodeSummary.from_dict(n) for n in data["nodes"]]
        fronts = {k: data[k] for k in _FRONT_KEYS if k in data}
        return cls({n: ServedModelSummary.from_dict(m) for n, m in
                    (data.get("models") or {}).items()},
                   dict(data.get("ports") or {}), float(data.get("served_s") or 0.0),
                   data.get("error"), data.get("run_id"), str(data.get("status") or ""),
                   int(data.get("requests_dropped") or 0), dict(data.get("restarts") or {}),
                   fronts or None, data.get("trace"), nodes, data.get("gc"))


@dataclass(frozen=True)
class ServeSettings:
    """Where the server listens and how it admits requests; validated when built."""

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    #: Items a model may hold admitted and unanswered (None: 4× what its workers hold at once,
    #: at least 64); more get 503 with Retry-After.
    max_queue_items: int | None = None
    api_key: str | None = None
    #: How long a shutdown waits for admitted requests before answering them with an error.
    drain_timeout_s: float = 30.0
    #: Seconds between telemetry samples for the hardware metrics (0: no sampler).
    telemetry_interval_s: float = 1.0
    #: Times each failed worker may be restarted within `restart_window_s` (0: never); past
    #: that it waits, not ready, until the oldest restart leaves the window.
    max_restarts: int = 3
    #: The window the restart budget counts over.
    restart_window_s: float = 600.0
    #: Wait out the plan's `max_queue_delay_ms` for a fuller batch even when every worker of
    #: the model is idle (Triton's rule); by default an idle model's worker takes what is
    #: queued at once (`Dispatcher.take_when_idle`; docs/benchmarks.md, serving latency).
    wait_when_idle: bool = False
    #: Front processes serving HTTP and gRPC on shared ports (serve/fronts.py); 0 or 1: the
    #: fronts run in the server process; None: `fronts.default_fronts` of the usable cores.
    fronts: int | None = None
    #: Who parses HTTP and gRPC: "own" (infermux's fronts, `fronts` processes) or "triton"
    #: (Triton's C++ server, `fronts` instances of each model: serve/triton_front.py).
    front: str = "own"
    #: A Triton build for `front="triton"` (None: serve.triton_front.find_triton's search).
    triton_home: str | None = None
    #: Folders (os.pathsep-separated) put first on the Triton model instances' import path,
    #: e.g. a numpy 1 install: the stubs are built against numpy 1 (serve/triton_front.py).
    triton_python_path: str | None = None
    #: The Triton backend of the plan's models (`front="triton"`): auto (infermux's native C
    #: backend wherever every model fits it and a C compiler builds it, else the Python
    #: backend's stubs), native or python (serve/triton_front.py).
    triton_backend: str = "auto"
    #: How long Triton's batcher holds a request for others to join its batch (ms); None: the
    #: backend's (`triton_front.QUEUE_DELAY_MS`: 0.3 for native, 0 for python).
    triton_queue_delay_ms: float | None = None
    #: Trace every Nth request's stages (serve/trace.py; 1: all, 0: off) into `trace_path`
    #: (the runtime's lines) and `trace_path.<pid>` (each front process's).
    trace_requests: int = 0
    trace_path: str = "serve-trace.jsonl"
    #: The event loop of the server's processes (serve/loops.py): auto (uvloop where
    #: installed), asyncio or uvloop.
    loop: str = "auto"
    #: With front processes: a gRPC connection is closed (GOAWAY, its calls finished) after
    #: about this long, and the client's new one placed on the least loaded front
    #: (serve/steer.py); 0: never (the default: no gain was shown, docs/architecture-serve.md).
    connection_age_s: float = 0.0

    def __post_init__(self) -> None:
        loop_factory(self.loop)  # a bad or missing loop fails before anything starts
        if self.connection_age_s < 0:
            raise UsageError(f"--connection-age {self.connection_age_s}s must not be negative "
                             "(0 or off: never)")
        for flag, port in (("--http-port", self.http_port), ("--grpc-port", self.grpc_port),
                           ("--metrics-port", self.metrics_port)):
            if not 0 <= port <= 65535:
                raise UsageError(f"{flag} {port} is not a port: use 1-65535, or 0 for any free one")
        if self.max_queue_items is not None and self.max_queue_items < 1:
            raise UsageError(f"--max-queue {self.max_queue_items} must be at least 1 item")
        if self.drain_timeout_s < 0:
            raise UsageError(f"--drain-timeout {self.drain_timeout_s}s must not be negative")
        if not 0 <= self.max_restarts <= 100:
            raise UsageError(f"--max-restarts {self.max_restarts} must be 0 (never) to 100")
        if self.fronts is not None and not 0 <= self.fronts <= 64:
            raise UsageError(f"--fronts {self.fronts} must be 0 to 64 (0 or 1: in the server "
                             "process)")
        if self.front not in ("own", "triton"):
            raise UsageError(f"--front {self.front!r} is not a front: use own (infermux's "
                             "fronts) or triton (Triton's server)")
        if self.front != "triton":
            given = [option for option, value in (
                ("--triton-home", self.triton_home),
                ("--triton-python-path", self.triton_python_path),
                ("--triton-backend", None if self.triton_backend == "auto" else self.triton_backend),
                ("--triton-queue-delay", self.triton_queue_delay_ms)) if value is not None]
            if given:
                raise UsageError(f"{', '.join(given)} set Triton's front, and this server's front "
                                 f"is {self.front}: add --front triton, or leave "
                                 f"{'them' if len(given) > 1 else 'it'} out")
        if self.front == "triton":
            if self.fronts == 0:
                raise UsageError("--front triton --fronts 0: give at least 1 instance per model")
            from infermux.serve.triton_front import BACKENDS

            if self.triton_backend not in BACKENDS:
                raise UsageError(f"--triton-backend {self.triton_backend!r} is not a backend: use "
                                 "auto, native (infermux's C backend) or python")
            if self.api_key is not None and not re.fullmatch(r"[A-Za-z0-9._~+/-]+", self.api_key):
                raise UsageError("--api-key with --front triton: Triton reads the key from its "
                                 "command line, where only letters, digits and ._~+/- pass "
                                 "intact: use a key of those")
            if self.triton_queue_delay_ms is not None and not (
                    0 <= self.triton_queue_delay_ms <= MAX_TRITON_QUEUE_DELAY_MS):
                raise UsageError(f"--triton-queue-delay {self.triton_queue_delay_ms:g}ms is out "
                                 f"of range: use 0 to {MAX_TRITON_QUEUE_DELAY_MS:g}ms (e.g. 0.3ms; "
                                 "0: Triton hands on what has queued at once)")
            for folder in (self.triton_python_path or "").split(os.pathsep):
                if folder and not os.path.isdir(folder):
                    raise UsageError(f"--triton-python-path: {folder!r} is not a folder: give "
                                     "folders to import from (e.g. a numpy<2 install)")
        if self.api_key is not None and not self.api_key.strip():
            raise UsageError("--api-key is empty: give a key, or leave the option out")
        if self.trace_requests < 0:
            raise UsageError(f"--trace-requests {self.trace_requests} must be 0 (off), 1 (every "
                             "request) or N (every Nth)")
        if self.restart_window_s <= 0:
            raise UsageError(f"--restart-window {self.restart_window_s:g}s must be positive")

    def check_plan(self, plan: Plan) -> None:
        """Refuse a `max_queue_items` below a model's largest batch: such requests never fit."""
        if self.max_queue_items is None:
            return
        for entry in plan.models:
            largest = largest_batch(entry)
            if self.max_queue_items < largest:
                raise UsageError(
                    f"--max-queue {self.max_queue_items} is below model {entry.name!r}'s largest "
                    f"batch of {largest} items: its largest requests could never be admitted; "
                    f"use --max-queue {largest} or more")

    def public(self) -> dict[str, Any]:
        """The settings as stored (the API key only as whether one is set)."""
        data = asdict(self)
        data["api_key"] = self.api_key is not None
        return data


def largest_batch(entry: Any) -> int:
    """The most items a worker of model `entry` takes in one batch (replicas and stages)."""
    sizes = [r.batch for r in entry.replicas] + [st.batch for st in entry.stages or []]
    return max(sizes or [1])


class InferenceServer:
    """Builds the plan's runtime, serves it until stopped, then drains and stores the run.

    `backend(progress)`, where given, builds the runtime instead (`infermux serve --cluster`:
    a `cluster.runtime.ClusterRuntime`, whose `.plan` describes the models); `plan` may then be
    None, and `config` is stored with the run beside it.
    """

    def __init__(self, plan: Plan | None, settings: ServeSettings | None = None, *,
                 store: Store | None = None, command: str = "",
                 progress: Callable[[str, float], None] | None = None,
                 backend: Callable[[Callable[[str, float], None] | None], Any] | None = None,
                 config: dict[str, Any] | None = None) -> None:
        from infermux.runtime.session import with_load

        if plan is None and backend is None:
            raise UsageError("a server needs a plan or a backend that runs one")
        self.plan = None if plan is None else with_load(
            plan, sample_pool=min(plan.load.sample_pool, _SERVE_SAMPLE_POOL))
        self.backend = backend
        self.config = config or {}
        self.settings = settings or ServeSettings()
        if self.plan is not None:
            self.settings.check_plan(self.plan)
        self.store = store
        self.command = command
        self.progress = progress
        self.run_id: int | None = None
        self.core: Any = None
        self.ports: dict[str, int] = {}
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stops = 0
        #: Requests answered with an error by a second stop signal, before they were served.
        self.dropped = 0
        #: Restarts failed workers (None with `max_restarts` 0).
        self.supervisor: Any = None
        #: Front processes (`serve.fronts.FrontHub`) when `fronts` is above 1.
        self.front_hub: Any = None
        from infermux.serve.fronts import default_fronts

        self.fronts = self.settings.fronts if self.settings.fronts is not None \
            else default_fronts(len(os.sched_getaffinity(0)))
        #: A Triton build when `front` is "triton" (found before any model is built).
        self.triton: Any = None
        if self.settings.front == "triton":
            from infermux.serve.triton_front import find_triton

            self.triton = find_triton(self.settings.triton_home)
            # At least two instances by default: with one, Triton's batcher sometimes missed
            # the instance coming free on a loaded 2-core host and waited out its 500 ms
            # default (p95 513 ms at concurrency 4; two instances: p99 25 ms).
            self.fronts = max(2, self.fronts) if self.settings.fronts is None \
                else max(1, self.fronts)

    def stop(self) -> None:
        """Begin a graceful shutdown (thread-safe); a second call stops at once."""
        loop, event = self._loop, self._stop
        if loop is None or event is None:
            return
        self._stops += 1
        if self._stops > 1 and self.core is not None:
            loop.call_soon_threadsafe(self._stop_now)
        loop.call_soon_threadsafe(event.set)

    def _stop_now(self) -> None:
        self.dropped += self.core.fail_pending("the server was stopped at once by a second stop "
                                               "signal before the request was served")

    async def serve(self, on_ready: Callable[[dict[str, Any]], None] | None = None,
                    ) -> ServeSummary:
        """Serve until `stop()`; the summary (per-model totals, ports, run id)."""
        from infermux.store import recording

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        # Request rows over bytes (gRPC, chunked HTTP) are read-only arrays; the runners only
        # read them (`TorchRunner.prepare_rows`), so torch's warning about it says nothing.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                                category=UserWarning)
        s = self.settings
        http_sock = _bind(s.host, s.http_port, "--http-port",
                          shared=self.fronts > 1 or self.triton is not None)
        config = {"plan": self.plan.to_dict() if self.plan is not None else None,
                  "model": self.plan.name if self.plan is not None else None,
                  "serve": s.public(), **self.config}
        with recording(self.store, "serve", config, self.command) as rec:
            self.run_id = rec.run_id
            return await self._serve(rec, http_sock, on_ready)

    async def _serve(self, rec: Any, http_sock: socket.socket,
                     on_ready: Callable[[dict[str, Any]], None] | None) -> ServeSummary:
        from infermux.runtime.session import start_runtime
        from infermux.runtime.supervisor import Supervisor
        from infermux.serve.core import InferenceCore
        from infermux.serve.metrics import ServeMetrics

        s = self.settings
        assert self._stop is not None
        status, error = "complete", None
        runtime = sampler = httpd = grpc_server = supervisor = None
        started = time.perf_counter()
        try:
            if self.backend is not None:
                runtime = await asyncio.to_thread(self.backend, self.progress)
            else:
                assert self.plan is not None
                runtime = local = await asyncio.to_thread(start_runtime, self.plan,
                                                          progress=self.progress)
                _keep_off_worker_cores(local.build_info.get("host_cores") or [])
                # A backend's nodes were told when they started.
                local.set_take_when_idle(not s.wait_when_idle)
                if s.max_restarts:  # a backend restarts its own workers
                    supervisor = self.supervisor = Supervisor(local, max_restarts=s.max_restarts,
                                                              window_s=s.restart_window_s)
            assert runtime is not None
            sampler = _sampler(s.telemetry_interval_s)
            metrics = ServeMetrics(runtime, sampler)
            self.core = core = InferenceCore(runtime, runtime.plan,
                                             max_queue_items=s.max_queue_items,
                                             metrics=metrics, supervisor=supervisor)
            if s.trace_requests:
                core.trace = _start_trace(s)
            _check_admission(core)
            if supervisor is not None:
                supervisor.start()
            await core.probe_outputs()
            # Metrics first, then the fronts (gRPC before HTTP in the server process), and ready
            # only once each port accepts a connection: a client that saw the HTTP front ready
            # finds the others listening.
            httpd, metrics_port = _start_metrics(metrics, s.host, s.metrics_port, s.api_key)
            if self.triton is not None:  # Triton's server is the front (serve/triton_front.py)
                from infermux.serve.triton_front import TritonHub

                hub: Any = TritonHub(core, s, self.fronts, http_sock, self.triton)
                http = grpc_server = self.front_hub = hub
                await hub.start()
                http_task, grpc_port = hub.http_task, hub.grpc_port
            elif self.fronts > 1:  # front processes serve both protocols (serve/fronts.py)
                from infermux.serve.fronts import FrontHub

                http = grpc_server = self.front_hub = FrontHub(core, s, self.fronts, http_sock)
                await self.front_hub.start()
                http_task, grpc_port = self.front_hub.http_task, self.front_hub.grpc_port
            else:
                from infermux.serve.shm import SharedMemoryRegions

                # Triton's shared-memory extensions, served by the in-process fronts.
                core.shared_memory = SharedMemoryRegions()  # type: ignore[attr-defined]
                grpc_server, grpc_port = await self._start_grpc(core)
                http, http_task = await self._start_http(core, http_sock)
            http_port = self.front_hub.http_port if self.triton is not None \
                else http_sock.getsockname()[1]
            self.ports = {"http": http_port, "grpc": grpc_port,
                          "metrics": metrics_port}
            await _accepting(s.host, self.ports)
            core.fronts_up = True
            expiry = asyncio.create_task(_expire_waiting(core, s.drain_timeout_s))
            if on_ready is not None:
                on_ready(self.ready_info(runtime))
            try:
                await self._stop.wait()
            finally:
                expiry.cancel()
            # Stop accepting; what was admitted is answered (new requests meanwhile: 503).
            if self.triton is not None:  # Triton's queue is answered before the core closes
                await self.front_hub.stop(s.drain_timeout_s)
            left = await drain_fronts(core, http, http_task, grpc_server, s.drain_timeout_s)
            if left:
                core.fail_pending("the server stopped before the request was served")
                status, error = "interrupted", f"{left} requests unanswered at shutdown"
            if self.dropped:
                status = "interrupted"
                error = "; ".join(filter(None, [error, f"{self.dropped} requests dropped by a "
                                                       "second stop signal"]))
            self.dropped += left
        except BaseException as exc:
            status = "failed"
            error = str(exc)
            raise
        finally:
            http_sock.close()
            if grpc_server is not None:
                with contextlib.suppress(Exception):
                    await grpc_server.stop(0)
            if httpd is not None:
                httpd.shutdown()
                httpd.server_close()
            if supervisor is not None:
                await asyncio.to_thread(supervisor.stop)
            if runtime is not None:
                await asyncio.to_thread(runtime.stop, drain=status == "complete")
            if sampler is not None:
                sampler.stop()
            trace = None
            if self.core is not None and self.core.trace is not None:
                from infermux.serve.trace import summarize

                # The front processes wrote their lines as they exited (drained above).
                self.core.trace.close()
                trace = {"path": s.trace_path, "every": s.trace_requests,
                         **summarize(s.trace_path)}
            summary = ServeSummary(
                self.core.summary() if self.core is not None else {}, self.ports,
                time.perf_counter() - started, error, self.run_id, status, self.dropped,
                supervisor.summary() if supervisor is not None else {},
                self.front_hub.summary() if self.front_hub is not None else None, trace,
                runtime.nodes() if runtime is not None and hasattr(runtime, "nodes") else None,
                runtime.gc_summary() if runtime is not None and hasattr(runtime, "gc_summary")
                else None)
            rec.status, rec.summary = status, summary.to_dict()
        return summary

    def ready_info(self, runtime: Any) -> dict[str, Any]:
        """What the CLI prints when the server is up."""
        host = self.settings.host
        return {
            "event": "ready", "host": host, **{f"{k}_port": v for k, v in self.ports.items()},
            "run_id": self.run_id,
            "models": [{"name": m.name, "max_batch_size": m.max_batch_size,
                        "max_queue_items": m.max_queue_items,
                        "inputs": [t.metadata() for t in m.inputs],
                        "outputs": [t.metadata() for t in m.outputs],
                        "workers": [st.name for st in runtime.workers() if st.model == m.name]}
                       for m in self.core.models.values()],
            "build_s": runtime.build_info.get("build_s"),
            **({"nodes": runtime.build_info["nodes"]} if "nodes" in runtime.build_info else {}),
            # Process-hosted workers' process ids (a restarted worker gets a new one).
            "worker_pids": runtime.worker_pids(),
            **(self.front_hub.summary() if self.front_hub is not None else {"fronts": 1}),
        }

    async def _start_http(self, core: Any, sock: socket.socket) -> tuple[Any, asyncio.Task[Any]]:
        import uvicorn

        from infermux.serve.http import HttpFront, body_protocol

        # Connections beyond what admission could take are refused (503) before their bodies
        # are read: admission bounds the items in the runtime, this bounds the bodies held.
        admitted = sum(m.max_queue_items for m in core.models.values())
        front = HttpFront(core, self.settings.api_key)
        config = uvicorn.Config(
            front, lifespan="off", log_level="warning",
            http=body_protocol(front) or "auto", access_log=False,
            timeout_graceful_shutdown=int(self.settings.drain_timeout_s) or 1,
            backlog=2048, timeout_keep_alive=30, limit_concurrency=2 * admitted + 64)
        server = _QuietUvicorn(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()
                raise UsageError("the HTTP front did not start")
            await asyncio.sleep(0.01)
        return server, task

    async def _start_grpc(self, core: Any) -> tuple[Any, int]:
        from infermux.serve.grpc_front import build_grpc_server
        from infermux.serve.http import body_limit

        s = self.settings
        try:
            server, port = build_grpc_server(core, f"{_grpc_host(s.host)}:{s.grpc_port}",
                                             api_key=s.api_key,
                                             max_message_bytes=body_limit(core, binary=True),
                                             reuse_port=(s.fronts or 0) > 1,
                                             connection_age_s=s.connection_age_s
                                             if (s.fronts or 0) > 1 else 0.0,
                                             grace_s=max(1.0, s.drain_timeout_s))
        except RuntimeError as exc:
            raise UsageError(f"--grpc-port {s.grpc_port} on {s.host} cannot be bound ({exc}): "
                             "is it in use? pass another port, or 0 for any free one") from None
        await server.start()
        return server, port


def _keep_off_worker_cores(host_cores: list[int]) -> None:
    """Run the fronts (this thread, and the threads it starts) on the cores no CPU worker has.

    The runtime pins each CPU worker to its own cores; parsing requests on those cores would
    take time from the worker that computes them. With no free core the fronts go anywhere.
    """
    if host_cores and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, host_cores)


def _start_trace(s: ServeSettings) -> Any:
    """The runtime's trace writer, the files of an earlier trace at the same path removed."""
    import glob

    from infermux.serve.trace import TRITON_SUFFIX, RequestTrace

    for old in [s.trace_path, *glob.glob(glob.escape(s.trace_path) + ".*")]:
        suffix = old[len(s.trace_path) + 1:]
        if old == s.trace_path or suffix.isdigit() or suffix == TRITON_SUFFIX:
            with contextlib.suppress(FileNotFoundError):
                os.remove(old)
    return RequestTrace(s.trace_path, s.trace_requests)


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _bind(host: str, port: int, flag: str, *, shared: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP given explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says
    # TCP, and without it every response (head, then body) waited 40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:  # front processes listen on the port; this process only holds it, unlistened
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"{flag} {port} on {host} cannot be bound ({exc.strerror}): is it in "
                         "use? pass another port, or 0 for any free one") from None
    if not shared:
        sock.listen(2048)
    sock.setblocking(False)
    return sock


def _sampler(interval_s: float) -> Any:
    if interval_s <= 0:
        return None
    from infermux.telemetry import Sampler

    try:
        return Sampler(interval_s=interval_s).start()
    except Exception:  # noqa: BLE001 - hardware metrics are optional; the server runs without
        return None


def _check_admission(core: Any) -> None:
    """Refuse an admission limit below a model's largest batch (cluster plans come here)."""
    for info in core.models.values():
        if info.max_queue_items < info.max_batch_size:
            raise UsageError(
                f"--max-queue {info.max_queue_items} is below model {info.name!r}'s largest "
                f"batch of {info.max_batch_size} items: its largest requests could never be "
                f"admitted; use --max-queue {info.max_batch_size} or more")


async def drain_fronts(core: Any, http: Any, http_task: asyncio.Task[Any], grpc_server: Any,
                       timeout_s: float) -> int:
    """Stop accepting, answer what `core` admitted within `timeout_s`; the requests left.

    New requests meanwhile get 503. `core` is the server's `InferenceCore` or a front process's
    proxy: both close, drain and count alike.
    """
    core.begin_close()
    http.should_exit = True
    await asyncio.gather(grpc_server.stop(timeout_s), core.drain(timeout_s))
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(http_task, timeout_s + 5)
    return int(await core.drain(0))


async def _accepting(host: str, ports: dict[str, int], timeout_s: float = 30.0) -> None:
    """Wait until every front accepts a TCP connection (each was bound and started)."""
    target = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    deadline = time.monotonic() + timeout_s
    for front, port in ports.items():
        while True:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(target, port), 5)
            except (OSError, asyncio.TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise UsageError(f"the {front} front on {host}:{port} accepts no connection "
                                     f"({exc}): is a firewall in the way?") from None
                await asyncio.sleep(0.02)
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            break


def _start_metrics(metrics: Any, host: str, port: int,
                   api_key: str | None = None) -> tuple[Any, int]:
    """`/metrics` on its own thread; behind the same API key as inference when one is set."""
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            """No access log."""

    app = make_wsgi_app(metrics.registry)
    if api_key is not None:
        app = _keyed(app, api_key)
    server_class = ThreadingWSGIServer
    if ":" in host:
        class Six(ThreadingWSGIServer):
            address_family = socket.AF_INET6

        server_class = Six
    try:
        httpd = make_server(host, port, app, server_class, handler_class=Quiet)
    except OSError as exc:
        raise UsageError(f"--metrics-port {port} on {host} cannot be bound ({exc.strerror}): "
                         "is it in use? pass another port, or 0 for any free one") from None
    threading.Thread(target=httpd.serve_forever, name="infermux-metrics", daemon=True).start()
    return httpd, int(httpd.server_port)


def _keyed(app: Callable[..., Any], api_key: str) -> Callable[..., Any]:
    """A WSGI app that answers 401 unless the request carries `api_key` (Bearer or X-API-Key)."""
    import hmac

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        given = environ.get("HTTP_X_API_KEY")
        auth = environ.get("HTTP_AUTHORIZATION", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        if given is None or not hmac.compare_digest(given.encode(), api_key.encode()):
            start_response("401 Unauthorized", [("Content-Type", "application/json"),
                                                ("WWW-Authenticate", "Bearer")])
            return [b'{"error":"missing or wrong API key: send `Authorization: Bearer KEY` or '
                    b'`X-API-Key: KEY`"}']
        return app(environ, start_response)

    return guarded


def _quiet_uvicorn() -> type:
    import uvicorn

    class Quiet(uvicorn.Server):
        """uvicorn without its own signal handling: the server's shutdown owns the signals."""

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    return Quiet


def _QuietUvicorn(config: Any) -> Any:  # noqa: N802 - used like a class
    return _quiet_uvicorn()(config)


async def _expire_waiting(core: Any, limit_s: float) -> None:
    """Answer 503 admitted requests that waited `limit_s` for a model with no live worker.

    The drain timeout bounds how long an admitted request may wait for a worker's restart, as
    it bounds how long one may take at shutdown (`InferenceCore.expire_waiting`).
    """
    if limit_s <= 0:
        return
    period_s = min(0.25, limit_s / 4)
    while True:
        await asyncio.sleep(period_s)
        core.expire_waiting(limit_s)


def serve_plan(plan: Plan | None, settings: ServeSettings | None = None, *,
               store: Store | None = None, command: str = "",
               on_ready: Callable[[dict[str, Any]], None] | None = None,
               progress: Callable[[str, float], None] | None = None,
               backend: Callable[[Callable[[str, float], None] | None], Any] | None = None,
               config: dict[str, Any] | None = None) -> ServeSummary:
    """Serve `plan` (or `backend`'s runtime) until SIGTERM or Ctrl-C; the summary."""
    server = InferenceServer(plan, settings, store=store, command=command, progress=progress,
                             backend=backend, config=config)

    async def main() -> ServeSummary:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stop)
        try:
            return await server.serve(on_ready)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    # The runtime process's threads (the event loop, the workers, their gather threads) take
    # turns on one interpreter lock; a thread that wants it waits up to the switch interval
    # (5 ms by default) behind one running Python. Served through 8 fronts on an H200 host,
    # 0.5 ms gave ResNet50 10,088 requests/s against 9,278 and digits-cnn 15,594 against
    # 14,066 (concurrency 256, the same host, one after the other; docs/benchmarks.md).
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, SWITCH_INTERVAL_S))
    try:
        return loops.run(main(), server.settings.loop)
    finally:
        sys.setswitchinterval(previous)
