"""Deadline batching: partial batches sized to the latency bound, driven by a fake clock."""

import pytest

from infermux.load.base import Query
from infermux.runtime import Batch, Dispatcher, LatencyEstimate, WorkerState
from infermux.runtime.dispatcher import deadline_take
from infermux.runtime.plan import parse_plan

from .conftest import MS, Clock

#: Measured batch latency per bucket (ms): a larger bucket costs more, per batch.
EST_MS = {1: 2.0, 2: 3.0, 4: 4.0, 8: 6.0}
BOUND_MS = 20.0  # planned within 0.8 of it: the oldest item's deadline is 16 ms after arrival


def worker(wid: int, buckets=(1, 2, 4, 8)) -> WorkerState:
    est = LatencyEstimate(0.5)
    for b, ms in EST_MS.items():
        est.update(b, ms * MS, "m")
    return WorkerState(wid, f"w{wid}", f"cuda:{wid}", "m", list(buckets), {"m"}, est)


def make(clock: Clock, *workers: WorkerState, bound_ms: float | None = BOUND_MS,
         batching: str = "deadline", delay_ms: float = 2.0) -> Dispatcher:
    d = Dispatcher(["m"], max_queue_delay_ns=int(delay_ms * MS), clock_ns=clock,
                   deadline_ns={"m": None if bound_ms is None else int(bound_ms * MS)},
                   batching=batching)
    d.set_completion(lambda pairs, ok, t: None)
    for w in workers:
        d.add_worker(w)
    return d


def queries(n: int, start: int = 0) -> list[Query]:
    return [Query(start + i, "m", (i,)) for i in range(n)]


def busy_other(clock: Clock, d: Dispatcher, other: WorkerState) -> Batch:
    """Give `other` a batch to run (so the model is not idle), returned unfinished."""
    d.submit(queries(1, start=1000))
    batch = d.poll(other)
    assert isinstance(batch, Batch) and len(batch.items) == 1  # alone and idle: at once
    return batch


def test_waits_while_safe_then_launches_the_bucket_that_meets_the_oldest_deadline():
    clock = Clock()
    a, b = worker(0), worker(1)
    d = make(clock, a, b)
    busy_other(clock, d, b)
    d.submit(queries(3))
    # 3 items ride in bucket 4 (4 ms): they may start as late as 16 - 4 = 12 ms from now.
    wait = d.poll(a)
    assert isinstance(wait, float) and wait == pytest.approx(0.012)
    clock.advance(5)
    d.submit(queries(2, start=3))
    # 5 items need bucket 8 (6 ms): latest start 10 ms after the oldest came, 5 ms from now.
    wait = d.poll(a)
    assert isinstance(wait, float) and wait == pytest.approx(0.005)
    clock.advance(5)
    batch = d.poll(a)
    assert isinstance(batch, Batch) and len(batch.items) == 5 and batch.bucket == 8
    oldest = batch.items[0].enqueued_ns
    assert a.busy_until_ns <= oldest + int(0.8 * BOUND_MS * MS)


def test_past_the_larger_buckets_start_the_largest_full_bucket_that_meets_it_goes():
    clock = Clock()
    a, b = worker(0), worker(1)
    d = make(clock, a, b)
    busy_other(clock, d, b)
    d.submit(queries(3))
    clock.advance(11)  # past bucket 8's latest start (10 ms), before bucket 4's (12 ms)
    d.submit(queries(2, start=3))
    batch = d.poll(a)
    assert isinstance(batch, Batch) and [it.query for it in batch.items] == [0, 1, 2, 3]
    assert batch.bucket == 4 and d.queued("m") == 1  # the newest waits for the next batch


def test_the_batch_a_worker_computes_counts_in_the_deadline():
    clock = Clock()
    a, b = worker(0), worker(1)
    d = make(clock, a, b)
    busy_other(clock, d, b)
    a.in_flight, a.busy_until_ns = 1, clock() + 13 * MS  # a frees up in 13 ms
    d.submit(queries(3))
    # Starting at 13 ms, bucket 4 would end at 17 > 16: a takes now what still fits, bucket 2.
    batch = d.poll(a)
    assert isinstance(batch, Batch) and len(batch.items) == 2 and batch.bucket == 2


def test_a_burst_fills_the_largest_bucket_at_once():
    clock = Clock()
    a, b = worker(0), worker(1)
    d = make(clock, a, b)
    busy_other(clock, d, b)
    d.submit(queries(20))
    batch = d.poll(a)
    assert isinstance(batch, Batch) and len(batch.items) == 8 and batch.bucket == 8


def test_a_lone_query_at_light_load_goes_at_once():
    clock = Clock()
    a, b = worker(0), worker(1)
    d = make(clock, a, b)
    d.submit(queries(1))
    batch = d.poll(a)  # no batch of the model is running: waiting would only add latency
    assert isinstance(batch, Batch) and len(batch.items) == 1 and batch.bucket == 1
    assert batch.taken_ns == batch.items[0].enqueued_ns


def test_a_free_worker_waits_only_where_an_item_is_expected_to_join():
    for gap_ms, waits in [(30.0, False), (2.0, True)]:
        clock = Clock()
        a, b = worker(0), worker(1)
        d = make(clock, a, b)
        busy_other(clock, d, b)  # one arrival; b computes it, so the model is not idle
        clock.advance(gap_ms)
        d.submit(queries(1))  # the next arrival, gap_ms later: the model's mean gap so far
        assert d.arrival_gap_ns["m"] == pytest.approx(gap_ms * MS)
        # Bucket 1 (2 ms) may start as late as 14 ms from now. At one arrival every 30 ms no
        # item is expected by then: a, free, takes the lone item now. Every 2 ms one is.
        got = d.poll(a)
        if waits:
            assert isinstance(got, float) and got == pytest.approx(0.014)
        else:
            assert isinstance(got, Batch) and len(got.items) == 1 and got.bucket == 1
            assert got.taken_ns == got.items[0].enqueued_ns


