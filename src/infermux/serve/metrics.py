"""Prometheus metrics of `infermux serve`, named as Triton names them where the meaning matches.

Triton's names (`nv_inference_*`, `nv_gpu_*`, `nv_energy_consumption`, `nv_cpu_*`) keep their
meaning and units (durations in µs, utilisation as a 0–1 fraction, power in W, energy in J);
prometheus-client appends `_total` to every Counter. The gauges perf_analyzer's
`--collect-metrics` reads (`nv_gpu_utilization`, `nv_gpu_power_usage`,
`nv_gpu_memory_used_bytes`, `nv_gpu_memory_total_bytes`) carry exactly those names and a
`gpu_uuid` label. infermux's own figures (per worker, per unit, per pipeline stage, batch sizes,
rejections) are prefixed `infermux_`.

Hardware figures come from the telemetry sampler (NVML, RAPL, Jetson rails) and are read at
scrape time; request and batch figures are updated by the server as requests complete.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infermux.runtime.api import Runtime

__all__ = ["ServeMetrics"]

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                      5.0, 10.0)
#: The latency buckets' bounds in ns (an observation in ns falls where its seconds would).
_LATENCY_BOUNDS_NS = tuple(round(b * 1e9) for b in _LATENCY_BUCKETS_S)


class _Histogram:
    """One histogram's bucket counts, sum and count: what an observation costs is a bisection."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf only)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts per upper bound, as the exposition writes them (`le`)."""
        from prometheus_client.utils import floatToGoString

        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append((floatToGoString(bound), float(running)))
        return out


#: name, help text, label names: the counters, in the order they are exposed.
_COUNTERS = {
    "success": ("nv_inference_request_success", "Successful inference requests",
                ("model", "version")),
    "failure": ("nv_inference_request_failure",
                "Failed inference requests (reason: REJECTED when refused with 503 before "
                "admission, BACKEND when the runtime failed it)", ("model", "version", "reason")),
    "count": ("nv_inference_count", "Inferences performed (items)", ("model", "version")),
    "exec": ("nv_inference_exec_count", "Batches executed", ("model", "version")),
    "request_us": ("nv_inference_request_duration_us",
                   "Cumulative request duration, admission to answer (µs)", ("model", "version")),
    "queue_us": ("nv_inference_queue_duration_us",
                 "Cumulative time items waited in the dispatcher's queue (µs)",
                 ("model", "version")),
    "input_us": ("nv_inference_compute_input_duration_us",
                 "Cumulative input copy time per item (µs)", ("model", "version")),
    "infer_us": ("nv_inference_compute_infer_duration_us", "Cumulative compute time per item (µs)",
                 ("model", "version")),
    "output_us": ("nv_inference_compute_output_duration_us",
                  "Cumulative output copy time per item (µs)", ("model", "version")),
    "rejected": ("infermux_requests_rejected",
                 "Requests refused with 503 before admission (queue full, model not ready, "
                 "shutting down)", ("model",)),
    "w_batches": ("infermux_worker_batches", "Batches run by each worker",
                  ("worker", "unit", "model")),
    "w_items": ("infermux_worker_items", "Items run by each worker", ("worker", "unit", "model")),
    "w_busy": ("infermux_worker_busy_seconds", "Time each worker spent running batches",
               ("worker", "unit", "model")),
}


