"""The trial loop every runtime shares (`runtime.peak`), on this machine's real workers."""

from __future__ import annotations

from infermux.runtime import parse_plan, start_runtime
from infermux.runtime.api import LocalRuntime
from infermux.runtime.metrics import BatchRecord
from infermux.runtime.peak import (
    CONFIRM_SCALE,
    TrialRun,
    best_at_peak,
    confirm_duration_s,
    device_stall,
    device_stop,
    gc_note,
    lengthened,
    own_pause,
    run_load,
    run_trial,
    stall_note,
)
from infermux.runtime.trial import TrialSummary

from .conftest import TINY


def _plan(**load):
    return parse_plan({
        "name": "peak", "models": [{"name": "tiny", "model": f"{TINY}:tiny_cnn",
                                    "replicas": [{"unit": "cpu:0", "batch": 4}]}],
        "dispatcher": {"cpu_workers": "thread", "max_queue_delay_ms": 1},
        "load": {"sample_pool": 16, "min_duration_s": 0.3, "min_queries": 40, **load}})


def test_a_peak_search_hands_every_trial_to_keep_in_order_on_one_build() -> None:
    plan = _plan(scenario="server", find_peak=True, p99_bound_ms=2000)
    rt = start_runtime(plan)
    assert isinstance(rt, LocalRuntime)
    kept: list[TrialRun] = []
    try:
        peak = run_load(rt, plan.load.model_dump(mode="json"), keep=kept.append)
    finally:
        rt.stop(drain=False)
    assert peak is not None and peak["peak_qps"] is not None, peak
    assert [k.index for k in kept] == list(range(len(kept))) == [k.record.trial for k in kept]
    # The offline trial before the search and after it, the server trials between.
    assert kept[0].record.scenario == "offline" and kept[-1].record.scenario == "offline"
    assert all(k.record.scenario == "server" for k in kept[1:-1])
    assert peak["offline_after_items_per_s"] == kept[-1].record.items_per_s
    # Each server trial says whether its batches stopped on the device (CPU: no device time).
    assert all("device_stall" in t and t["device_stall"] is None for t in peak["trials"])
    # One trial per runtime trial: the loop numbers its queries from the runtime's own count.
    assert rt.trial == len(kept)
    # A valid trial's batches are its own and add up to the items it completed (a batch is
    # recorded before its completion is reported).
    assert kept[0].record.dropped_from_earlier_trial == 0
    for k in kept:
        if k.record.valid:
            assert sum(b.size for b in k.batches) == k.record.completed_items > 0
    best = best_at_peak([k.record for k in kept], peak)
    assert best is not None and best.rate_qps == peak["peak_qps"] and best.valid
    # The edge's repeats ran CONFIRM_SCALE times as long as the search's trials, and say so.
    long = confirm_duration_s(plan.load.model_dump(mode="json"))
    assert long == CONFIRM_SCALE * 0.3
    repeats = [(k, t) for k, t in zip(kept[1:-1], peak["trials"], strict=True) if t.get("repeat")]
    assert repeats and all(t["min_duration_s"] == long for _, t in repeats)
    assert all(k.record.duration_s >= long for k, _ in repeats)
    assert all(k.record.duration_s < long for k, t in zip(kept[1:-1], peak["trials"], strict=True)
               if not t.get("repeat"))
    # The host's hand-overs were probed before the search and after it.
    for when in ("before", "after"):
        wake = peak["host"][when]["wake"]
        assert wake["n"] > 0 and 0 < wake["p50_ms"] <= wake["p99_ms"]


def _batch(bucket: int, device_ms: float) -> BatchRecord:
    return BatchRecord("gpu#0", "cuda:0/fp16", "m", bucket, bucket, 0, 0, 0, [], [],
                       device_ns=int(device_ms * 1e6))


