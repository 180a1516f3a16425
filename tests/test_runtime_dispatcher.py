"""The dispatcher and placement rules, driven by a fake clock (deterministic, no threads)."""

from infermux.load.base import Query
from infermux.runtime import Batch, Dispatcher, LatencyEstimate, WorkerState, batch_ready, slo_take
from infermux.runtime.placement import ModelLoad, WorkerView, bucket_holding, rebalance

from .conftest import MS, Clock


def worker(wid, model="m", buckets=(1, 2, 4, 8), est_ms=None, serves=None, unit=None):
    est = LatencyEstimate(0.5)
    for b, ms in (est_ms or {}).items():
        est.update(b, ms * MS)
    return WorkerState(wid, f"w{wid}", unit or f"cpu:{wid}", model, list(buckets),
                       set(serves or {model}), est)


def make(clock, *workers_, delay_ms=5.0, **kw):
    d = Dispatcher(sorted({m for w in workers_ for m in w.serves}), max_queue_delay_ns=int(delay_ms * MS),
                   clock_ns=clock, **kw)
    done = []
    d.set_completion(lambda pairs, ok, t: done.extend((q, n, ok) for q, n in pairs))
    for w in workers_:
        d.add_worker(w)
    return d, done


def queries(n, model="m", start=0, samples=1):
    return [Query(start + i, model, tuple(range(samples))) for i in range(n)]


def test_batch_ready_rule():
    assert batch_ready(8, 8, 0, 0, 5 * MS, False) == (True, 0)
    assert batch_ready(3, 8, 0, 2 * MS, 5 * MS, False) == (False, 3 * MS)
    assert batch_ready(3, 8, 0, 5 * MS, 5 * MS, False) == (True, 0)
    assert batch_ready(1, 8, 0, 0, 5 * MS, True) == (True, 0)


def test_dynamic_batching_waits_for_the_delay_then_takes_what_is_there():
    clock = Clock()
    w = worker(0)
    d, done = make(clock, w)
    d.submit(queries(3))
    wait = d.poll(w)
    assert isinstance(wait, float) and abs(wait - 0.005) < 1e-9
    clock.advance(2)
    d.submit(queries(2, start=3))
    clock.advance(3)  # the oldest has now waited 5 ms
    batch = d.poll(w)
    assert isinstance(batch, Batch) and len(batch.items) == 5 and batch.bucket == 8
    d.finished(w, batch, clock(), clock() + 4 * MS)
    assert sorted(q for q, _, _ in done) == [0, 1, 2, 3, 4]


def test_a_busy_workers_queue_delay_is_counted_to_the_launch():
    """A worker asking for the batch to gather under its running one (`launch_ns`: when that
    one ends): items whose delay is over by then go now; those whose delay outlasts it wait,
    and the wait is counted from the launch. Without `launch_ns` the delay counts to now."""
    clock = Clock()
    w = worker(0)
    d, _ = make(clock, w)
    d.submit(queries(3))
    clock.advance(1)
    assert isinstance(d.poll(w), float)  # 1 ms of 5: not yet
    wait = d.poll(w, launch_ns=clock() + 2 * MS)  # launched 3 ms in: still 2 ms short
    assert isinstance(wait, float) and abs(wait - 0.002) < 1e-9
    assert isinstance(d.poll(w, launch_ns=clock() - MS), float)  # a past launch is now
    batch = d.poll(w, launch_ns=clock() + 4 * MS)  # launched 5 ms in: the delay is spent
    assert isinstance(batch, Batch) and len(batch.items) == 3


def test_a_gpu_batch_runs_at_a_larger_bucket_measured_faster():
    """On a GPU a bucket measured well over a larger one (an uncompiled small bucket beside
    compiled large ones) is passed over for the larger; within a quarter, unmeasured, or on a
    CPU, the smallest holding bucket stays."""
    assert bucket_holding([1, 2, 4, 8], 3) == 4  # no estimate: the smallest that holds them
    clock = Clock()
    est = {1: 1.0, 2: 2.0, 4: 10.0, 8: 5.0}
    w = worker(0, est_ms=est, unit="cuda:0/fp16")
    d, _ = make(clock, w)
    d.submit(queries(3))
    clock.advance(5)
    batch = d.poll(w)
    assert isinstance(batch, Batch) and len(batch.items) == 3 and batch.bucket == 8
    assert w.bucket_for(2) == 2 and w.bucket_for(1) == 1  # the small ones are fast
    assert worker(1, est_ms=est).bucket_for(3) == 4  # a CPU worker: by size alone
    close = worker(2, est_ms={4: 6.0, 8: 5.0}, unit="cuda:0")  # not a quarter faster
    assert close.bucket_for(3) == 4
    unmeasured = worker(3, est_ms={8: 5.0}, unit="cuda:0")  # 4 never measured: not passed over
    assert unmeasured.bucket_for(3) == 4
    idle = worker(4, est_ms={4: 10.0, 8: 5.0}, unit="cuda:0")
    assert idle.view().finish_ns(3, 0) == 5.0 * MS  # placement sees the same choice


