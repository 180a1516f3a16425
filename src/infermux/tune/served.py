"""A server tune's last step: the best plans served as clients see them, the fastest written.

The runtime's find-peak measures a plan's queries inside its own process: no protocol, no
fronts, no copies in and out of a request. Served, the same plans rank differently: on H200
hosts the server tune's ResNet50 b32 ×4 peaked highest through the runtime, yet b64 ×2 served
0.63-0.83 of its offline figure through Triton's front against b32 ×4's 0.47-0.50 (the front's
per-request work and its batching stage sit between the client and the plan). So with
`--served` the candidates whose runtime peak is highest are each started with `infermux serve`
(a process of its own, its fronts as asked) and driven as a client would drive them: a
closed-loop concurrency sweep over gRPC or HTTP (`load.v2client.closed_loop_peak`; the
built-in client, or Triton's perf_analyzer where given), every input of the model in each
request, each request as long as the tune's query lengths draw. The plan whose served
throughput within the p99 bound is highest is written.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from infermux.errors import UsageError
from infermux.load.v2client import (
    GrpcClient,
    HttpClient,
    V2Tensor,
    as_datatypes,
    closed_loop_peak,
    model_datatypes,
    perf_analyzer_figures,
    requests_from_samples,
    run_level,
)

__all__ = ["SERVED_BUDGET_SHARE", "SERVED_CANDIDATES", "ServedSettings", "front_room",
           "serve_candidates", "served_peak", "served_requests", "served_words"]

#: A served tune keeps this share of its budget for serving its best plans.
SERVED_BUDGET_SHARE = 0.25
#: At most this many plans are served: the runtime's best peak and the next ones.
SERVED_CANDIDATES = 3
#: Distinct requests a client cycles through (lengths drawn per request).
REQUESTS = 64
#: How long `infermux serve` may take to say it is ready (a torch.compile build included).
READY_TIMEOUT_S = 900.0

PROTOCOLS = ("grpc", "http")
FRONTS = ("own", "triton")


@dataclass(frozen=True)
class ServedSettings:
    """How `tune --served` serves and drives each candidate plan."""

    protocol: str = "grpc"
    #: `infermux serve --front`: own or triton, or both comma-separated (`own,triton`): each
    #: candidate is then served through each, and the front that served it most is its figure.
    front: str = "own"
    #: `infermux serve --fronts` (None: serve's default).
    fronts: int | None = None
    #: Measured seconds per concurrency level, after `warmup_s`.
    seconds: float = 3.0
    warmup_s: float = 1.0
    max_concurrency: int = 512
    #: Triton's perf_analyzer as the client (its path); None: the built-in client.
    perf_analyzer: str | None = None
    #: perf_analyzer's `--shared-memory`: none (tensors in the requests), system or cuda.
    shared_memory: str = "none"

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise UsageError(f"--served {self.protocol!r} unknown: serve over grpc or http "
                             "(or leave --served out)")
        if not self.front_list or any(f not in FRONTS for f in self.front_list) or len(
                set(self.front_list)) < len(self.front_list):
            raise UsageError(f"--served-front {self.front!r} unknown: use own, triton or "
                             "own,triton (each candidate served through each)")
        if self.fronts is not None and self.fronts < 0:
            raise UsageError(f"--served-fronts {self.fronts} must be 0 or more")
        if self.seconds <= 0:
            raise UsageError(f"--served-seconds {self.seconds:g} must be positive, e.g. 3")
        if self.max_concurrency < 1:
            raise UsageError(f"--served-max-concurrency {self.max_concurrency} must be at "
                             "least 1")
        if self.perf_analyzer is not None and shutil.which(self.perf_analyzer) is None:
            raise UsageError(f"--perf-analyzer {self.perf_analyzer!r} is not an executable: "
                             "give perf_analyzer's path (tritonclient's wheel ships it), or "
                             "leave it out for the built-in client")
        if self.shared_memory not in ("none", "system", "cuda"):
            raise UsageError(f"--served-shared-memory {self.shared_memory!r} unknown: use none, "
                             "system or cuda")
        if self.shared_memory != "none" and self.perf_analyzer is None:
            raise UsageError(f"--served-shared-memory {self.shared_memory} needs perf_analyzer "
                             "as the client: add --perf-analyzer PATH")
        if self.perf_analyzer is None:
            import importlib.util

            need = ("grpc", "tritonclient") if self.protocol == "grpc" else ()
            missing = [m for m in need if importlib.util.find_spec(m) is None]
            if missing:
                raise UsageError(f"--served grpc needs {', '.join(missing)}: pip install "
                                 "'infermux[serve]'")

    @property
    def front_list(self) -> list[str]:
        """The fronts each candidate is served through, in order."""
        return [f.strip() for f in self.front.split(",") if f.strip()]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)

    def serve_args(self) -> list[str]:
        """The `infermux serve` options these settings ask for (one front)."""
        if len(self.front_list) != 1:
            raise ValueError(f"serve takes one front, not {self.front!r}: serve through each "
                             "(dataclasses.replace(settings, front=F))")
        args = ["--front", self.front]
        if self.fronts is not None:
            args += ["--fronts", str(self.fronts)]
        return args


def _core_text(cores: list[int]) -> str:
    """A core set as a unit writes it: `2`, `1-3`, `0-1+4-5`."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return "+".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def front_room(plan: dict[str, Any], settings: ServedSettings,
               cores: list[int]) -> tuple[dict[str, Any], str] | None:
    """The plan with its whole-host CPU replicas moved off the cores the server's fronts take.

    A plan tuned through the runtime spends every core on its workers (`cpu`), and served, its
    front processes (`infermux serve --fronts`; on a host of under four cores the server
    process itself) and their clients take cores from them: on the 2-core machine such a plan
    kept 0.48 of its offline figure over gRPC where a plan on one core kept 0.90. The fronts get
    the first cores (as many as serve starts by default, `units.cpu.default_fronts`, or
    `--served-fronts`; at least one, and one core is left to the workers), the replicas the rest,
    each keeping its engine, batch and options (instances at most one per core left). None
    where no replica runs on all the host's cores, the host has one core, or the plan has
    pipeline stages. Returns the plan and the unit the replicas moved to.
    """
    from infermux.units.cpu import default_fronts

    if len(cores) < 2 or any("stages" in m for m in plan["models"]):
        return None
    fronts = max(1, settings.fronts) if settings.fronts is not None else default_fronts(len(cores))
    rest = sorted(cores)[max(1, min(fronts, len(cores) - 1)):]
    unit = f"cpu:{_core_text(rest)}"
    moved = False
    models = []
    for m in plan["models"]:
        replicas = []
        for r in m["replicas"]:
            name, _, mode = str(r["unit"]).partition("/")
            if name == "cpu":
                r = {**r, "unit": unit + (f"/{mode}" if mode else ""),
                     "instances": min(int(r.get("instances", 1)), len(rest))}
                moved = True
            replicas.append(r)
        models.append({**m, "replicas": replicas})
    return ({**plan, "models": models}, unit) if moved else None