def test_a_batch_that_stopped_on_the_device_is_named_and_so_is_the_trial_it_failed() -> None:
    """One batch of a bucket far over its bucket's median and over half the bound is a device
    stall; slow batches under half the bound, buckets with too few batches to judge, and
    batches without device timing are not. The search's note names failed trials only."""
    steady = [_batch(32, 3.0) for _ in range(20)]
    assert device_stall(steady, 15.0) is None
    stalled = device_stall([*steady, _batch(32, 132.0), _batch(32, 7.0)], 15.0)
    assert stalled == {"batches": 1, "longest_ms": 132.0, "median_ms": 3.0, "model": "m",
                       "bucket": 32}
    # 14 ms is over four medians but not over half a 30 ms bound: not a stall for that bound.
    assert device_stall([*steady, _batch(32, 14.0)], 30.0) is None
    assert device_stall([*steady, _batch(32, 14.0)], 15.0) is not None
    # Three batches of a bucket give no median to judge by; untimed batches are left out.
    assert device_stall([_batch(8, 1.0), _batch(8, 1.0), _batch(8, 90.0)], 15.0) is None
    assert device_stall([*steady, _batch(32, 0.0)], 15.0) is None
    on_cpu = [BatchRecord("cpu#0", "cpu:0", "m", 32, 32, 0, 0, 0, [], [], device_ns=int(ms * 1e6))
              for ms in [3.0] * 20 + [132.0]]
    assert device_stall(on_cpu, 15.0) is None  # a CPU's slow batch is contention
    trials = [{"rate_qps": 5000.0, "valid": True, "device_stall": None},
              {"rate_qps": 10000.0, "valid": False, "device_stall": stalled},
              {"rate_qps": 7500.0, "valid": False, "device_stall": None}]
    note = stall_note(trials, 15.0)
    assert note is not None and "1 of the 2 trials over the bound" in note
    assert "10000 qps" in note and "132.0 ms" in note and "3.00 ms" in note
    assert stall_note(trials[:1] + trials[2:], 15.0) is None


def _on(worker: str, unit: str, bucket: int, device_ms: float) -> BatchRecord:
    return BatchRecord(worker, unit, "m", bucket, bucket, 0, 0, 0, [], [],
                       device_ns=int(device_ms * 1e6))


def test_a_batch_longer_than_the_bound_and_every_worker_beside_it_is_a_device_stop() -> None:
    """The allowance is a batch of every worker on the same device at its largest bucket's
    median: two workers of b64 at 5 ms leave 15 + 10 ms; a batch within that is the plan's own
    contention, one past it stood still; workers on another device or a CPU add nothing."""
    steady = [_on(f"gpu#{w}", "cuda:0/fp16", 64, 5.0) for w in (0, 1) for _ in range(10)]
    steady += [_on("gpu#0", "cuda:0/fp16", 16, 2.0) for _ in range(10)]
    other = [_on("gpu#9", "cuda:1/fp16", 64, 50.0) for _ in range(10)]
    cpu = [_on("cpu#0", "cpu:0", 64, 80.0) for _ in range(10)]
    base = steady + other + cpu
    assert device_stop(base, 15.0) is None
    assert device_stop([*base, _on("gpu#1", "cuda:0/fp16", 16, 24.0)], 15.0) is None
    stop = device_stop([*base, _on("gpu#1", "cuda:0/fp16", 64, 326.0),
                        _on("gpu#0", "cuda:0/fp16", 16, 30.0)], 15.0)
    assert stop == {"seen_by": "device", "stalls": 2, "longest_ms": 326.0,
                    "threshold_ms": 25.0}
    # Four workers on the device: 30 ms is within 15 + 4 x 5 ms.
    four = [_on(f"gpu#{w}", "cuda:0/fp16", 64, 5.0) for w in range(4) for _ in range(10)]
    assert device_stop([*four, _on("gpu#3", "cuda:0/fp16", 64, 30.0)], 15.0) is None
    assert device_stop([*four, _on("gpu#3", "cuda:0/fp16", 64, 36.0)], 15.0) is not None
    # A CPU unit's slow batch is contention, and a device's batches too few to judge add none.
    assert device_stop([*cpu, _on("cpu#0", "cpu:0", 64, 900.0)], 15.0) is None
    assert device_stop([_on("gpu#0", "cuda:0/fp16", 64, 5.0), _on("gpu#0", "cuda:0/fp16", 64,
                                                                   400.0)], 15.0) is None


