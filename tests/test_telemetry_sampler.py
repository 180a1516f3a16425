"""The sampler on this machine's real sources, its lifecycle, its buffer and its own cost."""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path

import psutil
import pytest

from infermux.errors import UsageError
from infermux.telemetry import EmptySource, Reading, Sampler, Source, probe_sources
from infermux.telemetry.cpu import POWERCAP, CpuSource, find_rapl


class CountingSource(Source):
    """A real source that reads a counter; counts reads and closes."""

    name = "counting"

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.closes = 0

    @property
    def devices(self) -> list[str]:
        return ["counter"]

    def read(self) -> list[Reading]:
        self.reads += 1
        return [Reading(source=self.name, device="counter", power_w=float(self.reads))]

    def close(self) -> None:
        self.closes += 1


def _sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "infermux-telemetry"]


def test_probe_finds_the_cpu_here_and_says_why_others_are_missing():
    notes: list[str] = []
    sources = probe_sources(None, notes)
    assert [s.name for s in sources][-1] == "cpu"
    names = {s.name for s in sources}
    if "nvml" not in names:
        assert any(n.startswith("nvml:") for n in notes)
    if "jetson" not in names:
        assert any(n.startswith("jetson:") for n in notes)


def test_ready_handshake_and_real_cpu_readings():
    with Sampler(interval_s=0.05) as sampler:
        first = sampler.latest()
        assert first is not None  # start() returned only after the first tick
        deadline = time.perf_counter() + 0.4
        x = 0
        while time.perf_counter() < deadline:  # keep one core busy
            x += 1
        tick = sampler.flush()
    assert tick is not None
    cpu = tick.get("cpu")[0]
    assert cpu.source == "cpu"
    assert len(cpu.cores_util_pct) == psutil.cpu_count()
    assert 0.0 <= cpu.util_pct <= 100.0
    assert cpu.extra["process_cpu_pct"] > 10.0  # this process was busy


def test_a_read_right_after_another_is_measured_over_a_window_of_clock_ticks():
    source = CpuSource()
    deadline = time.perf_counter() + 0.3
    x = 0
    while time.perf_counter() < deadline:  # keep one core busy
        x += 1
    source.read()
    again = source.read()[0]  # microseconds later: no kernel tick between the two reads
    assert again.extra["process_cpu_pct"] > 50.0
    assert len(again.cores_util_pct) == psutil.cpu_count()
    assert max(again.cores_util_pct) > 50.0


def test_rate_window_and_flush():
    source = CountingSource()
    with Sampler([source], interval_s=0.02) as sampler:
        t0 = time.perf_counter_ns()
        time.sleep(0.3)
        t1 = time.perf_counter_ns()
        window = sampler.window(t0, t1)
    # 0.3 s at 50 Hz ≈ 15 ticks; generous bounds for a loaded 2-core machine.
    inside = [t for t in window.ticks if t0 <= t.t_ns <= t1]
    assert 5 <= len(inside) <= 20
    assert window.ticks[0].t_ns <= t0 or window.ticks[0].seq == 0
    assert window.ticks[-1].t_ns > t1  # the window's end is bracketed
    summary = window.summary(["counter"])
    assert summary.energy_j is not None and summary.energy_j > 0
    assert [r["seq"] for r in window.rows()] == [t.seq for t in window.ticks]


def test_bounded_buffer_drops_the_oldest():
    source = CountingSource()
    with Sampler([source], interval_s=0.005, capacity=4) as sampler:
        time.sleep(0.15)
        ticks = sampler.ticks()
    assert len(ticks) <= 4
    assert sampler.dropped > 0
    assert [t.seq for t in ticks] == sorted(t.seq for t in ticks)


def test_stop_runs_exactly_once():
    source = CountingSource()
    before = len(_sampler_threads())
    sampler = Sampler([source], interval_s=0.01).start()
    assert sampler.running
    sampler.stop()
    sampler.stop()
    assert not sampler.running
    assert source.closes == 1
    assert len(_sampler_threads()) == before
    reads = source.reads
    time.sleep(0.05)
    assert source.reads == reads  # nothing reads after stop
    with pytest.raises(Exception, match="already started"):
        sampler.start()