def served_requests(io: Any, name: str, entry: dict[str, Any], lengths: str | None,
                    count: int = REQUESTS) -> list[list[V2Tensor]]:
    """Single-item requests for a plan's model entry: every input, seeded values.

    `io` is the model's `IOSpec`. A model with a sequence length gets requests as long as
    `lengths` draws (the tune's `--lengths`), unpadded, up to the entry's longest
    `seq_buckets`; without `lengths` every request is that long.
    """
    from infermux.load.samples import IOSamples, parse_lengths

    max_length = None
    if io.dynamic_dims:
        buckets = entry.get("seq_buckets") or []
        max_length = max(buckets) if buckets else next(iter(io.dims_for().values()))
    drawn = parse_lengths(lengths) if lengths is not None and io.dynamic_dims else None
    samples = IOSamples.generate(io, name, count, 0, max_length, drawn)
    axes = [[axis for axis, dim in enumerate(t.shape, start=1) if isinstance(dim, str)]
            for t in io.inputs]
    arrays = [a.astype(np.float32) if t.dtype == "bfloat16" else a
              for t, a in zip(io.inputs, samples.arrays, strict=True)]
    return requests_from_samples([t.name for t in io.inputs], arrays, samples.lengths, axes)


@contextmanager
def serving(plan: dict[str, Any], settings: ServedSettings, workdir: Path) -> Iterator[dict]:
    """`infermux serve` of `plan` in a process of its own; yields its ready line.

    Stopped with SIGTERM on the way out (its admitted requests answered), killed if it has not
    stopped within 60 s.
    """
    plan_path = workdir / "plan.yaml"
    plan_path.write_text(yaml.safe_dump(plan, sort_keys=False))
    log_path = workdir / "serve.log"
    cmd = [sys.executable, "-m", "infermux", "serve", str(plan_path), "--host", "127.0.0.1",
           "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--json",
           "--no-store", "--telemetry", "off", *settings.serve_args()]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                start_new_session=True)
    try:
        ready = _ready_line(proc, log_path)
        yield ready
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _ready_line(proc: subprocess.Popen[str], log_path: Path) -> dict[str, Any]:
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if sel.select(timeout=1.0):
            line = proc.stdout.readline()
            if not line:
                break
            try:
                info = json.loads(line)
            except json.JSONDecodeError:
                continue
            if info.get("event") == "ready":
                return info
        elif proc.poll() is not None:
            break
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
    raise RuntimeError("infermux serve did not get ready"
                       + (f": {' / '.join(tail)}" if tail else ""))


