"""A CPU worker's process gets its next batch while it runs one (`dispatcher.cpu_in_flight`).

Real child processes (`ProcessHost`) built by the runtime (`start_runtime`), a model whose
every batch sleeps 20 ms (tests/engine_models/paced.py) so the overlap does not depend on
this machine's speed, and a real SIGKILL of a child holding two batches.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infermux.load.base import Query
from infermux.runtime import start_runtime
from infermux.runtime.plan import parse_plan
from infermux.runtime.supervisor import Supervisor

MODELS = Path(__file__).parent / "engine_models"
PACED = f"{MODELS / 'paced.py'}:build"
SLOW = f"{MODELS / 'faulty.py'}:slow"
#: The paced model's sleep per batch (tests/engine_models/paced.py).
DELAY_NS = 20_000_000


def _plan(model: str, in_flight: int, batch: int = 4) -> Any:
    return parse_plan({
        "name": "overlap",
        "models": [{"name": "m", "model": model, "replicas": [
            {"unit": "cpu:0", "batch": batch, "batch_buckets": "none"}]}],
        "dispatcher": {"cpu_workers": "process", "cpu_in_flight": in_flight,
                       "max_queue_delay_ms": 1},
        "load": {"scenario": "offline"},
    }, source="test")


class _Run:
    """A started runtime with a subscription recording what comes back."""

    def __init__(self, plan: Any) -> None:
        self.rt = start_runtime(plan)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.expected = 0
        self.completed: Counter[int] = Counter()
        self.failed: Counter[int] = Counter()
        #: Finished batches, in the order reported: (query ids, start, end, child's latency).
        self.batches: list[tuple[list[int], int, int, int]] = []
        self.outputs: dict[int, np.ndarray] = {}

        def on_batch(w: Any, batch: Any, start: int, end: int, timing: Any) -> None:
            self.batches.append(([it.query for it in batch.items], start, end,
                                 timing.latency_ns))

        def on_outputs(batch: Any, ys: list[np.ndarray]) -> None:
            for j, it in enumerate(batch.items):
                self.outputs[it.query] = np.array(ys[0][j])

        def on_complete(pairs: Any, ok: bool, when_ns: int) -> None:
            with self.lock:
                for q, n in pairs:
                    (self.completed if ok else self.failed)[q] += n
                if sum(self.completed.values()) + sum(self.failed.values()) >= self.expected:
                    self.done.set()

        self.rt.subscribe(outputs=on_outputs, completions=on_complete, batches=on_batch)

    def serve(self, queries: list[Query], timeout_s: float = 60.0) -> None:
        self.expected = sum(len(q.samples) for q in queries)
        self.rt.submit(queries)
        self.rt.end()
        assert self.done.wait(timeout_s), f"{self.completed} of {self.expected} samples came back"

    def close(self) -> dict[str, int]:
        stats = dict(self.rt._rt.hosts[0].relay_stats)  # the process host's own counters
        self.rt.stop(drain=True)
        return stats


def _indexed(n: int) -> list[Query]:
    return [Query(i, "m", tuple(range(4 * i, 4 * i + 4))) for i in range(n)]


def test_the_child_holds_the_next_batch_before_it_ends_the_last() -> None:
    """With 2 in flight the child finds nearly every batch waiting in its pipe; with 1, none.

    Answers still come back in order, each batch's record spans only its own turn in the
    child (records never overlap), and the latency estimate stays the child's time per batch.
    """
    stats: dict[int, dict[str, int]] = {}
    for in_flight in (1, 2):
        run = _Run(_plan(PACED, in_flight))
        try:
            run.serve(_indexed(12))
            state = run.rt.workers()[0]
            estimate = state.estimate.expected_ns(4, "m")
        finally:
            stats[in_flight] = run.close()
        assert not run.failed and sum(run.completed.values()) == 48
        order = [q for qs, *_ in run.batches for q in qs]
        assert order == sorted(order) and len(run.batches) == 12  # one query a batch, in order
        for (_, _, end, _), (_, start, _, _) in zip(run.batches, run.batches[1:], strict=False):
            assert start >= end
        child = [lat for *_, lat in run.batches]
        assert min(child) >= DELAY_NS  # the child's own timing, not the relay's
        if in_flight == 2:
            spans = [end - start for _, start, end, _ in run.batches]
            # Counting a batch from when it was sent would double it (it waited behind one).
            assert np.median(spans) < 1.5 * np.median(child), (spans, child)
            # The estimate follows the child's own times (a stall of the machine moves both),
            # never the doubled span from the send.
            assert DELAY_NS <= estimate <= 1.1 * max(child), (estimate, child)
    assert stats[1]["batches"] >= 12 and stats[1]["waiting"] == 0
    # 11 batches can wait (not the first); on a loaded machine a late send may miss a few.
    assert stats[2]["waiting"] >= 8, stats


def test_served_outputs_go_to_their_queries_as_with_one_batch_in_flight() -> None:
    """Rows through shared memory, two batches in flight: each query gets its own outputs."""
    import torch

    from infermux.models import ModelSpec, load_model

    rows = np.random.default_rng(3).standard_normal((24, 3, 16, 16)).astype(np.float32)
    queries = [Query(i, "m", (0,), rows[i:i + 1]) for i in range(len(rows))]
    outputs: dict[int, dict[int, np.ndarray]] = {}
    for in_flight in (2, 1):
        run = _Run(_plan(PACED, in_flight))
        try:
            run.serve(queries)
        finally:
            run.close()
        assert not run.failed and len(run.outputs) == len(rows)
        outputs[in_flight] = run.outputs
    module = load_model(ModelSpec(PACED)).module.eval()
    with torch.no_grad():
        want = module(torch.from_numpy(rows)).numpy()
    for i in range(len(rows)):
        np.testing.assert_allclose(outputs[2][i], outputs[1][i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(outputs[2][i], want[i], rtol=1e-4, atol=1e-5)


def test_a_child_killed_with_two_batches_in_flight_loses_no_query() -> None:
    """SIGKILL while the child holds two batches: both go back, the restarted worker runs them."""
    run = _Run(_plan(SLOW, 2, batch=2))
    supervisor = Supervisor(run.rt, backoff_s=0.1).start()
    try:
        state = run.rt.workers()[0]
        host = run.rt._rt.host_by_id[state.id]
        queries = [Query(i, "m", (2 * i, 2 * i + 1)) for i in range(3)]
        run.expected = 6
        run.rt.submit(queries)
        run.rt.end()
        deadline = time.monotonic() + 10
        while host.in_flight < 2:  # a batch runs (0.4 s) and the next waits in the pipe
            assert time.monotonic() < deadline, "the worker never sent a second batch"
            time.sleep(0.005)
        os.kill(host.pid or 0, signal.SIGKILL)
        assert run.done.wait(60), f"{run.completed} of 6 samples came back"
        assert not run.failed
        assert run.completed == Counter({0: 2, 1: 2, 2: 2})
        assert run.rt.stats().retried_items == 4  # the items of both batches it held
        assert [h["ok"] for h in supervisor.history] == [True]
        assert state.alive and state.restarts == 1
    finally:
        supervisor.stop()
        run.close()


@pytest.mark.parametrize("depth", [0, 3])
def test_only_one_or_two_batches_in_flight(depth: int) -> None:
    from infermux.errors import UsageError
    from infermux.runtime.process_host import ProcessHost

    with pytest.raises(UsageError, match="use 1 or 2"):
        ProcessHost("w", (0,), [], depth=depth)
    with pytest.raises(UsageError, match="cpu_in_flight"):
        parse_plan({"name": "x", "models": [{"name": "m", "model": PACED, "replicas": [
            {"unit": "cpu:0"}]}], "dispatcher": {"cpu_in_flight": depth}}, source="test")


# -- the dispatcher's side, on a fake clock ----------------------------------------------------

MS = 1_000_000


def _dispatcher(*busy_ms: float, bound_ms: float | None = None) -> tuple[Any, list[Any], list[int]]:
    """A dispatcher with one worker per entry, busy for that many ms (0: idle); a fake clock."""
    from infermux.runtime import Dispatcher, LatencyEstimate, WorkerState

    now = [1_000 * MS]
    d = Dispatcher(["m"], max_queue_delay_ns=2 * MS, clock_ns=lambda: now[0],
                   latency_bound_ns={"m": int(bound_ms * MS) if bound_ms else None})
    workers = []
    for i, ms in enumerate(busy_ms):
        est = LatencyEstimate()
        est.update(4, 10 * MS, "m")
        w = WorkerState(i, f"w{i}", f"cpu:{i}", "m", [4], {"m"}, est, depth=2)
        d.add_worker(w)
        if ms:
            w.in_flight, w.busy_until_ns = 1, now[0] + int(ms * MS)
        workers.append(w)
    return d, workers, now


def test_taking_ahead_leaves_the_batch_to_an_idle_worker() -> None:
    d, (busy, idle), _ = _dispatcher(8, 0)
    d.submit([Query(i, "m", (i,)) for i in range(4)])
    assert d.take_ahead(busy) is None  # the idle one starts now and finishes first
    assert d.queued("m") == 4
    idle.in_flight, idle.busy_until_ns = 1, busy.busy_until_ns + 5 * MS
    batch = d.take_ahead(busy)  # both busy: the one that frees first queues it
    assert batch is not None and len(batch.items) == 4
    # Two in flight: the second is expected to end one batch after the first.
    assert busy.in_flight == 2 and busy.busy_until_ns == 1_000 * MS + 18 * MS


def test_a_worker_running_a_batch_counts_it_against_a_latency_bound() -> None:
    # Busy 8 ms with 10 ms batches: it would finish at 18 ms, past the 15 ms bound, while the
    # idle worker finishes at 10 ms; counted from now (10 ms) it would have taken the items.
    d, (busy, idle), _ = _dispatcher(8, 0, bound_ms=15)
    d.submit([Query(i, "m", (i,)) for i in range(4)])
    assert isinstance(d.poll(busy), float)  # declined: look again later
    assert d.queued("m") == 4
    batch = d.poll(idle)
    assert batch is not None and not isinstance(batch, float) and len(batch.items) == 4
