"""Energy over a window: counters where the hardware has them, power integrated otherwise.

- A cumulative counter (NVML's total energy, RAPL) gives the window's energy as the counter's
  difference between t0 and t1, each interpolated linearly between the two ticks around it.
- Power alone (GPUs without the counter, Jetson rails) is integrated with the trapezoid rule
  over the piecewise-linear power trace, clipped to [t0, t1] by interpolation; a trace that
  does not cover the whole window is extended at its mean power and the result says so.

Which energy a result reports: the devices that ran the measured units (`cuda:N` → that GPU's
board power; `cpu` → the CPU packages, where RAPL is readable); on a Jetson, the whole module
(its GPU, DLAs and CPU share one DRAM and rail set, so only the module figure is honest). The
other devices' energy is listed beside it, never added silently.

Validity. Flags that make a point invalid are the ones that mean the measured performance is
not the device's own steady state: thermal or hardware slowdown (`hw_slowdown`,
`hw_thermal_slowdown`, `sw_thermal_slowdown`, `hw_power_brake_slowdown`), the temperature
reaching the GPU's slowdown threshold, and another process using the GPU (contention). Flags
that are recorded but leave the point valid: software power capping (`sw_power_cap`: a GPU at
its power limit under full load is its sustained state, not a disturbance) and clocks moving
by more than 10% over the window (boost clocks move under power management; the spread is
reported so a reader can judge).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from infermux.telemetry.base import Reading, Tick

__all__ = [
    "CLOCK_SPREAD_LIMIT",
    "DISTURBING_THROTTLE",
    "DeviceSummary",
    "EnergySummary",
    "TelemetryWindow",
    "counter_energy_j",
    "integrate_power_j",
    "summarize",
]

#: Throttle reasons that make a point invalid.
DISTURBING_THROTTLE = ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                       "hw_power_brake_slowdown")
#: Relative clock spread ((max - min) / max) above which `clocks_moved` is flagged.
CLOCK_SPREAD_LIMIT = 0.10


def _interp(t: Sequence[int], y: Sequence[float], at: int) -> float:
    """Value at time `at` on the piecewise-linear curve through (t, y); constant beyond the ends."""
    if at <= t[0]:
        return y[0]
    if at >= t[-1]:
        return y[-1]
    lo, hi = 0, len(t) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if t[mid] <= at:
            lo = mid
        else:
            hi = mid
    span = t[hi] - t[lo]
    if span == 0:
        return y[hi]
    return y[lo] + (y[hi] - y[lo]) * (at - t[lo]) / span


def integrate_power_j(times_ns: Sequence[int], power_w: Sequence[float], t0_ns: int,
                      t1_ns: int) -> tuple[float, float]:
    """Energy in joules of a power trace over [t0_ns, t1_ns] ∩ the trace, and the seconds covered.

    The trace is taken as piecewise linear between samples (the trapezoid rule), so a trace
    that is linear in time is integrated exactly.
    """
    if len(times_ns) != len(power_w):
        raise ValueError("times_ns and power_w differ in length")
    if not times_ns or t1_ns <= t0_ns:
        return 0.0, 0.0
    lo, hi = max(t0_ns, times_ns[0]), min(t1_ns, times_ns[-1])
    if hi <= lo:
        return 0.0, 0.0
    points = [(lo, _interp(times_ns, power_w, lo))]
    points += [(t, p) for t, p in zip(times_ns, power_w, strict=True) if lo < t < hi]
    points.append((hi, _interp(times_ns, power_w, hi)))
    joules = 0.0
    for (ta, pa), (tb, pb) in itertools.pairwise(points):
        joules += (pa + pb) / 2.0 * (tb - ta) / 1e9
    return joules, (hi - lo) / 1e9


def counter_energy_j(times_ns: Sequence[int], energy_j: Sequence[float], t0_ns: int,
                     t1_ns: int) -> tuple[float, float]:
    """Energy of a cumulative counter over [t0_ns, t1_ns] ∩ the trace, and the seconds covered."""
    if not times_ns or t1_ns <= t0_ns:
        return 0.0, 0.0
    lo, hi = max(t0_ns, times_ns[0]), min(t1_ns, times_ns[-1])
    if hi <= lo:
        return 0.0, 0.0
    return _interp(times_ns, energy_j, hi) - _interp(times_ns, energy_j, lo), (hi - lo) / 1e9


@dataclass
class DeviceSummary:
    """One device over a window."""

    device: str
    source: str
    energy_j: float | None = None
    energy_method: str = "none"  # counter | power-integrated | none
    mean_power_w: float | None = None
    peak_power_w: float | None = None
    util_pct: float | None = None
    mem_util_pct: float | None = None
    clock_mhz: float | None = None
    clock_min_mhz: float | None = None
    clock_max_mhz: float | None = None
    temp_max_c: float | None = None
    temp_slowdown_c: float | None = None
    throttle: list[str] = field(default_factory=list)
    other_processes: list[int] = field(default_factory=list)
    coverage: float = 0.0  # share of the window the trace covered

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, empty fields dropped."""
        return {k: v for k, v in asdict(self).items() if v not in (None, [], {})}