def served_peak(plan: dict[str, Any], requests: list[list[V2Tensor]], bound_ms: float,
                settings: ServedSettings,
                progress: Callable[[str, float], None] | None = None) -> dict[str, Any]:
    """The plan's highest closed-loop throughput within `bound_ms`, served and driven here.

    Returns `closed_loop_peak`'s record (`peak_rps`, `concurrency`, `p99_ms`, `levels`,
    `reason`) plus the server's `build_s`; a plan that cannot be served gets `peak_rps` None and
    the reason.
    """
    model = plan["models"][0]["name"]
    with tempfile.TemporaryDirectory(prefix="infermux-served-") as tmp:
        workdir = Path(tmp)
        try:
            with serving(plan, settings, workdir) as ready:
                host = ready["host"]
                port = ready[f"{settings.protocol}_port"]
                with contextlib.suppress(OSError, ValueError, KeyError):
                    # The datatypes the server states (FP16 for an fp16 plan), where it says.
                    requests = as_datatypes(requests, model_datatypes(
                        host, ready["http_port"], model))
                if settings.perf_analyzer is not None:
                    data = _perf_analyzer_data(requests, workdir)

                    def measure(c: int) -> dict[str, Any]:
                        _say(progress, f"served c{c} (perf_analyzer)")
                        return _perf_analyzer_level(settings, host, port, model, c, data,
                                                    workdir)
                else:
                    client = (GrpcClient(f"{host}:{port}", model, requests)
                              if settings.protocol == "grpc"
                              else HttpClient(host, port, model, requests))

                    def measure(c: int) -> dict[str, Any]:
                        _say(progress, f"served c{c}")
                        return asyncio.run(run_level(
                            client, concurrency=c, duration_s=settings.seconds,
                            warmup_s=settings.warmup_s)).summary()

                peak = closed_loop_peak(measure, bound_ms,
                                        max_concurrency=settings.max_concurrency)
                return {**peak, "build_s": ready.get("build_s")}
        except RuntimeError as exc:
            return {"p99_bound_ms": bound_ms, "levels": [], "peak_rps": None,
                    "concurrency": None, "p99_ms": None, "reason": str(exc)}


def _say(progress: Callable[[str, float], None] | None, label: str) -> None:
    if progress is not None:
        progress(label, 0.0)


#: Requests written for perf_analyzer where their shapes vary (it cycles through them); one
#: where every request has the same shape (a 224×224 image is megabytes of JSON text).
PA_REQUESTS = 16