class ServeMetrics:
    """The server's metrics: plain tallies, written as Prometheus families when scraped.

    The tallies are updated as requests and batches complete; `/metrics` turns them into
    families (a registry of its own, no module state). Why not prometheus-client's Counter
    and Histogram objects: the updates run in the runtime process, whose interpreter lock the
    GPU workers and the fronts' hub share, once per request and a dozen times per batch. Each
    labelled update cost a `labels()` lookup and a lock of its own: about a fifth of the
    lock's held time while serving a small model (py-spy, docs/architecture-serve.md). Here an
    update is a few additions under one lock, a request's latency a bisection; the exposition
    (names, labels, `_total`, buckets) is the same.
    """

    def __init__(self, runtime: Runtime, sampler: Any = None) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=True)
        self.runtime = runtime
        self.sampler = sampler
        self._lock = threading.Lock()
        #: counter key -> label values -> value
        self._counts: dict[str, dict[tuple[str, ...], float]] = {k: {} for k in _COUNTERS}
        #: model -> (requests, items) admitted and not yet answered
        self._pending: dict[str, tuple[int, int]] = {}
        self._latency: dict[str, _Histogram] = {}
        self._batch: dict[str, _Histogram] = {}
        self._busy_s: dict[str, float] = {}
        self._since = (time.perf_counter(), dict[str, float]())
        self.registry.register(_Collector(self))

    def _add(self, key: str, labels: tuple[str, ...], value: float) -> None:
        """Add to one counter (called with `_lock` held)."""
        table = self._counts[key]
        table[labels] = table.get(labels, 0.0) + value

    # -- updates from the server --------------------------------------------------------------

    def request(self, model: str, ok: bool, duration_ns: int) -> None:
        """One request answered (ok) or failed by the runtime."""
        self.requests(model, ok, (duration_ns,))

    def requests(self, model: str, ok: bool, durations_ns: Sequence[int]) -> None:
        """Several requests answered (ok) or failed: one update per counter."""
        mv = (model, "1")
        with self._lock:
            if not ok:
                self._add("failure", (model, "1", "BACKEND"), len(durations_ns))
                return
            self._add("success", mv, len(durations_ns))
            self._add("request_us", mv, sum(durations_ns) / 1e3)
            latency = self._latency.get(model)
            if latency is None:
                latency = self._latency[model] = _Histogram(_LATENCY_BUCKETS_S)
            counts, bounds = latency.counts, _LATENCY_BOUNDS_NS
            for ns in durations_ns:  # bisected in ns: no division per request
                counts[bisect_left(bounds, ns)] += 1
            latency.total += sum(durations_ns) / 1e9

    def rejected(self, model: str, count: int = 1) -> None:
        """Requests refused with 503 before admission (full, not ready, shutting down)."""
        with self._lock:
            self._add("failure", (model, "1", "REJECTED"), count)
            self._add("rejected", (model,), count)

    def pending(self, model: str, requests: int, items: int) -> None:
        """Requests and items admitted and not yet answered."""
        self._pending[model] = (requests, items)

    def batch(self, worker: Any, model: str, items: int, queue_ns: int, compute_ns: int,
              infer_ns: int, input_ns: int, output_ns: int) -> None:
        """One batch executed by `worker` (a WorkerState)."""
        mv = (model, "1")
        labels = (worker.name, worker.unit, worker.model)
        with self._lock:
            self._add("count", mv, items)
            self._add("exec", mv, 1)
            self._add("queue_us", mv, queue_ns / 1e3)
            self._add("input_us", mv, input_ns * items / 1e3)
            self._add("infer_us", mv, infer_ns * items / 1e3)
            self._add("output_us", mv, output_ns * items / 1e3)
            sizes = self._batch.get(model)
            if sizes is None:
                sizes = self._batch[model] = _Histogram(_BATCH_BUCKETS)
            sizes.observe(items)
            self._add("w_batches", labels, 1)
            self._add("w_items", labels, items)
            self._add("w_busy", labels, compute_ns / 1e9)
            self._busy_s[worker.name] = self._busy_s.get(worker.name, 0.0) + compute_ns / 1e9

    def utilisation(self) -> dict[str, float]:
        """Each worker's busy share since the previous call (at least a second's window)."""
        now = time.perf_counter()
        with self._lock:
            then, before = self._since
            busy = dict(self._busy_s)
            span = now - then
            if span >= 1.0:
                self._since = (now, busy)
        return {w: min(1.0, max(0.0, (b - before.get(w, 0.0)) / span)) if span > 0 else 0.0
                for w, b in busy.items()}

    def text(self) -> bytes:
        """The exposition text (what `/metrics` answers)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _tallied(m: ServeMetrics) -> Iterator[Any]:
    """The request, batch and worker tallies as Prometheus families, at scrape time."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    with m._lock:
        counts = {k: dict(v) for k, v in m._counts.items()}
        latency = {k: (h.buckets(), h.total) for k, h in m._latency.items()}
        sizes = {k: (h.buckets(), h.total) for k, h in m._batch.items()}
        pending = dict(m._pending)
    families: dict[str, CounterMetricFamily] = {}
    for key, (name, doc, labels) in _COUNTERS.items():
        fam = families[key] = CounterMetricFamily(name, doc, labels=list(labels))
        for values, value in counts[key].items():
            fam.add_metric(list(values), value)
    yield from (families[k] for k in ("success", "failure", "count", "exec", "request_us",
                                      "queue_us", "input_us", "infer_us", "output_us"))
    waiting = GaugeMetricFamily("nv_inference_pending_request_count",
                                "Requests admitted and not yet answered",
                                labels=["model", "version"])
    items = GaugeMetricFamily("infermux_items_in_flight",
                              "Items admitted and not yet answered (bounded by admission)",
                              labels=["model"])
    for model, (requests, n) in pending.items():
        waiting.add_metric([model, "1"], float(requests))
        items.add_metric([model], float(n))
    yield waiting
    yield items
    yield families["rejected"]
    for name, doc, table in (
            ("infermux_request_duration_seconds", "Request duration, admission to answer",
             latency),
            ("infermux_batch_size", "Items per executed batch", sizes)):
        histogram = HistogramMetricFamily(name, doc, labels=["model"])
        for model, (buckets, total) in table.items():
            histogram.add_metric([model], buckets, total)
        yield histogram
    yield from (families[k] for k in ("w_batches", "w_items", "w_busy"))


