"""Load generation: seeded Poisson arrivals, scenario rules and validity, the peak search."""

import threading
import time

import numpy as np
import pytest

from infermux.load import LoadGenerator, QuerySampleLibrary, ScenarioResult, find_peak, poisson_schedule


def test_poisson_schedule_is_seeded_and_at_the_rate():
    a = poisson_schedule(500.0, 5000, seed=3)
    b = poisson_schedule(500.0, 5000, seed=3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, poisson_schedule(500.0, 5000, seed=4))
    gaps = np.diff(a)
    assert abs(gaps.mean() - 1 / 500) / (1 / 500) < 0.05
    # exponential gaps: the standard deviation equals the mean
    assert abs(gaps.std() / gaps.mean() - 1) < 0.07


def test_sample_library_is_reproducible():
    a = QuerySampleLibrary("m", (3, 4), 10, seed=1).data
    b = QuerySampleLibrary("m", (3, 4), 10, seed=1).data
    c = QuerySampleLibrary("other", (3, 4), 10, seed=1).data
    assert a.shape == (10, 3, 4) and a.dtype == np.float32
    assert np.array_equal(a, b) and not np.array_equal(a, c)


class ServiceSUT:
    """A small system under test: one server thread, fixed service time per sample."""

    def __init__(self, service_s=0.0005, fail_every=0):
        self.service_s = service_s
        self.fail_every = fail_every
        self.cond = threading.Condition()
        self.queue = []
        self.issued = []
        self.done = False
        self.max_outstanding = 0

    def start(self, on_complete):
        self.on_complete = on_complete
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def issue(self, queries):
        with self.cond:
            self.queue.extend(queries)
            self.issued.extend(queries)
            self.max_outstanding = max(self.max_outstanding, len(self.queue))
            self.cond.notify()

    def capacity_items(self, model):
        return 4

    def end(self):
        with self.cond:
            self.done = True
            self.cond.notify()

    def _serve(self):
        n = 0
        while True:
            with self.cond:
                while not self.queue and not self.done:
                    self.cond.wait(0.05)
                if not self.queue:
                    if self.done:
                        return
                    continue
                q = self.queue.pop(0)
            time.sleep(self.service_s * len(q.samples))
            n += 1
            ok = not (self.fail_every and n % self.fail_every == 0)
            self.on_complete([(q.id, len(q.samples))], ok, time.perf_counter_ns())


def settings(**kw):
    base = {"scenario": "offline", "min_duration_s": 0.2, "min_queries": 50, "max_duration_s": None,
            "samples_per_query": 8, "seed": 0, "rate_qps": None, "p99_bound_ms": None}
    base.update(kw)
    return base


def test_offline_keeps_a_bounded_backlog_and_meets_the_rule():
    sut = ServiceSUT()
    res = LoadGenerator(settings(), {"m": 1.0}).run(sut, {"m": 16})
    valid, notes = res.validity()
    assert valid, notes
    assert res.duration_s >= 0.2 and res.counts()["completed_items"] >= 50
    assert sut.max_outstanding <= 16  # max(16, 2 × capacity)
    assert all(0 <= s < 16 for q in sut.issued for s in q.samples)


def test_server_issues_at_the_requested_rate():
    sut = ServiceSUT(service_s=0.0002)
    res = LoadGenerator(settings(scenario="server", rate_qps=400.0, min_duration_s=1.0,
                                 min_queries=100), {"m": 1.0}).run(sut, {"m": 8})
    rec = res.record()
    assert rec["valid"], rec["validity_notes"]
    assert abs(rec["achieved_issue_rate_qps"] - 400) / 400 < 0.15
    assert 300 <= rec["issued"] <= 520
    assert rec["metric"] == "p99_ms"


def test_server_p99_bound_decides_validity():
    slow = ServiceSUT(service_s=0.004)  # 250/s capacity against 400/s: the queue grows
    res = LoadGenerator(settings(scenario="server", rate_qps=400.0, min_duration_s=0.5,
                                 min_queries=50, p99_bound_ms=5.0), {"m": 1.0}).run(slow, {"m": 8})
    valid, notes = res.validity()
    assert not valid and any("p99" in n for n in notes)


def test_single_stream_has_one_query_outstanding():
    sut = ServiceSUT()
    res = LoadGenerator(settings(scenario="single-stream", min_queries=30),
                        {"m": 1.0}).run(sut, {"m": 8})
    assert sut.max_outstanding == 1
    rec = res.record()
    assert rec["valid"] and rec["metric"] == "p90_ms" and rec["completed"] >= 30