def _perf_analyzer_data(requests: list[list[V2Tensor]], workdir: Path) -> Path:
    """perf_analyzer's `--input-data` JSON: each request's tensors with their shapes.

    The values go as base64 of their bytes (`b64`): exact for every datatype, and perf_analyzer
    takes no `content` list for FP16 or BF16 inputs ("Can not use explicit tensor description").
    """
    shapes = {tuple(t.array.shape for t in tensors) for tensors in requests}
    kept = requests[:PA_REQUESTS] if len(shapes) > 1 else requests[:1]
    data = [{t.name: {"b64": base64.b64encode(np.ascontiguousarray(t.array[0]).tobytes())
                      .decode("ascii"),
                      "shape": list(t.array.shape[1:])} for t in tensors}
            for tensors in kept]
    path = workdir / "input-data.json"
    path.write_text(json.dumps({"data": data}))
    return path


def _perf_analyzer_level(settings: ServedSettings, host: str, port: int, model: str, c: int,
                         data: Path, workdir: Path) -> dict[str, Any]:
    """One concurrency level measured by perf_analyzer, as a `LevelResult.summary()` row."""
    assert settings.perf_analyzer is not None
    csv_file = workdir / f"pa-c{c}.csv"
    cmd = [settings.perf_analyzer, "-m", model, "-u", f"{host}:{port}", "-i", settings.protocol,
           "--concurrency-range", f"{c}:{c}", "--input-data", str(data),
           "--measurement-interval", str(int(settings.seconds * 1000)),
           "--stability-percentage", "20", "--max-trials", "5", "-f", str(csv_file),
           "--shared-memory", settings.shared_memory]
    done = subprocess.run(cmd, capture_output=True, text=True)
    row: dict[str, Any] = {"protocol": settings.protocol, "concurrency": c,
                           "duration_s": settings.seconds, "ok": 0, "rejected": 0, "errors": 0,
                           "throughput_rps": 0.0, "p50_ms": 0.0, "p99_ms": float("inf"),
                           "first_error": None}
    if done.returncode != 0 or not csv_file.exists():
        row["errors"] = 1
        tail = (done.stdout + done.stderr).strip().splitlines()[-2:]
        row["first_error"] = "perf_analyzer: " + " / ".join(tail)
        return row
    figures = perf_analyzer_figures(csv_file)
    rps = figures.pop("requests_per_s")
    row.update(figures, throughput_rps=rps, ok=max(1, round(rps * settings.seconds)))
    return row