def test_full_batch_goes_at_once_and_the_rest_waits():
    clock = Clock()
    w = worker(0)
    d, _ = make(clock, w)
    d.submit(queries(11))
    first = d.poll(w)
    assert isinstance(first, Batch) and len(first.items) == 8
    d.finished(w, first, clock(), clock())
    assert isinstance(d.poll(w), float)  # three left, delay not spent
    d.end()  # the load generator is done: flush
    last = d.poll(w)
    assert isinstance(last, Batch) and len(last.items) == 3 and last.bucket == 4


def test_phases_split_queueing_from_batching_wait():
    clock = Clock()
    w = worker(0)
    d, _ = make(clock, w)
    d.submit(queries(1))
    clock.advance(5)
    batch = d.poll(w)
    assert isinstance(batch, Batch)
    # the worker was free before the item came: no queueing, 5 ms of batching wait
    assert batch.ready_ns[0] == batch.items[0].enqueued_ns
    assert batch.taken_ns - batch.ready_ns[0] == 5 * MS


def test_pull_lets_the_worker_that_comes_back_first_take_more():
    clock = Clock()
    fast, slow = worker(0, buckets=(4,)), worker(1, buckets=(4,))
    d, _ = make(clock, fast, slow)
    d.submit(queries(40))
    taken = {0: 0, 1: 0}
    slow_batch = d.poll(slow)
    taken[1] += len(slow_batch.items)
    for _ in range(9):  # the fast one finishes 9 batches while the slow one runs one
        b = d.poll(fast)
        if not isinstance(b, Batch):
            break
        taken[0] += len(b.items)
        d.finished(fast, b, clock(), clock() + MS)
    assert taken == {0: 36, 1: 4}


def test_round_robin_assigns_blindly():
    clock = Clock()
    a, b = worker(0, buckets=(1,)), worker(1, buckets=(1,))
    d, _ = make(clock, a, b, policy="round_robin")
    d.submit(queries(10))
    assert len(a.own_queue) == 5 and len(b.own_queue) == 5
    assert d.queued("m") == 10


def test_slo_take_declines_when_a_faster_worker_frees_in_time():
    fast = WorkerView(0, [1, 8], _est({1: 2, 8: 10}))
    slow = WorkerView(1, [8], _est({8: 60}))
    now = 0
    deadline = 30 * MS
    assert slo_take(slow, [fast], 1, deadline, now) == 0  # leave it to the fast one
    assert slo_take(fast, [slow], 5, deadline, now) == 5
    # the fast one is busy for 40 ms: nobody meets the bound, so the slow one takes it
    busy = WorkerView(0, [1, 8], _est({1: 2, 8: 10}), busy_until_ns=40 * MS)
    assert slo_take(slow, [busy], 3, deadline, now) == 3
    # a smaller batch that meets the bound is preferred to declining
    mid = WorkerView(2, [1, 2, 4, 8], _est({1: 5, 2: 8, 4: 20, 8: 50}))
    assert slo_take(mid, [fast], 8, 25 * MS, now) == 4


def _est(ms):
    e = LatencyEstimate(0.5)
    for b, v in ms.items():
        e.update(b, v * MS)
    return e


def test_latency_estimate_moving_average_and_scaling():
    e = LatencyEstimate(0.5)
    assert e.expected_ns(4) == 0.0
    e.update(4, 10 * MS)
    e.update(4, 20 * MS)
    assert e.expected_ns(4) == 15 * MS
    assert e.expected_ns(8) == 30 * MS  # scaled from the nearest measured bucket
    assert e.expected_ns(2) == 15 * MS  # a smaller bucket: the measured time, an upper bound


def test_dispatcher_applies_the_slo_rule():
    clock = Clock()
    fast = worker(0, buckets=(1,), est_ms={1: 2})
    slow = worker(1, buckets=(8,), est_ms={8: 60})
    d, _ = make(clock, fast, slow, latency_bound_ns={"m": 30 * MS})
    d.submit(queries(1))
    clock.advance(6)
    assert isinstance(d.poll(slow), float)  # declined
    batch = d.poll(fast)
    assert isinstance(batch, Batch) and len(batch.items) == 1


def test_a_failed_worker_loses_no_item():
    clock = Clock()
    a, b = worker(0, buckets=(4,)), worker(1, buckets=(4,))
    d, done = make(clock, a, b, max_retries=1)
    d.submit(queries(8))
    batch_a = d.poll(a)
    d.failed(a, [batch_a], RuntimeError("kernel failure"))
    assert not a.alive and "kernel failure" in a.error
    assert d.retried == 4 and d.queued("m") == 8
    got = []
    while isinstance(bb := d.poll(b), Batch):
        got += [it.query for it in bb.items]
        d.finished(b, bb, clock(), clock())
    assert sorted(got) == list(range(8))
    assert all(ok for _, _, ok in done)
    # the last worker fails too: what it held and what is queued are reported failed, not lost
    d.submit(queries(3, start=100))
    assert not isinstance(d.poll(b), Batch)  # 3 < 4 queued: waiting for the delay
    d.failed(b, [], RuntimeError("again"))
    failed = sorted(q for q, _, ok in done if not ok)
    assert failed == [100, 101, 102]
    d.submit(queries(1, start=200))  # no live worker: failed at once
    assert (200, 1, False) in done


