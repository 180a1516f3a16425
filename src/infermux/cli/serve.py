"""`infermux serve PLAN`: the plan's runtime behind the KServe v2 / Triton protocol."""

from __future__ import annotations

import os
import shlex
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from infermux.cli._app import DbOpt, JsonOpt, _print_json, app, err, out
from infermux.errors import UsageError

if TYPE_CHECKING:
    from infermux.serve import ServeSummary

__all__ = ["masked_argv", "serve_command"]


def _missing_extra() -> str | None:
    import importlib.util

    needed = {"uvicorn": "uvicorn", "grpc": "grpcio", "tritonclient": "tritonclient[grpc]",
              "prometheus_client": "prometheus-client"}
    missing = [pkg for mod, pkg in needed.items() if importlib.util.find_spec(mod) is None]
    if not missing:
        return None
    return (f"`infermux serve` needs {', '.join(missing)}: pip install 'infermux[serve]'")


@app.command("serve")
def serve_command(
    plan_file: Annotated[str, typer.Argument(help="Plan file (YAML or JSON), as `infermux run` takes.")],
    host: Annotated[str, typer.Option("--host", help="Address to bind (all three ports).")] = "127.0.0.1",
    http_port: Annotated[int, typer.Option("--http-port", help="KServe v2 REST port (0: any free port).")] = 8000,
    grpc_port: Annotated[int, typer.Option("--grpc-port", help="KServe v2 gRPC port (0: any free port).")] = 8001,
    metrics_port: Annotated[int, typer.Option("--metrics-port", help="Prometheus /metrics port (0: any free port).")] = 8002,
    max_queue: Annotated[int | None, typer.Option("--max-queue", help="Items a model may hold admitted and unanswered; more get 503 (default: 4x what its workers hold, at least 64).")] = None,
    wait_when_idle: Annotated[bool, typer.Option("--wait-when-idle", help="Wait out the plan's max_queue_delay_ms for a fuller batch even when the model's workers are idle (default: an idle worker takes what is queued at once).")] = False,
    max_restarts: Annotated[int, typer.Option("--max-restarts", help="Times a failed worker may be restarted within --restart-window (0: never); past that it waits, not ready, for the window.")] = 3,
    restart_window: Annotated[str, typer.Option("--restart-window", help="The window --max-restarts counts over (e.g. 10m).")] = "10m",
    api_key: Annotated[str | None, typer.Option("--api-key", help="Require `Authorization: Bearer KEY` (or env INFERMUX_API_KEY) on inference and /metrics; health probes stay open.")] = None,
    drain_timeout: Annotated[str, typer.Option("--drain-timeout", help="On SIGTERM/Ctrl-C, how long admitted requests may take to finish; also the longest an admitted request waits for a restarting worker (then 503).")] = "30s",
    telemetry: Annotated[str, typer.Option("--telemetry", help="Sampler period for the hardware metrics (e.g. 1s) or off.")] = "1s",
    fronts: Annotated[int | None, typer.Option("--fronts", help="Front processes serving HTTP and gRPC on the same ports, tensors passed to the runtime process through shared memory (default: the plan's serve.fronts, else half the usable cores, at most 8; 0 or 1: in the server process).")] = None,
    front: Annotated[str | None, typer.Option("--front", help="Who parses HTTP and gRPC: own (infermux's fronts, --fronts processes) or triton (Triton's C++ server, --fronts instances of each model forwarding its batches to the runtime; needs a Triton build: --triton-home, or pip install --no-deps nvidia-pytriton). Default: the plan's serve.front (tune --served writes it), else own.")] = None,
    triton_home: Annotated[str | None, typer.Option("--triton-home", help="With --front triton: a Triton build (a directory with bin/tritonserver and backends/python); default: $INFERMUX_TRITON_HOME, /opt/tritonserver, or the nvidia-pytriton wheel's.")] = None,
    triton_python_path: Annotated[str | None, typer.Option("--triton-python-path", help="With --front triton: folders (':'-separated) first on the model instances' import path, e.g. one with numpy<2 (pip install --target DIR 'numpy<2'): Triton's stubs are built for numpy 1, and under numpy 2 each tensor crosses by DLPack, which costs more.")] = None,
    triton_backend: Annotated[str, typer.Option("--triton-backend", help="With --front triton: the model instances' backend: native (infermux's C backend, built here with cc: several batches in flight per instance, no Python per request), python (Triton's Python-backend stubs), or auto (native where every model has one FP32/FP16 input and fixed outputs, and cc builds it).")] = "auto",
    triton_queue_delay: Annotated[str | None, typer.Option("--triton-queue-delay", help="With --front triton: how long Triton's batcher holds a request for others to join its batch, e.g. 0.3ms (a bare number is ms; 0: hand on at once). Default: 0.3ms for the native backend (fewer, fuller batches for the runtime process to take in), 0 for python.")] = None,
    trace_requests: Annotated[int, typer.Option("--trace-requests", help="Trace every Nth request's stages (front, queue, gather, launch, answer) with one host clock, 1: every request, 0: off; the p50/p99 of each gap go in the summary (--json).")] = 0,
    trace_file: Annotated[str, typer.Option("--trace-file", help="Where --trace-requests writes its JSON lines (each front process adds FILE.<pid>; behind --front triton, Triton's own trace goes to FILE.triton).")] = "serve-trace.jsonl",
    connection_age: Annotated[str, typer.Option("--connection-age", help="With --fronts: close a gRPC connection after about this long (GOAWAY; its calls finish, the client reconnects), so connections are re-placed on the least loaded front (e.g. 5s); 0 or off: never.")] = "0",
    loop: Annotated[str, typer.Option("--loop", help="The event loop of the server's processes: auto (uvloop where installed), asyncio or uvloop.")] = "auto",
    cluster: Annotated[str | None, typer.Option("--cluster", help="Serve from a Ray cluster: ray://HOST:PORT, HOST:PORT, auto, or local:N. PLAN is a cluster plan, or a local plan run on every node; requests are routed to the nodes.")] = None,
    db: DbOpt = "infermux.db",
    no_store: Annotated[bool, typer.Option("--no-store", help="Do not write the results database.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Serve a plan over the KServe v2 / Triton protocol (HTTP and gRPC) with Prometheus metrics.

    Stops on SIGTERM or Ctrl-C: no new requests, the admitted ones answered, exit code 0.
    """
    from infermux._parse import parse_delay_ms, parse_duration_s
    from infermux.runtime import load_plan
    from infermux.store import open_store

    cluster_plan = None
    if cluster is not None:
        from infermux.cluster import parse_address
        from infermux.cluster.plan import cluster_plan_from_file
        from infermux.cluster.serve import SERVE_SAMPLE_POOL

        parse_address(cluster)  # a bad address fails before anything starts
        cluster_plan = cluster_plan_from_file(plan_file, {"sample_pool": SERVE_SAMPLE_POOL})
        plan_name = cluster_plan.name
    else:
        plan = load_plan(plan_file)
        plan_name = plan.name
        if plan.serve is not None:  # how `tune --served` measured it, unless the line says
            taken = [o for o, given in (("--front", front), ("--fronts", fronts))
                     if given is None and getattr(plan.serve, o[2:]) is not None]
            front = front or plan.serve.front
            fronts = plan.serve.fronts if fronts is None else fronts
            if taken and not as_json:
                err.print(f"[dim]{' and '.join(taken)} from the plan's serve section "
                          f"(--front {front}{'' if fronts is None else f' --fronts {fronts}'}); "
                          "the command line overrides it[/]")
    why = _missing_extra()
    if why is not None:
        raise UsageError(why)
    from infermux.serve import ServeSettings, serve_plan

    interval = 0.0 if telemetry.strip().lower() == "off" else parse_duration_s(
        telemetry, name="--telemetry")
    settings = ServeSettings(
        host=host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
        max_queue_items=max_queue, max_restarts=max_restarts, wait_when_idle=wait_when_idle,
        restart_window_s=parse_duration_s(restart_window, name="--restart-window"),
        api_key=api_key or os.environ.get("INFERMUX_API_KEY") or None,
        drain_timeout_s=parse_duration_s(drain_timeout, name="--drain-timeout"),
        telemetry_interval_s=interval, fronts=fronts, trace_requests=trace_requests,
        trace_path=trace_file, front=front or "own", triton_home=triton_home,
        triton_python_path=triton_python_path, triton_backend=triton_backend, loop=loop,
        triton_queue_delay_ms=None if triton_queue_delay is None else
        parse_delay_ms(triton_queue_delay, name="--triton-queue-delay"),
        connection_age_s=0.0 if connection_age.strip().lower() in ("0", "off") else
        parse_duration_s(connection_age, name="--connection-age"))
    if cluster is None:
        settings.check_plan(plan)  # before anything is built
    store = None if no_store else open_store(db)
    command = "infermux " + shlex.join(masked_argv(sys.argv[1:]))

    def on_ready(info: dict[str, Any]) -> None:
        if as_json:
            sys.stdout.write(_one_line(info) + "\n")
            sys.stdout.flush()
            return
        h = info["host"]
        out.print(f"[bold]serving[/] {plan_name}: http://{h}:{info['http_port']}/v2 (REST), "
                  f"{h}:{info['grpc_port']} (gRPC), http://{h}:{info['metrics_port']}/metrics")
        for m in info["models"]:
            shape = m["inputs"][0]["shape"]
            out.print(f"  {m['name']}: input {shape}, max batch {m['max_batch_size']}, "
                      f"{len(m['workers'])} worker(s), admits {m['max_queue_items']} items")
        out.print("[dim]SIGTERM or Ctrl-C stops it (admitted requests are answered)[/]")
        sys.stdout.flush()

    def on_progress(label: str, fraction: float) -> None:
        if not as_json:
            err.print(f"[dim]{label}[/]")

    if cluster is None:
        summary = serve_plan(plan, settings, store=store, command=command, on_ready=on_ready,
                             progress=on_progress)
    else:
        summary = _serve_cluster(cluster_plan, cluster, plan_file, settings, store, command,
                                 on_ready, on_progress)
    if as_json:
        _print_json({"event": "stopped", **summary.to_dict()})
    else:
        for name, m in summary.models.items():
            out.print(f"{name}: {m.requests_ok} answered, {m.requests_failed} failed, "
                      f"{m.requests_rejected} rejected (503), {m.items} items in "
                      f"{m.batches} batches")
        trace = summary.trace
        if trace:
            worst = sorted(trace["gaps"].items(), key=lambda kv: -kv[1]["mean_ms"])[:3]
            out.print(f"trace: {trace['requests']} requests in {trace['path']}; largest gaps "
                      + ", ".join(f"{k} {v['mean_ms']:.2f} ms (p99 {v['p99_ms']:.2f})"
                                  for k, v in worst))
        if summary.run_id is not None:
            out.print(f"[dim]stored as run {summary.run_id} in {db}[/]")
    if summary.status != "complete":
        raise typer.Exit(1)


#: Options whose value is a secret, masked in the command stored with the run.
_SECRET_OPTIONS = ("--api-key",)


def masked_argv(argv: list[str]) -> list[str]:
    """`argv` with the value of every secret option masked (`--api-key K`, `--api-key=K`)."""
    out: list[str] = []
    secret_next = False
    for arg in argv:
        if secret_next:
            out.append("***")
            secret_next = False
            continue
        name, eq, _ = arg.partition("=")
        if name in _SECRET_OPTIONS:
            out.append(f"{name}=***" if eq else arg)
            secret_next = not eq
            continue
        out.append(arg)
    return out


def _serve_cluster(cluster_plan: Any, address: str, plan_file: str, settings: Any, store: Any,
                   command: str, on_ready: Any, on_progress: Any) -> ServeSummary:
    """Connect to the cluster (here, on the main thread, as Ray wants), serve, disconnect."""
    from pathlib import Path

    from infermux.cluster import open_cluster
    from infermux.cluster.serve import start_cluster_runtime
    from infermux.serve import serve_plan

    with open_cluster(address) as handle:
        on_progress(f"cluster {address}: {len(handle.nodes())} node(s) alive", 0.0)

        def backend(progress: Any) -> Any:
            return start_cluster_runtime(cluster_plan, handle, base=Path(plan_file).parent,
                                         progress=progress,
                                         max_restarts=settings.max_restarts,
                                         wait_when_idle=settings.wait_when_idle)

        return serve_plan(None, settings, store=store, command=command, on_ready=on_ready,
                          progress=on_progress, backend=backend,
                          config={"cluster_plan": cluster_plan.to_dict(), "cluster": address,
                                  "model": cluster_plan.name})


def _one_line(data: dict[str, Any]) -> str:
    import json

    return json.dumps(data, default=str)