class _Collector:
    """Everything `/metrics` writes, made at scrape time.

    The tallies (`_tallied`), worker liveness and utilisation, pipeline stages, hardware.
    """

    def __init__(self, metrics: ServeMetrics) -> None:
        self.m = metrics

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield from _tallied(self.m)
        rt = self.m.runtime
        alive = GaugeMetricFamily("infermux_worker_alive", "1 while a worker serves, 0 after "
                                  "it failed", labels=["worker", "unit", "model"])
        util = GaugeMetricFamily("infermux_worker_utilisation",
                                 "Busy share of each worker since the previous scrape (0-1)",
                                 labels=["worker", "unit", "model"])
        restarts = CounterMetricFamily("infermux_worker_restarts",
                                       "Times a failed worker was restarted",
                                       labels=["worker", "unit", "model"])
        shares = self.m.utilisation()
        for s in rt.workers():
            alive.add_metric([s.name, s.unit, s.model], 1.0 if s.alive else 0.0)
            util.add_metric([s.name, s.unit, s.model], shares.get(s.name, 0.0))
            restarts.add_metric([s.name, s.unit, s.model], float(s.restarts))
        retried = CounterMetricFamily("infermux_items_retried",
                                      "Items run again after the worker holding them failed "
                                      "(on another worker, or on it once restarted)")
        retried.add_metric([], float(rt.stats().retried_items))
        yield alive
        yield util
        yield restarts
        yield retried
        pipelines = rt.pipeline_stats()
        if pipelines:
            stage = GaugeMetricFamily("infermux_pipeline_stage_busy",
                                      "Busy share of each pipeline stage since serving began",
                                      labels=["model", "stage", "units", "engine"])
            depth = GaugeMetricFamily("infermux_pipeline_stage_queue_depth",
                                      "Mean depth of each stage's inbound link",
                                      labels=["model", "stage", "units", "engine"])
            for model, stages in pipelines.items():
                for st in stages:
                    labels = [model, str(st["stage"]), "+".join(st["units"]),
                              st["engine"]]
                    stage.add_metric(labels, float(st.get("busy") or 0.0))
                    depth.add_metric(labels, float(st.get("queue_depth") or 0.0))
            yield stage
            yield depth
        yield from self._hardware(GaugeMetricFamily, CounterMetricFamily)

    def _hardware(self, gauge: Any, counter: Any) -> Iterator[Any]:
        import psutil

        cpu_util = gauge("nv_cpu_utilization", "CPU utilisation (0-1)")
        cpu_util.add_metric([], psutil.cpu_percent(interval=None) / 100.0)
        mem = psutil.virtual_memory()
        cpu_used = gauge("nv_cpu_memory_used_bytes", "CPU memory used (bytes)")
        cpu_used.add_metric([], float(mem.total - mem.available))
        cpu_total = gauge("nv_cpu_memory_total_bytes", "CPU memory in total (bytes)")
        cpu_total.add_metric([], float(mem.total))
        yield from (cpu_util, cpu_used, cpu_total)
        tick = self.m.sampler.latest() if self.m.sampler is not None else None
        if tick is None:
            return
        gpu = [r for r in tick.readings if r.device.startswith(("cuda", "dla"))
               or r.source == "nvml"]
        labels = ["gpu_uuid"]
        families = {
            "util": gauge("nv_gpu_utilization", "GPU utilisation (0-1)", labels=labels),
            "power": gauge("nv_gpu_power_usage", "GPU power (W)", labels=labels),
            "used": gauge("nv_gpu_memory_used_bytes", "GPU memory used (bytes)", labels=labels),
            "total": gauge("nv_gpu_memory_total_bytes", "GPU memory in total (bytes)",
                           labels=labels),
            "energy": counter("nv_energy_consumption", "GPU energy since the server started (J)",
                              labels=labels),
        }
        for reading in gpu:
            key = [reading.device]
            if reading.util_pct is not None:
                families["util"].add_metric(key, reading.util_pct / 100.0)
            if reading.power_w is not None:
                families["power"].add_metric(key, reading.power_w)
            if reading.mem_used_bytes is not None:
                families["used"].add_metric(key, float(reading.mem_used_bytes))
            total = _gpu_memory_total(reading.device)
            if total is not None:
                families["total"].add_metric(key, float(total))
            if reading.energy_j is not None:
                families["energy"].add_metric(key, reading.energy_j)
        if gpu:
            yield from families.values()
        cpu_energy = [r for r in tick.readings if r.device == "cpu" and r.energy_j is not None]
        if cpu_energy:
            fam = counter("infermux_cpu_energy_joules", "CPU package energy (RAPL) since the "
                          "server started (J)")
            fam.add_metric([], sum(r.energy_j or 0.0 for r in cpu_energy))
            yield fam


def _gpu_memory_total(device: str) -> int | None:
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not device.startswith("cuda:") or not torch.cuda.is_available():
        return None
    try:
        return int(torch.cuda.get_device_properties(int(device.split(":")[1])).total_memory)
    except (RuntimeError, ValueError, AssertionError):
        return None
