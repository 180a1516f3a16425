"""The whole host's stalls, seen from a child process (`runtime.host_watch`), and the peak
search running again a trial that failed during one: real processes, stopped by signals."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

from infermux.runtime import parse_plan, start_runtime
from infermux.runtime.host_watch import HostWatch
from infermux.runtime.peak import TrialRun, run_load

from .conftest import TINY


def _pause(pids: list[int], after_s: float, for_s: float) -> subprocess.Popen[bytes]:
    """Stop these processes `after_s` from now for `for_s`, from a process of its own."""
    ids = " ".join(str(p) for p in pids)
    return subprocess.Popen(["sh", "-c", f"sleep {after_s}; kill -STOP {ids}; sleep {for_s}; "
                             f"kill -CONT {ids}"])


def test_the_watch_sees_its_process_stopped_and_places_the_gap_in_time() -> None:
    with HostWatch() as watch:
        assert watch.available and watch.error is None and watch._proc is not None
        t0 = time.perf_counter_ns()
        pauser = _pause([watch._proc.pid], 0.1, 0.3)
        pauser.wait(10)
        time.sleep(0.1)  # the child wakes, reports the gap, and the reader takes it
        t1 = time.perf_counter_ns()
        seen = watch.during(t0, t1, at_least_ms=200)
        assert seen is not None, watch.gaps
        assert seen["stalls"] == 1 and 250 <= seen["longest_ms"] < 1_000
        assert 0.05 <= seen["at_s"] <= 0.5  # it began about 0.1 s into the window
        # Windows that do not overlap the stop do not see it; nor does a higher threshold.
        assert watch.during(t1, t1 + 10**9, at_least_ms=200) is None
        assert watch.during(t0 - 10**9, t0, at_least_ms=200) is None
        assert watch.during(t0, t1, at_least_ms=2_000) is None
    assert watch._proc is None  # stopped on leaving


def _search_paused(whole_host: bool) -> dict[str, Any]:
    """A find-peak on real workers whose second server trial is stopped for 0.4 s."""
    plan = parse_plan({
        "name": "watch", "models": [{"name": "tiny", "model": f"{TINY}:tiny_cnn",
                                     "replicas": [{"unit": "cpu:0", "batch": 4}]}],
        "dispatcher": {"cpu_workers": "thread", "max_queue_delay_ms": 1},
        "load": {"scenario": "server", "find_peak": True, "p99_bound_ms": 150,
                 "sample_pool": 16, "min_duration_s": 0.8, "min_queries": 40}})
    rt = start_runtime(plan)
    kept: list[TrialRun] = []
    pausers: list[subprocess.Popen[bytes]] = []
    with HostWatch() as watch:
        assert watch._proc is not None
        targets = [os.getpid(), watch._proc.pid] if whole_host else [os.getpid()]

        def keep(run: TrialRun) -> None:
            kept.append(run)
            if len(kept) == 2:  # the offline trial and the first server trial have ended
                pausers.append(_pause(targets, 0.2, 0.4))

        try:
            peak = run_load(rt, plan.load.model_dump(mode="json"), keep=keep, confirm=False,
                            watch=watch)
        finally:
            rt.stop(drain=False)
            for p in pausers:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.kill(p.pid, signal.SIGKILL)
    assert peak is not None and pausers
    return peak


def test_a_search_runs_again_a_trial_the_whole_host_stopped_in_but_not_the_plans_own() -> None:
    """Stopping the runtime's process and the watch together (the host stopped) has the
    stalled trial run again; stopping the runtime's process alone (the plan's own slowness, as
    far as the watch can tell) does not."""
    peak = _search_paused(whole_host=True)
    stalled = peak["trials"][1]  # the offline trial is not among the search's trials
    assert stalled["host_stall"] is not None and stalled["host_stall"]["longest_ms"] >= 300
    assert stalled["disturbed"] is True and not stalled["valid"]
    # The same rate ran again at once, and the search went on from it.
    assert peak["trials"][2]["rate_qps"] == stalled["rate_qps"]
    assert not peak["trials"][2].get("disturbed")
    assert peak["host_stalls"]["run_again"] == 1 and peak["host_watch"] is True
    assert any("host stopped" in n for n in peak["notes"])
    # The runtime stopped alone and its trial failed, but the watch ran on: the trial counts.
    peak = _search_paused(whole_host=False)
    stalled = peak["trials"][1]
    assert not stalled["valid"], stalled
    assert stalled.get("host_stall") is None and not stalled.get("disturbed")
    assert peak["trials"][2]["rate_qps"] != stalled["rate_qps"]
    assert peak["host_stalls"]["run_again"] == 0
