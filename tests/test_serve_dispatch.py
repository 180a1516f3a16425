"""The dispatcher rules the server relies on, on a fake clock (deterministic, no threads):
the idle take, and items held for a worker being restarted (revived, or given up on)."""

from __future__ import annotations

from typing import Any

from infermux.errors import RunError
from infermux.load.base import Query
from infermux.runtime import Batch, Dispatcher, LatencyEstimate, WorkerState
from infermux.runtime.process_host import WorkerDiedError

from .conftest import MS, Clock


def _worker(wid: int, model: str = "m") -> WorkerState:
    return WorkerState(wid, f"w{wid}", f"cpu:{wid}", model, [1, 2, 4], {model},
                       LatencyEstimate(0.5))


def _make(clock: Clock, *workers: WorkerState, delay_ms: float = 5.0,
          ) -> tuple[Dispatcher, list[tuple[int, int, bool]]]:
    d = Dispatcher(sorted({w.model for w in workers}), max_queue_delay_ns=int(delay_ms * MS),
                   clock_ns=clock)
    done: list[tuple[int, int, bool]] = []
    d.set_completion(lambda pairs, ok, t: done.extend((q, n, ok) for q, n in pairs))
    for w in workers:
        d.add_worker(w)
    return d, done


def test_an_idle_model_takes_a_lone_item_at_once_and_a_busy_one_batches() -> None:
    clock = Clock()
    a, b = _worker(0), _worker(1)
    d, _ = _make(clock, a, b)
    d.submit([Query(0, "m", (0,))])
    assert isinstance(d.poll(a), float)  # Triton's rule: wait for a fuller batch
    d.take_when_idle = True
    first = d.poll(a)
    assert isinstance(first, Batch) and len(first.items) == 1  # every worker idle: at once
    d.submit([Query(1, "m", (0,))])
    wait = d.poll(b)  # a is busy: b waits out the delay for a fuller batch, as before
    assert isinstance(wait, float) and abs(wait - 0.005) < 1e-9
    d.submit([Query(2, "m", (0,))])
    clock.advance(5)
    second = d.poll(b)
    assert isinstance(second, Batch) and len(second.items) == 2


def test_items_of_a_dead_worker_wait_for_its_restart_then_run() -> None:
    clock = Clock()
    w = _worker(0)
    d, done = _make(clock, w)
    failed: list[str] = []
    d.on_worker_failed = lambda s: failed.append(s.name)
    d.will_restart = lambda s, exc: isinstance(exc, WorkerDiedError)
    d.submit([Query(0, "m", (0, 1))])
    clock.advance(5)
    batch = d.poll(w)
    assert isinstance(batch, Batch)
    d.failed(w, [batch], WorkerDiedError("worker w0: its process died (killed by SIGKILL)"))
    assert failed == ["w0"] and not w.alive and w.restarting and done == []
    d.submit([Query(1, "m", (0,))])  # the model is still servable: queued, not failed
    assert d.queued("m") == 3 and done == []
    d.revive(w)
    assert w.alive and not w.restarting and w.restarts == 1 and w.error is None
    clock.advance(5)
    again = d.poll(w)
    assert isinstance(again, Batch) and len(again.items) == 3
    assert [it.attempts for it in again.items] == [1, 1, 0]
    d.finished(w, again, clock(), clock())
    assert sorted(done) == [(0, 2, True), (1, 1, True)]
    assert d.retried == 2


def test_a_raised_batch_is_not_held_and_a_given_up_restart_fails_what_waited() -> None:
    clock = Clock()
    w = _worker(0)
    d, done = _make(clock, w)
    d.will_restart = lambda s, exc: isinstance(exc, WorkerDiedError)
    d.submit([Query(0, "m", (0,))])
    clock.advance(5)
    batch = d.poll(w)
    assert isinstance(batch, Batch)
    d.failed(w, [batch], RunError("worker w0: RuntimeError: poisoned input"))
    assert not w.restarting and done == [(0, 1, False)]  # answered with the error at once

    w2 = _worker(1, model="n")
    d2, done2 = _make(clock, w2)
    d2.will_restart = lambda s, exc: True
    assert d2.fail_idle(w2, WorkerDiedError("worker w1: its process died (exit code 1)"))
    assert not d2.fail_idle(w2, WorkerDiedError("again"))  # already out of service
    d2.submit([Query(7, "n", (0, 1, 2))])
    assert done2 == []
    d2.give_up(w2, "restart 1 failed: no luck")
    assert done2 == [(7, 3, False)] and w2.error == "restart 1 failed: no luck"
    d2.submit([Query(8, "n", (0,))])  # nothing serves it now: failed at once
    assert done2[-1] == (8, 1, False)


def test_a_busy_worker_is_not_failed_by_the_process_watch() -> None:
    clock = Clock()
    w = _worker(0)
    d, _ = _make(clock, w)
    d.submit([Query(0, "m", (0, 1, 2, 3))])
    batch: Any = d.poll(w)
    assert isinstance(batch, Batch) and w.in_flight == 1
    assert not d.fail_idle(w, WorkerDiedError("its process died"))  # its own thread reports
    assert w.alive