def test_an_abandoned_sampler_is_stopped_by_its_finalizer():
    source = CountingSource()
    Sampler([source], interval_s=0.01).start()
    gc.collect()
    deadline = time.monotonic() + 5
    while source.closes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source.closes == 1


def test_a_failing_source_does_not_stop_the_others():
    class Broken(CountingSource):
        name = "broken"

        def read(self) -> list[Reading]:
            raise OSError("sensor gone")

    good = CountingSource()
    with Sampler([Broken(), good], interval_s=0.01) as sampler:
        time.sleep(0.05)
    assert good.reads >= 3
    assert any("broken: read failed: OSError: sensor gone" in n for n in sampler.describe()["notes"])


def test_empty_stand_in():
    with Sampler([], interval_s=0.01, notes=["nothing here"]) as sampler:
        pass
    assert isinstance(sampler.sources[0], EmptySource)
    assert sampler.describe()["sources"][0]["notes"] == ["nothing here"]


@pytest.mark.parametrize("interval", [0.0, -1.0, 120.0])
def test_bad_interval_is_a_usage_error(interval):
    with pytest.raises(UsageError, match="telemetry interval"):
        Sampler([CountingSource()], interval_s=interval)


def test_own_cost_is_small():
    """The overhead bound, robustly: the sampler's CPU time per tick on the real CPU source.

    At 10 Hz, 2 ms of CPU per tick would be 2% of one core; the measured cost is a few hundred
    µs (see docs/benchmarks.md for the effect on a benchmark's throughput).
    """
    with Sampler([CpuSource()], interval_s=0.02) as sampler:
        time.sleep(0.5)
    cost = sampler.cost()
    assert cost.ticks >= 10
    assert cost.cpu_per_tick_us < 2000
    assert cost.cpu_share_pct < 10  # at 50 Hz; ×5 less at the 10 Hz default


def test_rapl_here_or_the_reason():
    domains, note = find_rapl(POWERCAP)
    if not domains:
        pytest.skip(f"RAPL not readable on this machine: {note}")
    source = CpuSource()
    assert source.has_energy
    first = source.read()[0].energy_j
    time.sleep(0.2)
    second = source.read()[0]
    assert second.energy_j is not None and first is not None and second.energy_j > first
    assert second.power_w is not None and second.power_w > 0


def test_rapl_tree_with_wraparound(tmp_path: Path):
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "name").write_text("package-0\n")
    (zone / "max_energy_range_uj").write_text("1000000\n")
    (zone / "energy_uj").write_text("999000\n")
    sub = tmp_path / "intel-rapl:0:0"
    sub.mkdir()
    (sub / "name").write_text("core\n")
    (sub / "max_energy_range_uj").write_text("1000000\n")
    (sub / "energy_uj").write_text("10\n")
    source = CpuSource(powercap=tmp_path)
    assert source.has_energy
    (zone / "energy_uj").write_text("1999\n")  # wrapped: +1000 +1999 +1 = 3000 µJ
    reading = source.read()[0]
    assert reading.energy_j == pytest.approx(0.003)
    assert reading.extra["rapl_core_energy_j"] == pytest.approx(0.0)


def test_unreadable_rapl_gives_the_fix(tmp_path: Path):
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "name").write_text("package-0\n")
    (zone / "max_energy_range_uj").write_text("1000000\n")
    (zone / "energy_uj").write_text("5\n")
    (zone / "energy_uj").chmod(0)
    try:
        if os.access(zone / "energy_uj", os.R_OK):
            pytest.skip("running as root: permissions cannot be withheld")
        domains, note = find_rapl(tmp_path)
        assert domains == []
        assert "permission denied" in note and "chmod" in note
    finally:
        (zone / "energy_uj").chmod(0o644)
