"""`ServeMetrics` keeps plain tallies and writes them as Prometheus families when scraped.

The exposition must be what prometheus-client's own Counter, Gauge and Histogram objects write
for the same updates (names, `_total`, labels, cumulative buckets, sums), so scrapers and
dashboards see no difference; only the cost of an update changed.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from infermux.serve.metrics import _BATCH_BUCKETS, _LATENCY_BUCKETS_S, ServeMetrics


class _Runtime:
    """What the scrape-time collector reads of a runtime: no worker, nothing retried."""

    class _Stats:
        retried_items = 0

    def workers(self) -> list[Any]:
        return []

    def stats(self) -> Any:
        return self._Stats()

    def pipeline_stats(self) -> dict[str, Any]:
        return {}


class _Worker:
    def __init__(self, name: str, unit: str, model: str) -> None:
        self.name, self.unit, self.model = name, unit, model


def _samples(text: bytes, names: set[str]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name in names:
                out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def test_the_tallies_expose_what_prometheus_client_objects_would() -> None:
    m = ServeMetrics(_Runtime())  # type: ignore[arg-type]
    r = CollectorRegistry()
    mv = ["model", "version"]
    success = Counter("nv_inference_request_success", "", mv, registry=r)
    failure = Counter("nv_inference_request_failure", "", [*mv, "reason"], registry=r)
    count = Counter("nv_inference_count", "", mv, registry=r)
    execs = Counter("nv_inference_exec_count", "", mv, registry=r)
    request_us = Counter("nv_inference_request_duration_us", "", mv, registry=r)
    queue_us = Counter("nv_inference_queue_duration_us", "", mv, registry=r)
    infer_us = Counter("nv_inference_compute_infer_duration_us", "", mv, registry=r)
    pending = Gauge("nv_inference_pending_request_count", "", mv, registry=r)
    items = Gauge("infermux_items_in_flight", "", ["model"], registry=r)
    rejected = Counter("infermux_requests_rejected", "", ["model"], registry=r)
    latency = Histogram("infermux_request_duration_seconds", "", ["model"],
                        buckets=_LATENCY_BUCKETS_S, registry=r)
    sizes = Histogram("infermux_batch_size", "", ["model"], buckets=_BATCH_BUCKETS, registry=r)
    w_items = Counter("infermux_worker_items", "", ["worker", "unit", "model"], registry=r)

    # Durations on and beside the bucket bounds (a bound belongs to its own bucket).
    durations = [1_000_000, 1_000_001, 2_500_000, 14_999_999, 15_000_000, 70_000_000, 11 * 10**9]
    m.requests("a", True, durations[:4])
    m.request("a", True, durations[4])
    m.requests("b", True, durations[5:])
    m.requests("a", False, [5, 6])
    m.rejected("b", 3)
    m.pending("a", 2, 7)
    for model, n in (("a", 1), ("a", 4), ("a", 3), ("b", 1024), ("b", 2000)):
        m.batch(_Worker(f"{model}0", "cuda:0", model), model, n, queue_ns=1500 * n,
                compute_ns=2_000_000, infer_ns=1_000_000, input_ns=10_000, output_ns=5_000)
    for model, ds in (("a", durations[:5]), ("b", durations[5:])):
        for ns in ds:
            success.labels(model, "1").inc()
            request_us.labels(model, "1").inc(ns / 1e3)
            latency.labels(model).observe(ns / 1e9)
    failure.labels("a", "1", "BACKEND").inc(2)
    failure.labels("b", "1", "REJECTED").inc(3)
    rejected.labels("b").inc(3)
    pending.labels("a", "1").set(2)
    items.labels("a").set(7)
    for model, n in (("a", 1), ("a", 4), ("a", 3), ("b", 1024), ("b", 2000)):
        count.labels(model, "1").inc(n)
        execs.labels(model, "1").inc()
        queue_us.labels(model, "1").inc(1500 * n / 1e3)
        infer_us.labels(model, "1").inc(1_000_000 * n / 1e3)
        sizes.labels(model).observe(n)
        w_items.labels(f"{model}0", "cuda:0", model).inc(n)

    names = {"nv_inference_request_success_total", "nv_inference_request_failure_total",
             "nv_inference_count_total", "nv_inference_exec_count_total",
             "nv_inference_request_duration_us_total", "nv_inference_queue_duration_us_total",
             "nv_inference_compute_infer_duration_us_total", "nv_inference_pending_request_count",
             "infermux_items_in_flight", "infermux_requests_rejected_total",
             "infermux_request_duration_seconds_bucket", "infermux_request_duration_seconds_count",
             "infermux_request_duration_seconds_sum", "infermux_batch_size_bucket",
             "infermux_batch_size_count", "infermux_batch_size_sum", "infermux_worker_items_total"}
    ours, theirs = _samples(m.text(), names), _samples(generate_latest(r), names)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-12), key
    # The bound belongs to its bucket; past the last bound only +Inf counts it.
    assert ours["infermux_request_duration_seconds_bucket",
                (("le", "0.001"), ("model", "a"))] == 1.0
    assert ours["infermux_request_duration_seconds_bucket",
                (("le", "10.0"), ("model", "b"))] == 1.0
    assert ours["infermux_request_duration_seconds_bucket",
                (("le", "+Inf"), ("model", "b"))] == 2.0
