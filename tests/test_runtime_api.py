"""The runtime's public face on real workers: subscriptions, readiness, statistics, stop."""

from __future__ import annotations

import threading

import numpy as np

from infermux.load.base import Query
from infermux.runtime import LocalRuntime, Plan, Runtime, parse_plan, start_runtime

from .conftest import TINY


def _plan() -> Plan:
    return parse_plan({
        "name": "api", "models": [{"name": "tiny", "model": f"{TINY}:tiny_cnn",
                                   "replicas": [{"unit": "cpu:0", "batch": 4}]}],
        "dispatcher": {"cpu_workers": "thread", "max_queue_delay_ms": 1},
        "load": {"sample_pool": 8}})


def test_every_subscriber_gets_outputs_and_completions_until_it_cancels() -> None:
    rt: Runtime = start_runtime(_plan())
    assert isinstance(rt, LocalRuntime)
    first: list[tuple[int, int]] = []
    second: list[int] = []
    batches: list[int] = []
    done = threading.Event()
    lock = threading.Lock()

    def on_outputs(batch, outputs) -> None:
        with lock:
            first.extend((it.query, it.sample) for it in batch.items)
            assert outputs[0].shape[0] == len(batch.items)

    def on_complete(pairs, ok, when_ns) -> None:
        with lock:
            second.extend(n for _, n in pairs if ok)
            if sum(second) >= 6:
                done.set()

    try:
        assert rt.ready("tiny") and not rt.ready("other")
        assert rt.input_shape("tiny") == (3, 32, 32)
        a = rt.subscribe(outputs=on_outputs)
        rt.subscribe(completions=on_complete, batches=lambda w, b, s, e, t: batches.append(
            len(b.items)))
        rows = np.random.default_rng(0).standard_normal((6, 3, 32, 32)).astype(np.float32)
        rt.submit([Query(1, "tiny", tuple(range(6)), rows)])
        assert done.wait(60)
        assert sorted(first) == [(1, i) for i in range(6)]  # every served row, once
        assert sum(batches) == 6
        a.cancel()
        a.cancel()  # a second cancel changes nothing
        with lock:  # the second query's six rows, counted from none
            second.clear()
            done.clear()
        rt.submit([Query(2, "tiny", tuple(range(6)), rows)])
        assert done.wait(60)
        assert all(q == 1 for q, _ in first)  # the cancelled subscriber heard nothing more
        stats = rt.stats()
        assert stats.failed_items == 0 and stats.queued_items == {"tiny": 0}
        assert [w.name for w in rt.workers()] == ["tiny/cpu:0#0"]
    finally:
        rt.stop(drain=True)


def test_a_pipeline_taken_out_of_service_is_restarted_with_an_ordinary_id() -> None:
    from infermux.errors import RunError

    rt = start_runtime(parse_plan({
        "name": "pipe", "models": [{"name": "tiny", "model": f"{TINY}:tiny_cnn", "stages": [
            {"start": "input", "end": "body_1", "units": ["cpu:0"], "batch": 4},
            {"start": "body_1", "end": "output", "units": ["cpu:0"], "batch": 4}]}],
        "dispatcher": {"cpu_workers": "thread", "max_queue_delay_ms": 1},
        "load": {"sample_pool": 8}}))
    done = threading.Event()
    got: list[int] = []

    def on_complete(pairs, ok, when_ns) -> None:
        got.extend(n for _, n in pairs if ok)
        if sum(got) >= 4:
            done.set()

    try:
        (w,) = rt.workers()
        assert w.id == 0 and w.name == "tiny/pipeline"  # an ordinary id, as a replica's
        assert rt.restartable(w.id)
        rt.fail_idle(w, RunError("taken out for the test"))
        assert not w.alive and not rt.ready("tiny")
        rt.restart_worker(w.id, 60)
        assert w.alive and rt.ready("tiny")
        rt.subscribe(completions=on_complete)
        rows = np.zeros((4, 3, 32, 32), np.float32)
        rt.submit([Query(7, "tiny", tuple(range(4)), rows)])
        assert done.wait(60), "the restarted pipeline served nothing"
    finally:
        rt.stop(drain=True)
