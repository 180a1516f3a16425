"""Dispatcher correctness: trials that cannot leak into each other, moves that never run an item
through the wrong network, latency estimates per model. Driven by a fake clock, no threads."""

from __future__ import annotations

import pytest

from infermux.errors import UsageError
from infermux.load.base import Query
from infermux.runtime import Batch, Dispatcher, LatencyEstimate, WorkerState, parse_plan

from .conftest import MS, Clock, invoke_cli


def worker(wid, model="m", buckets=(1, 2, 4), serves=None, est=None):
    return WorkerState(wid, f"w{wid}", f"cpu:{wid}", model, list(buckets), set(serves or {model}),
                       est or LatencyEstimate(0.5))


def make(clock, *workers, **kw):
    models = sorted({m for w in workers for m in w.serves})
    d = Dispatcher(models, max_queue_delay_ns=0, clock_ns=clock, **kw)
    done: list[tuple[int, int, bool]] = []
    d.set_completion(lambda pairs, ok, t: done.extend((q, n, ok) for q, n in pairs))
    for w in workers:
        d.add_worker(w)
    return d, done


def queries(n, model="m", start=0):
    return [Query(start + i, model, (i,)) for i in range(n)]


# -- trials ----------------------------------------------------------------------------------


def test_a_stale_completion_of_an_earlier_trial_is_ignored():
    clock = Clock()
    w = worker(0, buckets=(2,))
    d, old = make(clock, w)
    recorded = []
    d.on_batch_done = lambda wk, b, s, e, t: recorded.append([it.query for it in b.items])
    d.submit(queries(5))
    late = d.poll(w)  # trial 1's batch, still running when trial 1 gives up its drain
    assert isinstance(late, Batch) and [it.query for it in late.items] == [0, 1]
    # The next trial starts: trial 1's queued items are dropped, and it numbers from 0 again.
    assert d.begin_trial(settle_s=0) == 3
    new: list[tuple[int, int, bool]] = []
    d.set_completion(lambda pairs, ok, t: new.extend((q, n, ok) for q, n in pairs))
    d.submit(queries(2))
    d.finished(w, late, clock(), clock() + MS)  # the late batch ends during the new trial
    assert new == [] and recorded == []  # neither credited to query 0 and 1 nor recorded
    assert w.in_flight == 0  # the worker is free again
    batch = d.poll(w)
    assert isinstance(batch, Batch) and all(it.trial == d.trial for it in batch.items)
    d.finished(w, batch, clock(), clock() + MS)
    assert sorted(new) == [(0, 1, True), (1, 1, True)] and recorded == [[0, 1]]
    assert old == []


def test_each_trial_counts_its_own_retries_and_failures():
    clock = Clock()
    a, b = worker(0, buckets=(2,)), worker(1, buckets=(2,))
    d, _ = make(clock, a, b, max_retries=1)
    d.submit(queries(2))
    d.failed(a, [d.poll(a)], RuntimeError("x"))
    assert d.retried == 2
    held = d.poll(b)
    d.begin_trial(settle_s=0)
    assert (d.retried, d.failed_items) == (0, 0)
    # A batch of the earlier trial that fails now is neither retried nor failed in this one.
    d.failed(b, [held], RuntimeError("y"))
    assert (d.retried, d.failed_items) == (0, 0)


# -- round robin and moves -------------------------------------------------------------------


def test_round_robin_with_dynamic_placement_is_refused_with_the_fix():
    data = {"models": [{"name": "a", "model": "resnet18", "replicas": [{"unit": "cpu:0"}]}],
            "dispatcher": {"policy": "round_robin"}, "placement": "dynamic"}
    with pytest.raises(UsageError) as info:
        parse_plan(data)
    message = str(info.value)
    assert "\n" not in message
    assert "dispatcher.policy 'round_robin'" in message and "placement 'dynamic'" in message
    assert "use policy: pull with placement: dynamic" in message
    parse_plan({**data, "placement": "static"})  # each alone is fine
    parse_plan({**data, "dispatcher": {"policy": "pull"}})