@dataclass
class EnergySummary:
    """A window's energy, power, utilisation per device, and its validity flags."""

    t0_ns: int
    t1_ns: int
    ticks: int
    devices: dict[str, DeviceSummary]
    energy_devices: list[str]
    energy_j: float | None
    energy_source: str
    flags: list[str]
    invalid_flags: list[str]

    @property
    def duration_s(self) -> float:
        """Length of the window."""
        return (self.t1_ns - self.t0_ns) / 1e9

    @property
    def mean_power_w(self) -> float | None:
        """Mean power of the energy devices over the window."""
        if self.energy_j is None or self.duration_s <= 0:
            return None
        return self.energy_j / self.duration_s

    @property
    def peak_power_w(self) -> float | None:
        """Sum of the energy devices' peak sampled powers (an upper bound of the joint peak)."""
        peaks = [self.devices[d].peak_power_w for d in self.energy_devices]
        if not peaks or any(p is None for p in peaks):
            return None
        return float(sum(p for p in peaks if p is not None))

    def record(self, items: int) -> dict[str, Any]:
        """The fields a benchmark record gains: energy per item, power, efficiency, utilisation."""
        energy_per_item = self.energy_j / items if self.energy_j is not None and items else None
        items_per_s_per_w = (items / self.energy_j) if self.energy_j and items else None
        return {
            "energy_j": self.energy_j,
            "energy_per_item_j": energy_per_item,
            "mean_power_w": self.mean_power_w,
            "peak_power_w": self.peak_power_w,
            "items_per_s_per_w": items_per_s_per_w,
            "energy_source": self.energy_source,
            "energy_devices": self.energy_devices,
            "energy_by_device_j": {d: s.energy_j for d, s in self.devices.items()
                                   if s.energy_j is not None},
            "utilisation": {d: s.to_dict() for d, s in self.devices.items()},
            "telemetry_flags": self.flags,
            "telemetry_ticks": self.ticks,
        }


