"""`infermux serve`: a plan's runtime behind the KServe v2 HTTP and gRPC fronts and `/metrics`.

One asyncio event loop (the main thread) runs uvicorn (HTTP, ASGI) and grpcio's asyncio server
side by side; the runtime's workers are threads (GPU units) and pinned processes (CPU units)
of their own, fed by the dispatcher; Prometheus is scraped from its own small HTTP thread.

Shutdown (SIGTERM, Ctrl-C or `stop()`): the fronts stop accepting, requests already admitted
are answered (new ones meanwhile get 503), then the runtime finishes what is queued and the
workers exit; the run is stored with its totals. A second signal stops at once and answers
what is left with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from infermux.errors import UsageError
from infermux.runtime.plan import Plan
from infermux.store import Store

__all__ = ["InferenceServer", "ServeSettings", "serve_plan"]

#: Samples per model the runtime keeps for its own warm-up (a server's data comes in requests).
_SERVE_SAMPLE_POOL = 4


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
    #: Times each failed worker is restarted before its model is left not ready (0: never).
    max_restarts: int = 3
    #: Wait out the plan's `max_queue_delay_ms` for a fuller batch even when every worker of
    #: the model is idle (Triton's rule); by default an idle model's worker takes what is
    #: queued at once (`Dispatcher.take_when_idle`; docs/benchmarks.md, serving latency).
    wait_when_idle: bool = False

    def __post_init__(self) -> None:
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
        if self.api_key is not None and not self.api_key.strip():
            raise UsageError("--api-key is empty: give a key, or leave the option out")

    def public(self) -> dict[str, Any]:
        """The settings as stored (the API key only as whether one is set)."""
        data = asdict(self)
        data["api_key"] = self.api_key is not None
        return data


class InferenceServer:
    """Builds the plan's runtime, serves it until stopped, then drains and stores the run.

    `backend(progress)`, where given, builds the runtime instead (`infermux serve --cluster`:
    a `cluster.serve.ClusterRuntime`, whose `.plan` describes the models); `plan` may then be
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
        self.store = store
        self.command = command
        self.progress = progress
        self.run_id: int | None = None
        self.core: Any = None
        self.ports: dict[str, int] = {}
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stops = 0
        #: Restarts failed workers (None with `max_restarts` 0).
        self.supervisor: Any = None

    def stop(self) -> None:
        """Begin a graceful shutdown (thread-safe); a second call stops at once."""
        loop, event = self._loop, self._stop
        if loop is None or event is None:
            return
        self._stops += 1
        if self._stops > 1 and self.core is not None:
            loop.call_soon_threadsafe(self.core.fail_pending, "the server was stopped at once")
        loop.call_soon_threadsafe(event.set)

    async def serve(self, on_ready: Callable[[dict[str, Any]], None] | None = None,
                    ) -> dict[str, Any]:
        """Serve until `stop()`; the summary (per-model totals, ports, run id)."""
        from infermux.store import recording

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        # Request rows over bytes (gRPC, chunked HTTP) are read-only arrays; the runners only
        # read them (`TorchRunner.prepare_rows`), so torch's warning about it says nothing.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                                category=UserWarning)
        s = self.settings
        http_sock = _bind(s.host, s.http_port, "--http-port")
        config = {"plan": self.plan.to_dict() if self.plan is not None else None,
                  "model": self.plan.name if self.plan is not None else None,
                  "serve": s.public(), **self.config}
        with recording(self.store, "serve", config, self.command) as rec:
            self.run_id = rec.run_id
            return await self._serve(rec, http_sock, on_ready)

    async def _serve(self, rec: Any, http_sock: socket.socket,
                     on_ready: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
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
                    supervisor = self.supervisor = Supervisor(local, max_restarts=s.max_restarts)
            assert runtime is not None
            sampler = _sampler(s.telemetry_interval_s)
            metrics = ServeMetrics(runtime, sampler)
            self.core = core = InferenceCore(runtime, runtime.plan,
                                             max_queue_items=s.max_queue_items,
                                             metrics=metrics, supervisor=supervisor)
            if supervisor is not None:
                supervisor.start()
            await core.probe_outputs()
            http, http_task = await self._start_http(core, http_sock)
            grpc_server, grpc_port = await self._start_grpc(core)
            httpd, metrics_port = _start_metrics(metrics, s.host, s.metrics_port)
            self.ports = {"http": http_sock.getsockname()[1], "grpc": grpc_port,
                          "metrics": metrics_port}
            if on_ready is not None:
                on_ready(self.ready_info(runtime))
            await self._stop.wait()
            # Stop accepting; what was admitted is answered (new requests meanwhile: 503).
            core.begin_close()
            http.should_exit = True
            await asyncio.gather(grpc_server.stop(s.drain_timeout_s),
                                 core.drain(s.drain_timeout_s))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(http_task, s.drain_timeout_s + 5)
            left = await core.drain(0)
            if left:
                core.fail_pending("the server stopped before the request was served")
                status, error = "interrupted", f"{left} requests unanswered at shutdown"
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
            summary = {"models": self.core.summary() if self.core is not None else {},
                       "ports": self.ports, "served_s": time.perf_counter() - started,
                       "error": error, "run_id": self.run_id, "status": status,
                       "restarts": supervisor.summary() if supervisor is not None else {}}
            if runtime is not None and hasattr(runtime, "nodes"):
                summary["nodes"] = runtime.nodes()
            rec.status, rec.summary = status, summary
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
            http=body_protocol(front.max_body) or "auto", access_log=False,
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
                                             max_message_bytes=body_limit(core))
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


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _bind(host: str, port: int, flag: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP given explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says
    # TCP, and without it every response (head, then body) waited 40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"{flag} {port} on {host} cannot be bound ({exc.strerror}): is it in "
                         "use? pass another port, or 0 for any free one") from None
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


def _start_metrics(metrics: Any, host: str, port: int) -> tuple[Any, int]:
    from prometheus_client import start_http_server

    try:
        httpd, _ = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as exc:
        raise UsageError(f"--metrics-port {port} on {host} cannot be bound ({exc.strerror}): "
                         "is it in use? pass another port, or 0 for any free one") from None
    return httpd, int(httpd.server_port)


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


def serve_plan(plan: Plan | None, settings: ServeSettings | None = None, *,
               store: Store | None = None, command: str = "",
               on_ready: Callable[[dict[str, Any]], None] | None = None,
               progress: Callable[[str, float], None] | None = None,
               backend: Callable[[Callable[[str, float], None] | None], Any] | None = None,
               config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Serve `plan` (or `backend`'s runtime) until SIGTERM or Ctrl-C; the summary."""
    server = InferenceServer(plan, settings, store=store, command=command, progress=progress,
                             backend=backend, config=config)

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stop)
        try:
            return await server.serve(on_ready)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    return asyncio.run(main())