def serve_candidates(rows: list[dict[str, Any]], plans: list[dict[str, Any]],
                     runtime_row: int | None, requests: list[list[V2Tensor]], bound_ms: float,
                     settings: ServedSettings, *, deadline: float,
                     progress: Callable[[str, float], None] | None = None) -> dict[str, Any]:
    """Serve the plans of the highest runtime peaks; say which served the most.

    `rows` are a server tune's find-peak rows (`peak_qps`, `plan`), `plans[i]` row i's plan.
    Candidates are the distinct plans of the rows, the runtime's choice (`runtime_row`) first,
    then rows `derived` for serving (`front_room`: not measured by the runtime, served as the
    first is, whatever the budget), then the highest peaks, at most `SERVED_CANDIDATES`; a plan with no
    runtime peak within the bound is served too (a server whose idle worker takes a request at
    once may hold a bound the runtime's queue delay broke). The first is always served; the others
    until `deadline` (`time.monotonic()`), and only while their runtime peak is above the best
    served figure so far (a plan served through a front does not answer more than its runtime
    alone); a candidate left unserved gets `served_skipped`, the reason. Each served row gets
    `served_peak_rps`, `served_concurrency`, `served_p99_ms`, `served_reason`, `served_s`,
    `served_build_s`, its `served_levels` and `served_front`, the front they are from (with
    several fronts, the one that served it most; each front's figures in `served_by_front`),
    in place. Returns
    `rows` (the candidates' indices, in order), `written_row` (the highest served, or None where
    none served within the bound) and the `reason`, in words.
    """
    order: list[int] = []
    seen: set[str] = set()
    first = [runtime_row] if runtime_row is not None else []
    derived = [i for i, row in enumerate(rows) if row.get("derived")]
    for i in first + derived + sorted(range(len(rows)),
                                      key=lambda i: -(rows[i]["peak_qps"] or 0.0)):
        key = yaml.safe_dump(plans[i], sort_keys=True)
        if key not in seen:
            seen.add(key)
            order.append(i)
    order = order[:SERVED_CANDIDATES]
    if not order:
        return {"rows": [], "written_row": None, "reason": "no plan to serve"}
    best: tuple[float, int] | None = None
    for n, i in enumerate(order):
        row = rows[i]
        if n and not row.get("derived"):
            if time.monotonic() >= deadline:
                row["served_skipped"] = "the budget's share for serving was spent"
                continue
            if best is not None and (row["peak_qps"] or 0.0) <= best[0]:
                row["served_skipped"] = (f"its runtime peak is not above the best served "
                                         f"figure, {best[0]:,.1f} requests/s")
                continue
        fronts = settings.front_list
        by_front: dict[str, dict[str, Any]] = {}
        for front in fronts:
            _say(progress, f"serving {row['plan']}"
                 + (f" through the {front} front" if len(fronts) > 1 else ""))
            by_front[front] = _served_row(plans[i], requests, bound_ms,
                                          replace(settings, front=front), progress)
        # The front that served it most (a plan that served within the bound through neither
        # keeps the first front's reason).
        front = max(fronts, key=lambda f: (by_front[f]["served_peak_rps"] is not None,
                                           by_front[f]["served_peak_rps"] or 0.0,
                                           -fronts.index(f)))
        row.update(by_front[front], served_front=front)
        if len(fronts) > 1:
            row["served_by_front"] = {f: {k: by_front[f][k] for k in (
                "served_peak_rps", "served_concurrency", "served_p99_ms", "served_reason")}
                for f in fronts}
        rps = row["served_peak_rps"]
        if rps is not None and (best is None or rps > best[0]):
            best = (rps, i)
    if best is None:
        return {"rows": order, "written_row": None,
                "reason": "no plan served within the bound: the runtime's choice is written"}
    rps, i = best
    if runtime_row is None:
        why = f"{rows[i]['plan']} served the most: {rps:,.1f} requests/s within the bound"
    elif i == runtime_row:
        why = f"the runtime's choice also served the most: {rps:,.1f} requests/s within the bound"
    else:
        theirs = rows[runtime_row].get("served_peak_rps")
        why = (f"{rows[i]['plan']} served {rps:,.1f} requests/s within the bound, the runtime's "
               "choice " + (f"{theirs:,.1f}" if theirs is not None else "none")
               + ": the served figure decides")
    return {"rows": order, "written_row": i, "reason": why}


def _served_row(plan: dict[str, Any], requests: list[list[V2Tensor]], bound_ms: float,
                settings: ServedSettings,
                progress: Callable[[str, float], None] | None) -> dict[str, Any]:
    """One plan served through one front: the `served_*` fields of its row."""
    began = time.monotonic()
    peak = served_peak(plan, requests, bound_ms, settings, progress)
    return {"served_s": round(time.monotonic() - began, 1),
            "served_build_s": peak.get("build_s"), "served_peak_rps": peak["peak_rps"],
            "served_concurrency": peak["concurrency"], "served_p99_ms": peak["p99_ms"],
            "served_reason": peak["reason"],
            "served_levels": [{k: lv.get(k) for k in (
                "concurrency", "throughput_rps", "p50_ms", "p99_ms", "ok", "rejected", "errors",
                "within_bound")} for lv in peak["levels"]]}


def served_words(row: dict[str, Any]) -> str | None:
    """A served row's figure in words: requests/s, concurrency and p99, or none and why.

    A candidate left unserved says why (`served_skipped`); a row that was no candidate, None.
    """
    if "served_peak_rps" not in row:
        skipped = row.get("served_skipped")
        return f"not served: {skipped}" if skipped else None
    rps = row.get("served_peak_rps")
    words = (f"none ({row.get('served_reason')})" if rps is None else
             f"{rps:,.1f} requests/s at concurrency {row['served_concurrency']}, "
             f"p99 {row['served_p99_ms']:.1f} ms")
    others = {f: v for f, v in (row.get("served_by_front") or {}).items()
              if f != row.get("served_front")}
    if others:  # served through several fronts: which one this is, and the others' figures
        words += f" through the {row['served_front']} front; " + "; ".join(
            f"{f}: " + (f"{v['served_peak_rps']:,.1f}" if v["served_peak_rps"] is not None
                        else "none") for f, v in others.items())
    return words
