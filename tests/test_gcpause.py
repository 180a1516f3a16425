"""The collector's pauses, counted per generation, in a run's trial records."""

from __future__ import annotations

import gc

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


def test_a_trial_s_record_carries_the_pauses_in_its_window() -> None:
    p = plan([tiny(replicas=[{"unit": "cpu:0", "batch": 4}])],
             dispatcher={"cpu_workers": "thread"})
    before = list(gc.callbacks)
    report = run_plan(p)
    rec = report.final
    assert rec is not None and rec.gc is not None
    assert set(rec.gc) == {"full_collections", "full_max_ms", "full_total_ms", "collections",
                           "total_ms"}
    assert rec.gc["full_max_ms"] <= rec.gc["full_total_ms"] <= rec.gc["total_ms"]
    assert rec.to_dict()["gc"] == rec.gc
    assert type(rec).from_dict(rec.to_dict()).gc == rec.gc
    assert gc.callbacks == before  # the runtime stopped listening when it shut down
