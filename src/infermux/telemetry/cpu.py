"""The host CPU: per-core and this-process utilisation (psutil), package energy (Linux RAPL).

RAPL energy comes from the powercap interface, `/sys/class/powercap/intel-rapl:*` (AMD's RAPL
appears there too): `energy_uj` is a counter in µJ that wraps at `max_energy_range_uj`. Since
Linux 5.10 (CVE-2020-8694) `energy_uj` is readable by root only, so on most machines it is not
readable by default; the source then reports utilisation only and says so in its notes.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from infermux.telemetry.base import Reading, Source

__all__ = ["CpuSource", "RaplDomain", "find_rapl", "wrap_delta"]

POWERCAP = Path("/sys/class/powercap")

#: Utilisation is a difference of tick counters that advance in the kernel's clock ticks
#: (10 ms at the usual 100 Hz). A read sooner than this after the previous one (a flush just
#: after a periodic tick) is measured from an earlier read, so it never reports 0 or nothing
#: for lack of a tick.
MIN_UTIL_WINDOW_S = 0.05


def _base(reads: deque[tuple[int, Any]], now_ns: int) -> tuple[int, Any]:
    """The newest read at least `MIN_UTIL_WINDOW_S` before `now_ns`, else the oldest kept."""
    for t_ns, value in reversed(reads):
        if now_ns - t_ns >= MIN_UTIL_WINDOW_S * 1e9:
            return t_ns, value
    return reads[0]


def wrap_delta(previous: int, current: int, max_range: int) -> int:
    """Increase of a counter that wraps to 0 after `max_range` (RAPL's `max_energy_range_uj`).

    One wrap between two reads is assumed; a 10 Hz sampler reads far more often than any RAPL
    counter wraps (minutes to hours).
    """
    if current >= previous:
        return current - previous
    return (max_range - previous) + current + 1


@dataclass
class RaplDomain:
    """One powercap zone: `package-0`, `core`, `uncore`, `dram`, `psys`."""

    path: Path
    name: str
    max_range_uj: int
    top_level: bool  # intel-rapl:N (a package or psys), not intel-rapl:N:M (a sub-domain)

    def read_uj(self) -> int:
        """The raw counter in µJ."""
        return int((self.path / "energy_uj").read_text())


def find_rapl(root: Path = POWERCAP) -> tuple[list[RaplDomain], str]:
    """The readable RAPL domains under `root`, and a note when there are none (why, how to fix)."""
    zones = sorted(p for p in root.glob("intel-rapl:*") if (p / "energy_uj").exists())
    if not zones:
        return [], (f"rapl: no {root}/intel-rapl:* zones (no RAPL driver, not an Intel/AMD "
                    "CPU, or a virtual machine): CPU energy is not measured")
    domains: list[RaplDomain] = []
    denied: list[str] = []
    for zone in zones:
        try:
            name = (zone / "name").read_text().strip()
            max_range = int((zone / "max_energy_range_uj").read_text())
            int((zone / "energy_uj").read_text())
        except PermissionError:
            denied.append(zone.name)
            continue
        except (OSError, ValueError):
            continue
        domains.append(RaplDomain(zone, name, max_range, top_level=zone.name.count(":") == 1))
    note = ""
    if denied and not domains:
        note = (f"rapl: {root}/{denied[0]}/energy_uj is not readable (permission denied; root "
                "only since Linux 5.10): run as root or `sudo chmod a+r "
                f"{root}/intel-rapl:*/energy_uj` to measure CPU energy")
    elif not domains:
        note = "rapl: powercap zones exist but none could be read: CPU energy is not measured"
    return domains, note


class _RaplCounter:
    """Cumulative joules of one domain since the source started, wraparound undone."""

    def __init__(self, domain: RaplDomain) -> None:
        self.domain = domain
        self.last_uj = domain.read_uj()
        self.total_uj = 0

    def update(self) -> float:
        current = self.domain.read_uj()
        self.total_uj += wrap_delta(self.last_uj, current, self.domain.max_range_uj)
        self.last_uj = current
        return self.total_uj / 1e6


class CpuSource(Source):
    """CPU utilisation per core and of this process; package energy where RAPL is readable.

    `cores` limits the unit's utilisation to a core set (`cpu:0-3`); all cores are still
    reported per core. Power is the RAPL energy difference over the time between two reads.
    """

    name = "cpu"

    def __init__(self, cores: Sequence[int] | None = None, powercap: Path = POWERCAP) -> None:
        super().__init__()
        self._cores = list(cores) if cores is not None else None
        self._process = psutil.Process()
        # Utilisation is computed from two reads of the tick counters (/proc/stat and
        # /proc/self/stat), one file each per tick: psutil's cpu_percent() reads more.
        now_ns = time.perf_counter_ns()
        self._core_reads: deque[tuple[int, Any]] = deque(
            [(now_ns, psutil.cpu_times(percpu=True))], maxlen=8)
        self._process_reads: deque[tuple[int, float]] = deque(
            [(now_ns, self._process_cpu_s())], maxlen=8)
        domains, note = find_rapl(powercap)
        if note:
            self.notes.append(note)
        self._rapl = [_RaplCounter(d) for d in domains]
        self._last: tuple[int, float] | None = None
        # Clocks only from cpufreq in sysfs: without it psutil parses /proc/cpuinfo (slow on
        # many-core hosts), whose "cpu MHz" is a fixed nominal value on most virtual machines.
        self._has_freq = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq").exists()
        if not self._has_freq:
            self.notes.append("cpu: no cpufreq in sysfs: CPU clocks are not recorded")

    @property
    def devices(self) -> list[str]:
        """The host CPU, as one device."""
        return ["cpu"]

    @property
    def has_energy(self) -> bool:
        """Whether a RAPL package counter is being read."""
        return any(c.domain.top_level for c in self._rapl)

    def describe(self) -> dict[str, Any]:
        """The RAPL domains read (if any), the core set and the notes."""
        data = super().describe()
        data["rapl_domains"] = [c.domain.name for c in self._rapl]
        data["cores"] = self._cores
        data["energy"] = "rapl-counter" if self.has_energy else "none"
        return data

    def _process_cpu_s(self) -> float:
        times = self._process.cpu_times()
        return float(times.user + times.system)

    def _cores_util_pct(self, now_ns: int) -> tuple[float, ...]:
        now = psutil.cpu_times(percpu=True)
        _, base = _base(self._core_reads, now_ns)
        self._core_reads.append((now_ns, now))
        util = []
        for before, after in zip(base, now, strict=False):
            total = sum(after) - sum(before)
            if total <= 0:  # no tick of the kernel's clock since the base read: no figure
                return ()
            idle = (after.idle - before.idle) + (getattr(after, "iowait", 0.0)
                                                 - getattr(before, "iowait", 0.0))
            util.append(max(0.0, min(100.0, 100.0 * (total - idle) / total)))
        return tuple(util)

    def read(self) -> list[Reading]:
        """One reading for the CPU."""
        cores = self._cores_util_pct(time.perf_counter_ns())
        chosen = [cores[i] for i in self._cores if i < len(cores)] if self._cores else list(cores)
        reading = Reading(
            source=self.name, device="cpu", cores_util_pct=cores,
            util_pct=sum(chosen) / len(chosen) if chosen else None,
        )
        with contextlib.suppress(psutil.Error):
            now_ns, cpu_s = time.perf_counter_ns(), self._process_cpu_s()
            last_ns, last_s = _base(self._process_reads, now_ns)
            if now_ns > last_ns:
                reading.extra["process_cpu_pct"] = 100.0 * (cpu_s - last_s) / ((now_ns - last_ns) / 1e9)
            self._process_reads.append((now_ns, cpu_s))
        if self._has_freq:
            freq = psutil.cpu_freq()
            if freq is not None and freq.current:
                reading.clock_mhz = float(freq.current)
        if self._rapl:
            now = time.perf_counter_ns()
            package_j = 0.0
            try:
                for counter in self._rapl:
                    joules = counter.update()
                    if counter.domain.top_level:
                        package_j += joules
                    reading.extra[f"rapl_{counter.domain.name}_energy_j"] = joules
            except (OSError, ValueError):
                return [reading]
            reading.energy_j = package_j
            if self._last is not None and now > self._last[0]:
                reading.power_w = (package_j - self._last[1]) / ((now - self._last[0]) / 1e9)
            self._last = (now, package_j)
        return [reading]