def test_a_busy_worker_or_an_unknown_rate_waits_as_before():
    def expected(bucket: int) -> float:
        return EST_MS[bucket] * MS

    far = 100.0 * MS  # arrivals far apart
    # Free now, rate unknown: wait until the latest start (16 - 4 ms for bucket 4).
    assert deadline_take(3, [1, 2, 4, 8], expected, 0, 0, 16 * MS, idle=False,
                         flush=False) == (0, 12 * MS)
    # Free now, arrivals far apart: go now.
    assert deadline_take(3, [1, 2, 4, 8], expected, 0, 0, 16 * MS, idle=False,
                         flush=False, arrival_gap_ns=far) == (3, 0)
    # Busy until 5 ms: the batch cannot start before then anyway, so it still waits.
    assert deadline_take(3, [1, 2, 4, 8], expected, 0, 5 * MS, 16 * MS, idle=False,
                         flush=False, arrival_gap_ns=far) == (0, 12 * MS)


def test_a_new_trial_forgets_the_arrival_gaps():
    clock = Clock()
    a = worker(0)
    d = make(clock, a)
    d.submit(queries(1))
    clock.advance(40)
    d.submit(queries(1, start=1))
    assert d.arrival_gap_ns == {"m": pytest.approx(40 * MS)}
    d.begin_trial(settle_s=0.0)
    assert d.arrival_gap_ns == {}
    clock.advance(5)
    d.submit(queries(2, start=2))  # together: a gap of 0, the first arrival of the trial
    assert d.arrival_gap_ns == {"m": 0.0}


@pytest.mark.parametrize("how", ["no bound", "queue_delay rule"])
def test_without_a_bound_the_queue_delay_rules_as_before(how):
    clock = Clock()
    a, b = worker(0), worker(1)
    d = (make(clock, a, b, bound_ms=None) if how == "no bound"
         else make(clock, a, b, batching="queue_delay"))
    d.submit(queries(3))
    wait = d.poll(a)  # even with every worker idle: take_when_idle is off, as before
    assert isinstance(wait, float) and wait == pytest.approx(0.002)
    clock.advance(2)
    batch = d.poll(a)
    assert isinstance(batch, Batch) and len(batch.items) == 3 and batch.bucket == 4


def test_the_measured_launch_overhead_moves_the_latest_start_earlier():
    clock = Clock()
    a, b = worker(0), worker(1)
    d = make(clock, a, b)
    d.submit(queries(1))
    first = d.poll(a)
    assert isinstance(first, Batch)
    # Launched 1 ms after it was taken (the gather), 2 ms on the device.
    d.finished(a, first, clock() + MS, clock() + 3 * MS)
    assert a.launch_ns == pytest.approx(MS)
    busy_other(clock, d, b)
    d.submit(queries(3, start=1))
    wait = d.poll(a)  # 16 - (1 + 4) ms
    assert isinstance(wait, float) and wait == pytest.approx(0.011)


def test_deadline_take_late_takes_everything_queued():
    def expected(bucket: int) -> float:
        return EST_MS[bucket] * MS

    # No batch can meet a deadline already past: take what is queued, for throughput.
    assert deadline_take(3, [1, 2, 4, 8], expected, 20 * MS, 20 * MS, 10 * MS, idle=False,
                         flush=False) == (3, 0)
    assert deadline_take(2, [1, 2, 4, 8], expected, 0, 0, 16 * MS, idle=False,
                         flush=True) == (2, 0)


def test_a_plan_waits_its_queue_delay_by_default_and_may_ask_for_deadline_batching():
    base = {"name": "p", "models": [{"name": "m", "model": "mobilenet_v3_small",
                                     "replicas": [{"unit": "cpu:0", "batch": 8}]}],
            "load": {"scenario": "server", "p99_bound_ms": 50}}
    assert parse_plan(base).dispatcher.batching == "queue_delay"
    new = parse_plan({**base, "dispatcher": {"batching": "deadline"}})
    assert new.dispatcher.batching == "deadline"
    with pytest.raises(Exception, match="batching"):
        parse_plan({**base, "dispatcher": {"batching": "soon"}})


def test_a_slow_querys_time_is_split_into_its_phases():
    from infermux.engines.base import BatchTiming
    from infermux.runtime.metrics import Recorder, _phases

    clock = Clock()
    a = worker(0)
    d = make(clock, a)
    rec = Recorder(clock_ns=clock)
    d.on_batch_done = rec.on_batch_done
    d.submit(queries(1))
    clock.advance(1)
    batch = d.poll(a)
    assert isinstance(batch, Batch)
    taken = clock()
    # gathered for 2 ms, 5 ms from launch to collected of which the device accounts for 3 ms,
    # handed to the dispatcher 4 ms after its completion stamp
    clock.advance(11)
    d.finished(a, batch, taken + 2 * MS, taken + 7 * MS,
               BatchTiming(5 * MS, h2d_ns=MS, compute_ns=2 * MS))
    ph = _phases(rec.records)
    assert ph.batching_wait.p50_ms == pytest.approx(1.0)
    assert ph.compute.p50_ms == pytest.approx(7.0)
    assert ph.launch.p50_ms == pytest.approx(2.0)
    assert ph.run.p50_ms == pytest.approx(5.0)
    assert ph.host_overhead.p50_ms == pytest.approx(2.0)
    assert ph.handoff.p50_ms == pytest.approx(4.0)
