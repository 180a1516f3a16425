"""The load generator's latency rule and the peak search's ends.

A server query's latency runs from its scheduled arrival (as MLPerf LoadGen measures), so a
generator that falls behind cannot hide its lag; a peak search with nothing to search, or with
no rate that holds the bound, ends with a reason.
"""

from __future__ import annotations

import pytest

from infermux.load import LoadGenerator, ScenarioResult, find_peak
from tests.conftest import MS, Clock


class ManualClock(Clock):
    """Time that moves only when someone sleeps or works: the generator's lag is exact."""

    def sleep(self, seconds: float) -> None:
        self.ns += max(1, int(seconds * 1e9))


class BusySUT:
    """Completes every query the moment it is issued, then keeps the generator away for
    `busy_ms` (as workers holding the GIL near the peak do): the generator falls behind."""

    def __init__(self, clock: ManualClock, busy_ms: float) -> None:
        self.clock = clock
        self.busy_ns = int(busy_ms * MS)

    def start(self, on_complete):
        self.on_complete = on_complete

    def issue(self, queries):
        self.on_complete([(q.id, len(q.samples)) for q in queries], True, self.clock())
        self.clock.ns += self.busy_ns

    def capacity_items(self, model):
        return 4

    def end(self):
        pass


def _server(**kw):
    base = {"scenario": "server", "rate_qps": 200.0, "min_duration_s": 1.0, "min_queries": 100,
            "max_duration_s": None, "samples_per_query": 1, "seed": 0, "p99_bound_ms": 10.0}
    base.update(kw)
    return base


def test_a_lagging_generator_shows_in_the_latency_from_the_scheduled_arrival():
    clock = ManualClock()
    gen = LoadGenerator(_server(), {"m": 1.0}, clock_ns=clock, sleep=clock.sleep)
    res = gen.run(BusySUT(clock, busy_ms=20.0), {"m": 8})
    rec = res.record()
    # Every query completed at its issue: measured from the issue, the system looks instant.
    assert rec["latency_from_issue"]["p99_ms"] == pytest.approx(0.0, abs=1e-6)
    # But the generator issued them up to 20 ms after they were due: that is their latency.
    assert rec["issue_lag"]["p99_ms"] > 15.0
    assert rec["latency"]["p99_ms"] > 15.0
    assert rec["latency"]["p99_ms"] == pytest.approx(rec["issue_lag"]["p99_ms"], abs=1e-6)
    assert rec["metric_value_ms"] == rec["latency"]["p99_ms"]
    valid, notes = res.validity()
    assert not valid and any("p99" in n and "bound 10" in n for n in notes)
    # The lag is the issue stamp minus the schedule, never negative.
    assert min(res.issue_lag_ns()) >= 0
    assert all(i >= d for i, d in zip(res.issued_ns, res.scheduled_ns, strict=True))


def test_a_generator_on_time_measures_the_same_either_way():
    clock = ManualClock()
    gen = LoadGenerator(_server(rate_qps=50.0), {"m": 1.0}, clock_ns=clock, sleep=clock.sleep)
    rec = gen.run(BusySUT(clock, busy_ms=0.0), {"m": 8}).record()
    assert rec["valid"], rec["validity_notes"]
    assert rec["issue_lag"]["max_ms"] < 0.01
    assert rec["latency"]["p99_ms"] == pytest.approx(rec["latency_from_issue"]["p99_ms"], abs=0.01)


def test_query_ids_start_at_the_base_and_other_ids_are_ignored():
    clock = ManualClock()
    base = 5 << 40

    class StaleThenServe(BusySUT):
        def issue(self, queries):
            # A late completion of an earlier trial's query with the same number comes first.
            self.on_complete([(q.id - base, 1) for q in queries], True, self.clock())
            assert all(q.id >= base for q in queries)
            super().issue(queries)

    gen = LoadGenerator(_server(rate_qps=100.0, min_queries=20, min_duration_s=0.2), {"m": 1.0},
                        clock_ns=clock, sleep=clock.sleep, id_base=base)
    res = gen.run(StaleThenServe(clock, busy_ms=0.0), {"m": 8})
    counts = res.counts()
    assert counts["completed"] == counts["issued"] >= 20


def _result(p99_ms: float) -> ScenarioResult:
    res = ScenarioResult("server", _server(min_duration_s=0, min_queries=1), ["m"])
    res.query_model, res.query_samples, res.ok = ["m"] * 10, [1] * 10, [True] * 10
    res.issued_ns = list(range(10))
    res.completed_ns = [i + int(p99_ms * MS) for i in range(10)]
    res.start_ns, res.end_ns = 0, 1_000_000_000
    return res


def test_find_peak_with_no_offline_throughput_runs_nothing_and_says_why():
    calls = []
    peak = find_peak(lambda rate: calls.append(rate) or _result(1.0), upper_qps=0.0, bound_ms=10.0)
    assert calls == []
    assert peak.peak_qps is None
    assert "offline throughput is 0" in peak.record()["reason"]


def test_find_peak_with_no_valid_rate_says_which_rate_came_closest():
    peak = find_peak(lambda rate: _result(50.0), upper_qps=1000.0, bound_ms=10.0, iterations=4)
    rec = peak.record()
    assert rec["peak_qps"] is None and len(rec["trials"]) == 4
    assert "no rate held p99 <= 10 ms" in rec["reason"] and "62.5 qps" in rec["reason"]
    assert find_peak(lambda rate: _result(1.0), upper_qps=1000.0, bound_ms=10.0).reason is None