def test_a_device_stop_the_runtime_s_own_collection_explains_is_not_the_host_s() -> None:
    """An H200 host's trial: a 548 ms full collection, all of it on the CPU, beside a batch the
    device timed at 627 ms. The collection held the lock the launches need: the trial stays
    failed (not run again), and its note names the collection, not the device."""
    stop = device_stop([*[_on("gpu#0", "cuda:0/fp16", 32, 5.2) for _ in range(10)],
                        _on("gpu#0", "cuda:0/fp16", 32, 627.5)], 15.0)
    assert stop is not None and stop["longest_ms"] == 627.5
    walked = {"full_collections": 1, "full_max_ms": 548.0, "full_max_cpu_ms": 548.0}
    assert own_pause(walked, stop)
    # A collection held off its core (the host took the thread) is the host's, as is a stop
    # far longer than a short collection; no stop, or no collections, explains nothing.
    assert not own_pause({**walked, "full_max_cpu_ms": 4.0}, stop)
    assert not own_pause({**walked, "full_max_ms": 12.0, "full_max_cpu_ms": 12.0}, stop)
    assert not own_pause(walked, None) and not own_pause(None, stop)
    trials = [{"rate_qps": 20970.7, "valid": True, "gc": None},
              {"rate_qps": 22416.9, "valid": False, "gc": walked},
              {"rate_qps": 19889.9, "valid": False,
               "gc": {"full_max_ms": 9.0, "full_max_cpu_ms": 9.0}}]
    note = gc_note(trials, 15.0)
    assert note is not None and "548 ms" in note and "22417" in note and "19890" not in note
    assert gc_note(trials[:1] + trials[2:], 15.0) is None


def test_one_trial_without_a_search_returns_no_peak() -> None:
    plan = _plan(scenario="offline")
    rt = start_runtime(plan)
    try:
        kept: list[TrialRun] = []
        assert run_load(rt, plan.load.model_dump(mode="json"), keep=kept.append) is None
        again = run_trial(rt, plan.load.model_dump(mode="json"), {"tiny": 1.0}, index=7)
    finally:
        rt.stop(drain=False)
    assert len(kept) == 1 and kept[0].record.valid, kept[0].record.validity_notes
    assert again.record.trial == 7 and again.record.completed_items > 0


def test_the_peak_answers_with_its_own_rate_not_a_higher_lucky_one() -> None:
    trials = [TrialSummary.from_dict(t) for t in (
        {"scenario": "offline", "valid": True},
        {"scenario": "server", "valid": True, "rate_qps": 100.0},
        {"scenario": "server", "valid": True, "rate_qps": 150.0},  # passed once
        {"scenario": "server", "valid": False, "rate_qps": 150.0})]
    assert best_at_peak(trials, {"peak_qps": 100.0}) is trials[1]
    assert best_at_peak(trials, {"peak_qps": None}) is None
    assert best_at_peak(trials, None) is None


def test_a_record_stored_with_completed_samples_still_reads() -> None:
    old = {"scenario": "offline", "valid": True, "items_per_s": 10.0, "completed_samples": 40,
           "models": {"m": {"completed_samples": 40, "items_per_s": 10.0, "latency": {}}}}
    summary = TrialSummary.from_dict(old)
    assert summary.completed_items == 40 and summary.models["m"].completed_items == 40
    new = {**old, "completed_items": 41}
    assert TrialSummary.from_dict(new).completed_items == 41


def test_the_confirming_runs_length_is_the_load_s_or_four_trials_and_its_stop_moves_with_it():
    assert confirm_duration_s({"min_duration_s": 3.0}) == 12.0
    assert confirm_duration_s({"min_duration_s": 3.0, "confirm_duration_s": 20.0}) == 20.0
    # No longer than a trial (or trials of no length): the repeats are plain trials.
    assert confirm_duration_s({"min_duration_s": 3.0, "confirm_duration_s": 2.0}) is None
    assert confirm_duration_s({"min_duration_s": 0}) is None
    settings = {"min_duration_s": 3.0, "max_duration_s": 5.0, "rate_qps": 10.0}
    assert lengthened(settings, None) is settings
    assert lengthened(settings, 12.0) == {"min_duration_s": 12.0, "max_duration_s": 14.0,
                                          "rate_qps": 10.0}
    assert lengthened({"min_duration_s": 3.0}, 12.0) == {"min_duration_s": 12.0}
    # A plan carries it, and refuses a length of nothing.
    plan = _plan(scenario="server", find_peak=True, p99_bound_ms=50, confirm_duration_s=9)
    assert plan.load.confirm_duration_s == 9
    import pytest

    from infermux.errors import UsageError

    with pytest.raises(UsageError, match="confirm_duration_s"):
        _plan(scenario="server", confirm_duration_s=0)