def test_multi_stream_sends_samples_per_query():
    sut = ServiceSUT()
    res = LoadGenerator(settings(scenario="multi-stream", min_queries=10, samples_per_query=8),
                        {"m": 1.0}).run(sut, {"m": 8})
    assert {len(q.samples) for q in sut.issued} == {8}
    assert res.record()["metric"] == "p99_ms"


def test_failures_make_a_run_invalid_and_are_counted():
    sut = ServiceSUT(fail_every=5)
    res = LoadGenerator(settings(scenario="single-stream", min_queries=20),
                        {"m": 1.0}).run(sut, {"m": 8})
    counts = res.counts()
    assert counts["failed"] >= 4 and counts["unfinished"] == 0
    assert not res.validity()[0]


def test_max_duration_stops_and_invalidates():
    sut = ServiceSUT(service_s=0.002)
    res = LoadGenerator(settings(scenario="single-stream", min_duration_s=5, min_queries=10_000,
                                 max_duration_s=5.0), {"m": 1.0},
                        clock_ns=_fast_clock()).run(sut, {"m": 8})
    assert res.stopped_early and not res.validity()[0]


def _fast_clock():
    """A clock that runs 20× faster than real time."""
    start = time.perf_counter_ns()
    return lambda: start + (time.perf_counter_ns() - start) * 20


def test_mix_shifts_model_choice():
    gen = LoadGenerator(settings(scenario="server", rate_qps=500.0, min_duration_s=1.0,
                                 min_queries=10), {"a": 1.0, "b": 1.0},
                        mix=[{"at_s": 0, "shares": {"a": 9, "b": 1}},
                             {"at_s": 0.5, "shares": {"a": 0, "b": 1}}])
    assert gen.shares_at(0.1) == {"a": 0.9, "b": 0.1}
    assert gen.shares_at(0.7) == {"a": 0.0, "b": 1.0}
    sut = ServiceSUT(service_s=0.0)
    res = gen.run(sut, {"a": 4, "b": 4})
    t = (np.array(res.issued_ns) - res.start_ns) / 1e9
    models = np.array(res.query_model)
    # arrivals are chosen by their scheduled time; a busy machine may issue a few late
    assert (models[t < 0.45] == "a").mean() > 0.8
    assert (models[t > 0.6] == "b").mean() > 0.95


def test_find_peak_bisects_to_the_highest_valid_rate():
    def run(rate):
        res = ScenarioResult("server", settings(scenario="server", p99_bound_ms=10.0,
                                                min_duration_s=0, min_queries=1), ["m"])
        # a synthetic system: p99 = 1 ms below 600 qps, 50 ms above
        lat = 1_000_000 if rate <= 600 else 50_000_000
        res.query_model, res.query_samples, res.ok = ["m"] * 10, [1] * 10, [True] * 10
        res.issued_ns = list(range(10))
        res.completed_ns = [i + lat for i in range(10)]
        res.start_ns, res.end_ns = 0, 1_000_000_000
        return res

    peak = find_peak(run, upper_qps=1000.0, bound_ms=10.0, iterations=8)
    assert peak.peak_qps is not None and 590 <= peak.peak_qps <= 600
    rec = peak.record()
    assert rec["peak_fraction_of_offline"] == pytest.approx(peak.peak_qps / 1000.0)
    assert len(rec["trials"]) == 8


class _StepClock:
    """A clock that advances by the next of a cycle of steps (ms) at every reading."""

    def __init__(self, steps_ms):
        self.t = 0
        self.n = 0
        self.steps = steps_ms

    def __call__(self):
        self.t += self.steps[self.n % len(self.steps)] * 1_000_000
        self.n += 1
        return self.t


class _InstantSUT:
    """Completes every query at once, stamped by the generator's own clock."""

    def __init__(self, clock):
        self.clock = clock

    def start(self, on_complete):
        self.on_complete = on_complete

    def issue(self, queries):
        for q in queries:
            self.on_complete([(q.id, len(q.samples))], True, self.clock())

    def capacity_items(self, model):
        return 4

    def end(self):
        pass


@pytest.mark.parametrize("scenario", ["single-stream", "multi-stream", "offline"])
@pytest.mark.parametrize("first_step_ms", [1, 4, 13, 22])
def test_the_duration_rule_is_judged_at_the_last_completion(scenario, first_step_ms):
    # The generator reads its clock after a completion before it checks the rule; a query that
    # completes just under min_duration_s must not end the run, which would then read too short.
    clock = _StepClock([first_step_ms, 1, 2])
    res = LoadGenerator(settings(scenario=scenario, min_duration_s=0.3, min_queries=5),
                        {"m": 1.0}, clock_ns=clock).run(_InstantSUT(clock), {"m": 8})
    valid, notes = res.validity()
    assert valid, notes
    assert res.duration_s >= 0.3