def _device_summary(device: str, readings: list[tuple[int, Reading]], t0: int, t1: int) -> DeviceSummary:
    source = readings[0][1].source
    out = DeviceSummary(device=device, source=source)
    inside = [r for t, r in readings if t0 <= t <= t1] or [r for _, r in readings]
    window_s = (t1 - t0) / 1e9
    counter = [(t, r.energy_j) for t, r in readings if r.energy_j is not None]
    power = [(t, r.power_w) for t, r in readings if r.power_w is not None]
    covered = 0.0
    if len(counter) >= 2:
        joules, covered = counter_energy_j([t for t, _ in counter], [e for _, e in counter], t0, t1)
        out.energy_method = "counter"
    elif len(power) >= 2:
        joules, covered = integrate_power_j([t for t, _ in power], [p for _, p in power], t0, t1)
        out.energy_method = "power-integrated"
    if covered > 0 and window_s > 0:
        out.coverage = min(1.0, covered / window_s)
        out.energy_j = joules * window_s / covered  # extended at the covered mean power
        out.mean_power_w = out.energy_j / window_s
    elif len(power) == 1 and window_s > 0:
        out.energy_j = power[0][1] * window_s
        out.energy_method = "power-integrated"
        out.mean_power_w = power[0][1]
    powers = [r.power_w for r in inside if r.power_w is not None]
    out.peak_power_w = max(powers) if powers else None

    def mean(values: Iterable[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return sum(vals) / len(vals) if vals else None

    out.util_pct = mean(r.util_pct for r in inside)
    out.mem_util_pct = mean(r.mem_util_pct for r in inside)
    clocks = [r.clock_mhz for r in inside if r.clock_mhz is not None]
    if clocks:
        out.clock_mhz = sum(clocks) / len(clocks)
        out.clock_min_mhz, out.clock_max_mhz = min(clocks), max(clocks)
    temps = [r.temp_c for r in inside if r.temp_c is not None]
    out.temp_max_c = max(temps) if temps else None
    out.temp_slowdown_c = next((r.temp_slowdown_c for r in inside if r.temp_slowdown_c), None)
    out.throttle = sorted({name for r in inside for name in r.throttle})
    out.other_processes = sorted({p for r in inside for p in (r.other_processes or ())})
    return out


def _flags(summary: DeviceSummary) -> tuple[list[str], list[str]]:
    """(all flags, the invalidating ones) of one device."""
    flags: list[str] = []
    invalid: list[str] = []
    d = summary.device
    disturbing = [t for t in summary.throttle if t in DISTURBING_THROTTLE]
    if disturbing:
        flag = f"{d}: clocks slowed by {', '.join(disturbing)}"
        flags.append(flag)
        invalid.append(flag)
    if "sw_power_cap" in summary.throttle:
        flags.append(f"{d}: at its power limit (sw_power_cap)")
    if summary.other_processes:
        flag = f"{d}: {len(summary.other_processes)} other process(es) on the device " \
               f"(pids {', '.join(map(str, summary.other_processes[:5]))})"
        flags.append(flag)
        invalid.append(flag)
    if summary.temp_max_c is not None and summary.temp_slowdown_c is not None and (
            summary.temp_max_c >= summary.temp_slowdown_c):
        flag = (f"{d}: temperature {summary.temp_max_c:.0f}°C reached the slowdown point "
                f"{summary.temp_slowdown_c:.0f}°C")
        flags.append(flag)
        invalid.append(flag)
    if d != "cpu" and summary.clock_max_mhz and summary.clock_min_mhz is not None:
        spread = (summary.clock_max_mhz - summary.clock_min_mhz) / summary.clock_max_mhz
        if spread > CLOCK_SPREAD_LIMIT:
            flags.append(f"{d}: clocks moved {summary.clock_min_mhz:.0f}–"
                         f"{summary.clock_max_mhz:.0f} MHz ({spread:.0%})")
    if 0 < summary.coverage < 0.9:
        flags.append(f"{d}: telemetry covered {summary.coverage:.0%} of the window")
    return flags, invalid


def summarize(ticks: Sequence[Tick], t0_ns: int, t1_ns: int,
              unit_devices: Sequence[str] | None = None) -> EnergySummary:
    """Summarise `ticks` over [t0_ns, t1_ns]; energy is that of `unit_devices` (see module doc).

    `unit_devices` are Unit.device strings (`cuda:0`, `cpu`, `dla:1`); None takes every device
    with an energy figure.
    """
    series: dict[str, list[tuple[int, Reading]]] = {}
    for tick in ticks:
        for reading in tick.readings:
            series.setdefault(reading.device, []).append((tick.t_ns, reading))
    devices = {d: _device_summary(d, rs, t0_ns, t1_ns) for d, rs in series.items()}
    if "board" in devices:  # a Jetson: the module is the only honest scope
        wanted = ["board"]
    elif unit_devices is None:
        wanted = [d for d in devices if d != "board"]
    else:
        wanted = list(dict.fromkeys(d.split("/")[0] for d in unit_devices))
    energy_devices = [d for d in wanted if d in devices and devices[d].energy_j is not None]
    missing = [d for d in wanted if d not in energy_devices]
    if energy_devices and not missing:
        energy_j: float | None = sum(devices[d].energy_j or 0.0 for d in energy_devices)
        energy_source = ", ".join(
            f"{devices[d].source}-{devices[d].energy_method}({d})" for d in energy_devices)
    else:
        energy_j = None
        energy_source = "none" if not missing else f"none: no power reading for {', '.join(missing)}"
        energy_devices = []
    flags: list[str] = []
    invalid: list[str] = []
    for summary in devices.values():
        f, i = _flags(summary)
        flags += f
        invalid += i
    return EnergySummary(t0_ns, t1_ns, len(ticks), devices, energy_devices, energy_j,
                         energy_source, flags, invalid)


@dataclass
class TelemetryWindow:
    """The ticks of one measured window, with what sampling cost and what was sampled."""

    t0_ns: int
    t1_ns: int
    ticks: list[Tick]
    cost: Any  # SamplerCost
    setup: dict[str, Any] = field(default_factory=dict)

    def summary(self, unit_devices: Sequence[str] | None = None) -> EnergySummary:
        """Energy, power, utilisation and flags over the window (see `summarize`)."""
        return summarize(self.ticks, self.t0_ns, self.t1_ns, unit_devices)

    def rows(self) -> list[dict[str, Any]]:
        """One row per (tick, reading) for the store; times relative to the window start."""
        rows = []
        for tick in self.ticks:
            for reading in tick.readings:
                rows.append({"seq": tick.seq, "t_ns": tick.t_ns - self.t0_ns,
                             "reading": reading})
        return rows
