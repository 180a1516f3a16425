"""Energy integration, counters, wraparound and validity flags on known traces."""

from __future__ import annotations

import pytest

from infermux.telemetry import Reading, Tick, counter_energy_j, integrate_power_j, summarize
from infermux.telemetry.cpu import wrap_delta
from infermux.telemetry.nvml import decode_throttle

S = 1_000_000_000  # ns per second


def test_trapezoid_on_a_known_trace_is_exact():
    # 0 s: 100 W, 1 s: 200 W, 2 s: 200 W, 4 s: 0 W  →  150 + 200 + 200 = 550 J
    t = [0, 1 * S, 2 * S, 4 * S]
    p = [100.0, 200.0, 200.0, 0.0]
    joules, covered = integrate_power_j(t, p, 0, 4 * S)
    assert joules == pytest.approx(550.0, abs=1e-9)
    assert covered == pytest.approx(4.0)


def test_trapezoid_clips_the_window_by_interpolation():
    t = [0, 2 * S]
    p = [100.0, 300.0]  # linear: P(t) = 100 + 100 t
    # ∫_0.5^1.5 (100 + 100 t) dt = 100 + 50 * (1.5² - 0.5²) = 200 J
    joules, covered = integrate_power_j(t, p, S // 2, 3 * S // 2)
    assert joules == pytest.approx(200.0, rel=1e-12)
    assert covered == pytest.approx(1.0)


def test_window_outside_the_trace_covers_nothing():
    assert integrate_power_j([0, S], [5.0, 5.0], 2 * S, 3 * S) == (0.0, 0.0)
    with pytest.raises(ValueError, match="differ in length"):
        integrate_power_j([0, S], [1.0], 0, S)


def test_counter_difference_is_interpolated_at_both_ends():
    t = [0, 1 * S, 2 * S]
    e = [0.0, 100.0, 300.0]
    joules, covered = counter_energy_j(t, e, S // 2, 3 * S // 2)
    assert joules == pytest.approx(200.0 - 50.0)  # E(1.5 s) - E(0.5 s)
    assert covered == pytest.approx(1.0)


def test_counter_wraparound():
    max_range = 262143328850  # a real package's max_energy_range_uj
    assert wrap_delta(100, 250, max_range) == 150
    assert wrap_delta(max_range - 10, 5, max_range) == 10 + 5 + 1
    assert wrap_delta(max_range, 0, max_range) == 1


def test_decode_throttle_bits():
    assert decode_throttle(0) == ()
    assert decode_throttle(0x4 | 0x40) == ("sw_power_cap", "hw_thermal_slowdown")


def _gpu_ticks(powers, *, energy=None, clocks=None, throttle=(), others=None, temp=60.0,
               slowdown=90.0, period=S):
    ticks = []
    for i, power in enumerate(powers):
        reading = Reading(
            source="nvml", device="cuda:0", power_w=power,
            energy_j=energy[i] if energy else None,
            util_pct=90.0, clock_mhz=(clocks[i] if clocks else 1980.0), temp_c=temp,
            temp_slowdown_c=slowdown, throttle=tuple(throttle), other_processes=others)
        cpu = Reading(source="cpu", device="cpu", util_pct=50.0)
        ticks.append(Tick(i, i * period, [reading, cpu]))
    return ticks


def test_summary_prefers_the_counter_and_reports_per_item_figures():
    # The counter says 1000 J over 4 s; the power trace would say 400 J: the counter wins.
    ticks = _gpu_ticks([100.0] * 5, energy=[0.0, 250.0, 500.0, 750.0, 1000.0])
    summary = summarize(ticks, 0, 4 * S, ["cuda:0"])
    assert summary.energy_j == pytest.approx(1000.0)
    assert summary.energy_source == "nvml-counter(cuda:0)"
    record = summary.record(items=2000)
    assert record["energy_per_item_j"] == pytest.approx(0.5)
    assert record["mean_power_w"] == pytest.approx(250.0)
    assert record["items_per_s_per_w"] == pytest.approx(2.0)
    assert record["peak_power_w"] == pytest.approx(100.0)
    assert record["utilisation"]["cuda:0"]["util_pct"] == pytest.approx(90.0)
    assert record["utilisation"]["cpu"]["util_pct"] == pytest.approx(50.0)
    assert summary.flags == [] and summary.invalid_flags == []


def test_summary_integrates_power_without_a_counter():
    ticks = _gpu_ticks([100.0, 200.0, 200.0, 0.0, 0.0])  # 1 s apart: 150 + 200 + 100 + 0 J
    summary = summarize(ticks, 0, 4 * S, ["cuda:0/fp16"])
    assert summary.energy_j == pytest.approx(450.0)
    assert summary.energy_source == "nvml-power-integrated(cuda:0)"
    assert summary.peak_power_w == pytest.approx(200.0)


def test_summary_without_power_says_so():
    ticks = [Tick(i, i * S, [Reading(source="cpu", device="cpu", util_pct=10.0)]) for i in range(3)]
    summary = summarize(ticks, 0, 2 * S, ["cpu"])
    assert summary.energy_j is None
    assert summary.energy_source.startswith("none")
    assert summary.record(10)["energy_per_item_j"] is None


def test_partial_coverage_is_extended_and_flagged():
    ticks = _gpu_ticks([100.0, 100.0], period=S)  # covers 0..1 s of a 0..4 s window
    summary = summarize(ticks, 0, 4 * S, ["cuda:0"])
    assert summary.energy_j == pytest.approx(400.0)
    assert any("covered 25%" in f for f in summary.flags)


@pytest.mark.parametrize(
    ("kwargs", "invalid", "text"),
    [
        ({"throttle": ("hw_thermal_slowdown",)}, True, "hw_thermal_slowdown"),
        ({"throttle": ("sw_power_cap",)}, False, "power limit"),
        ({"others": (4242,)}, True, "other process"),
        ({"temp": 91.0, "slowdown": 90.0}, True, "slowdown point"),
        ({"clocks": [1980.0, 1980.0, 1500.0, 1980.0]}, False, "clocks moved"),
        ({"clocks": [1980.0, 1900.0, 1850.0, 1980.0]}, None, ""),
    ],
)
def test_validity_flags(kwargs, invalid, text):
    ticks = _gpu_ticks([300.0] * 4, **kwargs)
    summary = summarize(ticks, 0, 3 * S, ["cuda:0"])
    if invalid is None:
        assert summary.flags == []
        return
    assert any(text in f for f in summary.flags), summary.flags
    assert bool(summary.invalid_flags) is invalid


def test_a_jetson_reports_the_module_energy():
    ticks = []
    for i in range(3):
        ticks.append(Tick(i, i * S, [
            Reading(source="jetson", device="board", power_w=20.0, rails_w={"VDD_IN": 20.0}),
            Reading(source="jetson", device="cuda:0", power_w=12.0, util_pct=99.0),
            Reading(source="cpu", device="cpu", util_pct=30.0),
        ]))
    summary = summarize(ticks, 0, 2 * S, ["dla:0"])
    assert summary.energy_devices == ["board"]
    assert summary.energy_j == pytest.approx(40.0)
    assert summary.record(80)["energy_by_device_j"]["cuda:0"] == pytest.approx(24.0)