def test_plan_check_names_the_fields_in_one_line(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("models:\n  - {name: a, model: resnet18, replicas: [{unit: cpu:0}]}\n"
                    "dispatcher: {policy: round_robin}\nplacement: dynamic\n")
    run = invoke_cli("plan", "--check", str(path))
    assert run.returncode == 2
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "round_robin" in lines[0] and "dynamic" in lines[0], run.stderr


def test_a_moved_worker_never_runs_its_old_models_items_through_the_new_network():
    clock = Clock()
    a = worker(0, model="m1", buckets=(4,), serves={"m1", "m2"})
    b = worker(1, model="m1", buckets=(4,))
    c = worker(2, model="m2", buckets=(4,))
    d, done = make(clock, a, b, c, policy="round_robin")
    d.submit(queries(4, "m1"))
    assert len(a.own_queue) == 2 and len(b.own_queue) == 2
    d.move(a.id, "m2", reason="test")
    # a's m1 items went back to m1's other worker; a takes only m2 from now on.
    assert not a.own_queue and len(b.own_queue) == 4
    assert not isinstance(d.poll(a), Batch)
    d.submit(queries(4, "m2", start=10))
    taken = []
    for w in (a, b, c):
        while isinstance(batch := d.poll(w), Batch):
            assert all(it.model == batch.model == w.model for it in batch.items), (w.name, batch)
            taken += [it.query for it in batch.items]
            d.finished(w, batch, clock(), clock())
    assert sorted(taken) == [0, 1, 2, 3, 10, 11, 12, 13]
    assert all(ok for _, _, ok in done) and len(done) == 8


def test_a_moved_worker_whose_old_model_has_no_one_left_fails_those_items_visibly():
    clock = Clock()
    a = worker(0, model="m1", buckets=(4,), serves={"m1", "m2"})
    c = worker(1, model="m2", buckets=(4,))
    d, done = make(clock, a, c, policy="round_robin")
    d.submit(queries(2, "m1"))
    d.move(a.id, "m2")
    assert sorted(done) == [(0, 1, False), (1, 1, False)]
    assert not isinstance(d.poll(a), Batch)


# -- latency estimates -----------------------------------------------------------------------


def test_latency_estimates_are_kept_per_model():
    e = LatencyEstimate(0.5)
    e.update(4, 100 * MS, "big")
    e.update(4, 2 * MS, "small")
    assert e.expected_ns(4, "big") == 100 * MS
    assert e.expected_ns(4, "small") == 2 * MS
    assert e.expected_ns(8, "small") == 4 * MS  # scaled within the model, never across
    assert e.expected_ns(4, "unmeasured") == 0.0
    assert e.snapshot("big") == {4: 100 * MS} and e.models() == ["big", "small"]


def test_a_borrowed_models_batches_leave_the_own_models_estimate_alone():
    clock = Clock()
    est = LatencyEstimate(1.0)
    est.update(1, 50 * MS, "a")
    w = worker(0, model="a", buckets=(1,), serves={"a", "b"}, est=est)
    other = worker(1, model="b", buckets=(1,), est=LatencyEstimate(1.0))
    other.estimate.update(1, 1 * MS, "b")
    d, _ = make(clock, w, other, dynamic=True, latency_bound_ns={"a": 60 * MS, "b": 5 * MS})
    d.submit(queries(1, "b"))
    borrowed = d.poll(w)
    assert isinstance(borrowed, Batch) and borrowed.model == "b"
    d.finished(w, borrowed, clock(), clock() + 2 * MS)
    assert w.estimate.expected_ns(1, "a") == 50 * MS  # untouched by b's 2 ms batch
    assert w.estimate.expected_ns(1, "b") == 2 * MS
    # The SLO rule reads b's figure for b: at 2 ms it meets b's 5 ms bound and takes the item.
    d.submit(queries(1, "b", start=1))
    again = d.poll(w)
    assert isinstance(again, Batch) and again.model == "b"
