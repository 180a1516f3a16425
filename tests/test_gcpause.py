"""The collector's pauses, counted per generation, in a run's trial records."""

from __future__ import annotations

import gc
import weakref

from infermux.runtime.gcpause import GcPauses
from infermux.runtime.session import run_plan
from tests.test_runtime_e2e import plan, tiny


def test_pauses_are_counted_per_generation_and_reset() -> None:
    pauses = GcPauses().install()
    try:
        gc.collect()
        gc.collect(0)
        s = pauses.summary()
        assert s["full_collections"] == 1 and s["collections"] == 2
        assert 0 < s["full_max_ms"] <= s["full_total_ms"] <= s["total_ms"]
        pauses.reset()
        assert pauses.summary()["collections"] == 0
    finally:
        pauses.remove()
    gc.collect()
    assert pauses.summary()["collections"] == 0  # removed: no longer listening


def test_a_pause_off_the_cpu_is_told_from_a_walk() -> None:
    """The longest full collection's CPU time beside its pause.

    A pause is wall time: a collecting thread taken off its core pauses as long as it is away,
    and only the CPU time says whether the collector walked that long (on an H200 host, 548 ms
    of a 548 ms pause did). Here a callback sleeps inside the collection's window, as a thread
    taken off its core does; then a collection runs on the CPU throughout.
    """
    import time

    _heap_is_ours_to_freeze()
    gc.freeze()  # the test process's heap (a whole suite's) out of the walk: it alone took 0.4 s
    try:
        kept = [[i] for i in range(50_000)]  # something to walk

        def held_off(phase: str, info: dict) -> None:
            if phase == "start" and info.get("generation") == 2:
                time.sleep(0.08)

        pauses = GcPauses().install()
        gc.callbacks.append(held_off)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(held_off)
            pauses.remove()
        s = pauses.summary()
        assert s["full_collections"] == 1 and s["full_max_ms"] >= 80
        assert 0 < s["full_max_cpu_ms"] < 0.5 * s["full_max_ms"]
        pauses = GcPauses().install()
        try:
            gc.collect()
        finally:
            pauses.remove()
        s = pauses.summary()
        assert 0 < s["full_max_cpu_ms"] <= s["full_max_ms"] * 1.05 + 0.05  # on the CPU throughout
        assert len(kept) == 50_000
    finally:
        gc.unfreeze()


def test_a_trial_s_record_carries_the_pauses_in_its_window() -> None:
    p = plan([tiny(replicas=[{"unit": "cpu:0", "batch": 4}])],
             dispatcher={"cpu_workers": "thread"})
    before = list(gc.callbacks)
    report = run_plan(p)
    rec = report.final
    assert rec is not None and rec.gc is not None
    assert set(rec.gc) == {"full_collections", "full_max_ms", "full_max_cpu_ms", "full_total_ms",
                           "collections", "total_ms"}
    assert rec.gc["full_max_ms"] <= rec.gc["full_total_ms"] <= rec.gc["total_ms"]
    assert rec.to_dict()["gc"] == rec.gc
    assert type(rec).from_dict(rec.to_dict()).gc == rec.gc
    assert gc.callbacks == before  # the runtime stopped listening when it shut down


def _heap_is_ours_to_freeze() -> None:
    import pytest

    from infermux.runtime import gcpause

    if gc.get_freeze_count() or gcpause._freezers:
        pytest.skip("this process's heap is frozen already (another runtime of it runs)")


def test_the_heap_is_frozen_once_per_process_and_given_back_by_the_last() -> None:
    from infermux.runtime.gcpause import freeze_heap, thaw_heap

    _heap_is_ours_to_freeze()
    kept = [object() for _ in range(10)]  # live, tracked-or-not: the freeze leaves them be
    assert freeze_heap()  # counted: its thaw_heap is owed
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the interpreter's own heap, at least
        assert freeze_heap()  # a second runtime: what was made since is frozen too
        assert gc.get_freeze_count() > frozen * 0.9  # (objects freed by their counts leave it)
        # Objects made after the freeze stay the collector's: a full collection walks them only.
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
        thaw_heap()
        assert gc.get_freeze_count() > frozen * 0.9  # one runtime still runs
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0 and len(kept) == 10
    thaw_heap()  # one more stop than starts does nothing
    assert gc.get_freeze_count() == 0


def test_a_running_runtime_holds_its_built_heap_frozen() -> None:
    from infermux.runtime import start_runtime

    _heap_is_ours_to_freeze()
    p = plan([tiny(replicas=[{"unit": "cpu:0", "batch": 4}])],
             dispatcher={"cpu_workers": "thread"})
    rt = start_runtime(p)
    try:
        assert gc.get_freeze_count() > 1000
    finally:
        rt.stop(drain=False)
    assert gc.get_freeze_count() == 0
    # A process that froze its own heap is left as it is.
    gc.freeze()
    try:
        from infermux.runtime.gcpause import freeze_heap

        assert not freeze_heap()  # not counted: no thaw_heap owed
        own = gc.get_freeze_count()
        rt = start_runtime(p)
        rt.stop(drain=False)
        # Still frozen (objects freed by their counts leave the frozen set; none were thawed).
        assert gc.get_freeze_count() > own * 0.9
    finally:
        gc.unfreeze()


class _Node:
    self: object


def test_each_trial_freezes_what_the_trials_before_it_left() -> None:
    """A trial's full collections walk only what was allocated since it began.

    On an H200 host full collections of 343 and 367 ms ran inside find-peak trials late in a
    search, walking what the earlier trials had left; each trial's beginning now collects and
    freezes it.
    """
    from infermux.runtime import start_runtime

    _heap_is_ours_to_freeze()
    p = plan([tiny(replicas=[{"unit": "cpu:0", "batch": 4}])],
             dispatcher={"cpu_workers": "thread"})
    rt = start_runtime(p)
    try:
        at_start = gc.get_freeze_count()
        left = [[i] for i in range(20_000)]  # an earlier trial's records, still held
        garbage = _Node()
        garbage.self = garbage  # and its garbage: a cycle only the collector frees
        gone = weakref.ref(garbage)
        del garbage
        rt.begin_trial({})
        frozen = gc.get_freeze_count()
        assert frozen >= at_start + len(left)
        # The garbage was collected before the freeze, not kept frozen until the heap thaws.
        assert gone() is None
        fresh = [[i] for i in range(1_000)]
        assert gc.get_freeze_count() <= frozen and len(fresh) == 1_000  # not frozen until the next
    finally:
        rt.stop(drain=False)
    assert gc.get_freeze_count() == 0


def test_a_second_runtime_s_start_freezes_what_was_built_since() -> None:
    from infermux.runtime.gcpause import freeze_heap, thaw_heap

    _heap_is_ours_to_freeze()
    freeze_heap()
    try:
        first = gc.get_freeze_count()
        built = [[i] for i in range(5_000)]  # a second runtime's build
        freeze_heap()
        assert gc.get_freeze_count() >= first + len(built)
        thaw_heap()
        assert gc.get_freeze_count() >= first  # one runtime still runs
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0