def test_infermux_run_takes_the_confirming_length_and_resolution_and_refuses_bad_ones(
        tmp_path) -> None:
    import json

    import yaml

    from .conftest import invoke_cli

    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(_plan().to_dict()))
    run = invoke_cli("run", str(path), "--no-store", "--json", "--find-peak", "--p99", "2000",
                     "--duration", "0.3s", "--confirm-duration", "0.9s",
                     "--peak-resolution", "0.25")
    assert run.returncode == 0, run.stderr
    peak = json.loads(run.stdout)["peak"]
    assert peak["peak_qps"] is not None
    repeats = [t for t in peak["trials"] if t.get("repeat")]
    assert repeats and all(t["min_duration_s"] == 0.9 for t in repeats)
    # A quarter of offline: two halvings (a half, then three quarters), then the repeats.
    assert len([t for t in peak["trials"] if not t.get("repeat")]) == 2
    coarse = invoke_cli("run", str(path), "--no-store", "--find-peak", "--p99", "50",
                        "--peak-resolution", "0.5")
    said = (coarse.stdout + coarse.stderr).strip()
    assert coarse.returncode != 0 and "Traceback" not in said
    assert "peak_resolution = 0.5" in said and "less than or equal to 0.25" in said, said
    bad = invoke_cli("run", str(path), "--no-store", "--find-peak", "--p99", "50",
                     "--confirm-duration", "0s")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    said = (bad.stdout + bad.stderr).strip()
    assert "confirm_duration_s" in said and len(said.splitlines()) <= 3, said


def test_the_offline_trial_after_the_search_bounds_the_fraction_and_names_a_moving_host() -> None:
    from infermux.load.scenarios import PeakResult
    from infermux.runtime.peak import speed_note

    def search(after: float | None, peak: float | None = 800.0) -> PeakResult:
        result = PeakResult(15.0, [], peak, 1000.0)
        result.offline_after_items_per_s = after
        return result

    steady = search(1030.0)
    assert speed_note(steady) is None
    # A host that sped up during the search: the fraction is of the faster figure.
    rec = steady.record()
    assert rec["peak_fraction_of_offline"] == 800.0 / 1030.0
    assert abs(rec["offline_drift"] - 0.03) < 1e-12 and rec["offline_after_items_per_s"] == 1030
    slowed = search(600.0, peak=500.0)
    note = speed_note(slowed)
    assert slowed.record()["peak_fraction_of_offline"] == 0.5
    assert abs(slowed.offline_drift + 0.4) < 1e-12
    assert note is not None and "from 1000 to 600 items/s" in note and "-40%" in note
    # No trial after (an interrupted search): the fraction of the one before, no drift.
    alone = search(None, peak=500.0)
    assert speed_note(alone) is None
    assert alone.offline_drift is None and alone.record()["peak_fraction_of_offline"] == 0.5
    assert search(1000.0, peak=None).record()["peak_fraction_of_offline"] is None


def test_a_search_without_a_peak_is_answered_by_its_last_server_trial() -> None:
    from infermux.runtime.peak import search_answer

    # The offline trial, two server rates, the offline trial again after the search.
    trials = [TrialSummary.from_dict(t) for t in (
        {"scenario": "offline", "valid": True},
        {"scenario": "server", "valid": False, "rate_qps": 50.0},
        {"scenario": "server", "valid": False, "rate_qps": 25.0},
        {"scenario": "offline", "valid": True})]
    assert search_answer(trials, {"peak_qps": None}) is trials[2]
    assert search_answer(trials, None) is None  # no search: the caller's last trial
    assert search_answer(trials[:1], {"peak_qps": None}) is None
    held = [*trials[:2], TrialSummary.from_dict(
        {"scenario": "server", "valid": True, "rate_qps": 25.0}), trials[3]]
    assert search_answer(held, {"peak_qps": 25.0}) is held[2]
