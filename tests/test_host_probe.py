"""The host probe beside a peak search (`runtime.host_probe`): real threads, sleeps, /proc."""

from __future__ import annotations

import pytest
import torch

from infermux.runtime import parse_plan
from infermux.runtime.host_probe import (
    HostProbe,
    describe_probes,
    host_note,
    plan_cuda_device,
    probe_host,
    search_note,
)


def _figure(p99_us: float) -> dict[str, float]:
    """A recorded figure (ms, as `stats.latency_summary_ms` gives it) of this p99 in µs."""
    ms = p99_us / 1e3
    return {"n": 500, "p50_ms": ms / 3, "p99_ms": ms, "max_ms": 2 * ms}


def test_the_probe_times_real_wake_ups_and_sleeps_on_this_host() -> None:
    probe = probe_host(seconds=0.1)
    for figure in (probe.wake, probe.sleep_overshoot):
        assert figure is not None and figure["n"] >= 20
        assert 0 < figure["p50_ms"] <= figure["p99_ms"] <= figure["max_ms"]
    # A round trip through another thread takes at least a few microseconds, and each round
    # sleeps 0.5 ms first, so the figure is the wake-up's, not the sleep's.
    assert probe.wake is not None and probe.wake["p50_ms"] < 0.5
    # No CUDA device asked for: no device figures.
    assert probe.device_wait is None and probe.device_wait_after_idle is None
    assert probe.device is None
    assert probe.steal_pct is None or 0.0 <= probe.steal_pct <= 100.0
    assert 0.2 <= probe.seconds < 5.0


def test_a_figure_over_a_tenth_of_the_bound_is_named_and_none_under_it() -> None:
    quick = HostProbe(seconds=0.6, wake=_figure(120), sleep_overshoot=_figure(90))
    assert host_note(quick, 15.0) is None
    assert host_note(quick, None) is None
    slow = HostProbe(seconds=0.6, wake=_figure(2_400), sleep_overshoot=_figure(90),
                     device_wait=_figure(1_800), device="cuda:0")
    note = host_note(slow, 15.0)
    assert note is not None
    assert "wake-up p99 2.40 ms" in note and "launch and wait p99 1.80 ms" in note
    assert "overshoot" not in note and "15 ms bound" in note
    stolen = HostProbe(seconds=0.6, wake=_figure(50), steal_pct=12.0)
    said = host_note(stolen.to_dict(), 15.0)  # as recorded in a peak's JSON
    assert said is not None and "12% of the CPU time stolen" in said
    # A search names the later probe that found the host slow, and nothing when neither did.
    assert search_note(slow, stolen, 15.0) == host_note(stolen, 15.0)
    assert search_note(slow, quick, 15.0) == note
    assert search_note(quick, quick, 15.0) is None


def test_the_probes_line_gives_each_figure_before_and_after() -> None:
    before = HostProbe(seconds=0.6, wake=_figure(110), steal_pct=0.0).to_dict()
    after = HostProbe(seconds=0.6, wake=_figure(2_000), device_wait=_figure(300)).to_dict()
    line = describe_probes({"before": before, "after": after})
    assert "thread wake-up p99 110 / 2000 µs" in line
    assert "device wait p99 300 µs" in line and "stolen CPU 0.0%" in line
    assert describe_probes({}) == "not measured"


def test_the_probe_s_device_is_the_plan_s_first_cuda_unit() -> None:
    def plan(*units: str):
        return parse_plan({"models": [{"name": f"m{i}", "model": "resnet18",
                                       "replicas": [{"unit": u, "batch": 8}]}
                                      for i, u in enumerate(units)]})

    assert plan_cuda_device(plan("cpu:0", "cuda:1/fp16")) == "cuda:1"
    assert plan_cuda_device(plan("cpu:0")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_device_wait_is_timed_where_cuda_is_initialised() -> None:
    torch.ones(1, device="cuda:0")
    probe = probe_host(seconds=0.1, device="cuda:0")
    assert probe.device == "cuda:0" and probe.device_wait is not None
    assert probe.device_wait["n"] >= 20 and probe.device_wait["p50_ms"] > 0
    idle = probe.device_wait_after_idle
    assert idle is not None and idle["n"] == 10 and idle["p50_ms"] > 0