def test_retries_are_bounded():
    clock = Clock()
    a, b, c = worker(0, buckets=(2,)), worker(1, buckets=(2,)), worker(2, buckets=(2,))
    d, done = make(clock, a, b, c, max_retries=1)
    d.submit(queries(2))
    d.failed(a, [d.poll(a)], RuntimeError("x"))
    d.failed(b, [d.poll(b)], RuntimeError("y"))  # second failure of the same items: give up
    assert sorted((q, ok) for q, _, ok in done) == [(0, False), (1, False)]
    assert d.failed_items == 2


def test_multi_sample_queries_complete_per_query():
    clock = Clock()
    w = worker(0, buckets=(4,))
    d, done = make(clock, w)
    d.submit(queries(1, samples=8))
    for _ in range(2):
        b = d.poll(w)
        d.finished(w, b, clock(), clock())
    assert done == [(0, 4, True), (0, 4, True)]


def test_dynamic_placement_borrows_for_a_growing_queue():
    clock = Clock()
    a = worker(0, model="a", buckets=(4,), serves={"a", "b"})
    b = worker(1, model="b", buckets=(4,), serves={"a", "b"})
    d, _ = make(clock, a, b, dynamic=True)
    d.submit(queries(12, model="a"))
    first = d.poll(a)
    assert first.model == "a"
    stolen = d.poll(b)  # b's own queue is empty and a's has a full batch waiting
    assert isinstance(stolen, Batch) and stolen.model == "a"
    assert any(e["event"] == "serve" for e in d.events) is False  # first batch: no change yet
    d.submit(queries(1, model="b", start=50))
    clock.advance(6)
    d.finished(b, stolen, clock(), clock())
    own = d.poll(b)
    assert own.model == "b"
    assert [e["to"] for e in d.events if e["event"] == "serve"] == ["b"]


def test_static_placement_never_borrows():
    clock = Clock()
    a = worker(0, model="a", buckets=(4,), serves={"a", "b"})
    b = worker(1, model="b", buckets=(4,), serves={"a", "b"})
    d, _ = make(clock, a, b, dynamic=False)
    d.submit(queries(12, model="a"))
    assert not isinstance(d.poll(b), Batch)


def test_rebalance_moves_an_idle_worker_to_the_longest_backlog():
    loads = [ModelLoad("a", queued=400, workers=[0], capacity_per_s=1000),
             ModelLoad("b", queued=0, workers=[1, 2], capacity_per_s=2000)]
    move = rebalance(loads, {1: 0.3, 2: 0.1}, {1: {"a", "b"}, 2: {"a", "b"}})
    assert move is not None and (move.worker, move.src, move.dst) == (1, "b", "a")
    # a donor keeps its last worker; a short backlog moves nothing
    assert rebalance([ModelLoad("a", 400, [0], 1000), ModelLoad("b", 0, [1], 1000)],
                     {1: 1.0}, {1: {"a", "b"}}) is None
    assert rebalance([ModelLoad("a", 10, [0], 1000), ModelLoad("b", 0, [1, 2], 1000)],
                     {1: 1.0}, {1: {"a", "b"}}) is None


def test_tail_take_keeps_a_slow_unit_off_the_last_items():
    from infermux.runtime.placement import tail_take

    fast = WorkerView(0, [8], _est({8: 8}))  # one item per ms
    slow = WorkerView(1, [8], _est({8: 80}))
    assert not tail_take(slow, [fast], 8, 16, 0)  # the fast one clears 16 items in 16 ms
    assert tail_take(slow, [fast], 8, 800, 0)  # 800 items: the slow batch (80 ms) helps
    twin = WorkerView(2, [8], _est({8: 8}))
    assert tail_take(twin, [fast], 8, 8, 0)  # equal units share the tail
    # one item left: the fast unit takes it even though the slow one's rate looks high
    assert tail_take(fast, [slow], 1, 1, 0)
    assert not tail_take(slow, [fast], 1, 1, 0)


def test_dispatcher_drain_leaves_the_tail_to_the_fast_unit():
    clock = Clock()
    fast = worker(0, buckets=(8,), est_ms={8: 8})
    slow = worker(1, buckets=(8,), est_ms={8: 80})
    d, _ = make(clock, fast, slow)
    d.submit(queries(16))
    d.end()
    assert not isinstance(d.poll(slow), Batch)
    assert isinstance(d.poll(fast), Batch)



def test_dispatcher_drain_never_leaves_the_last_item_behind():
    clock = Clock()
    fast = worker(0, buckets=(1,), est_ms={1: 2.4})
    slow = worker(1, buckets=(32,), est_ms={32: 75})  # a high rate, but 75 ms per batch
    d, _ = make(clock, fast, slow)
    d.submit(queries(1))
    d.end()
    assert not isinstance(d.poll(slow), Batch)
    last = d.poll(fast)
    assert isinstance(last, Batch) and len(last.items) == 1
