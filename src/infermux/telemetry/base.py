"""The source contract: a `Source` reads its devices once per tick into `Reading`s.

One unit inside: watts, joules, percent, MHz, °C, bytes, nanoseconds (`time.perf_counter_ns`,
the clock the benchmark uses, so a window [t0_ns, t1_ns] of a measurement slices the series
directly). Vendor units (mW, mJ, µJ, kHz, m°C) are converted at the vendor boundary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

__all__ = [
    "EmptySource",
    "Reading",
    "Source",
    "SourceUnavailable",
    "Tick",
]

#: Reading fields that are stored as their own columns in the store (the rest go to JSON).
COLUMNS = ("power_w", "energy_j", "util_pct", "clock_mhz", "temp_c")


class SourceUnavailable(Exception):  # noqa: N818 - a probe outcome, not an error shown to users
    """A source cannot run on this machine; the message says why (and how to fix it if one can)."""


@dataclass
class Reading:
    """One device's state at one instant.

    `device` uses the unit vocabulary (`cuda:0`, `cpu`, `dla:0`) or `board` for whole-board
    figures (a Jetson's input rail). `energy_j` is a cumulative counter (joules since the source
    started, wraparound already undone); None where the hardware has no counter, in which case
    energy is integrated from `power_w`. Fields the source cannot read stay None.
    """

    source: str
    device: str
    power_w: float | None = None
    energy_j: float | None = None
    util_pct: float | None = None
    mem_util_pct: float | None = None
    mem_used_bytes: int | None = None
    clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    temp_c: float | None = None
    temp_slowdown_c: float | None = None
    #: Active clock-limiting reasons by name (`hw_thermal_slowdown`, `sw_power_cap`, ...).
    throttle: tuple[str, ...] = ()
    #: Other processes using the device (pids as the driver reports them); None = unknown.
    other_processes: tuple[int, ...] | None = None
    #: Named sub-readings in watts: Jetson rails, RAPL domains.
    rails_w: dict[str, float] = field(default_factory=dict)
    #: Per-core utilisation (CPU).
    cores_util_pct: tuple[float, ...] = ()
    #: Anything else, units in the key (`emc_load_pct`, `process_cpu_pct`, `dla_clock_mhz`).
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self, *, compact: bool = True) -> dict[str, Any]:
        """A JSON-ready dict; `compact` drops empty fields."""
        data = asdict(self)
        data["throttle"] = list(self.throttle)
        data["cores_util_pct"] = list(self.cores_util_pct)
        if self.other_processes is not None:
            data["other_processes"] = list(self.other_processes)
        if compact:
            data = {k: v for k, v in data.items() if v not in (None, (), [], {})}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Reading:
        """The inverse of `to_dict` (used when reading the store)."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        for key in ("throttle", "cores_util_pct"):
            if key in known:
                known[key] = tuple(known[key])
        if known.get("other_processes") is not None:
            known["other_processes"] = tuple(known["other_processes"])
        return cls(**known)


@dataclass
class Tick:
    """One pass of the sampler over every source: when, what it read, and what reading cost."""

    seq: int
    t_ns: int
    readings: list[Reading]
    #: Wall and CPU time the sampler thread spent reading this tick (its own cost).
    cost_wall_ns: int = 0
    cost_cpu_ns: int = 0

    def get(self, device: str) -> list[Reading]:
        """The readings of one device (a device can be read by several sources)."""
        return [r for r in self.readings if r.device == device]


class Source(ABC):
    """A family of hardware counters (NVML, CPU/RAPL, Jetson sysfs) read once per tick.

    Constructors probe the hardware and raise `SourceUnavailable` with the reason when they
    cannot run; `read` never raises for a transient failure (it leaves the field None).
    """

    #: Registry name, also written into every reading.
    name: ClassVar[str]

    def __init__(self) -> None:
        self.notes: list[str] = []

    @property
    @abstractmethod
    def devices(self) -> list[str]:
        """The devices this source reads, in the unit vocabulary (`cuda:0`, `cpu`, `board`)."""

    @abstractmethod
    def read(self) -> list[Reading]:
        """Read every device once."""

    def describe(self) -> dict[str, Any]:
        """Static facts for the record: what is read, from where, and the notes."""
        return {"source": self.name, "devices": self.devices, "notes": list(self.notes)}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release handles; the default holds none."""


class EmptySource(Source):
    """The stand-in when no source can run: reads nothing, says why in its notes."""

    name = "none"

    def __init__(self, reasons: list[str] | None = None) -> None:
        super().__init__()
        self.notes = list(reasons or ["no telemetry source is available on this machine"])

    @property
    def devices(self) -> list[str]:
        """No devices."""
        return []

    def read(self) -> list[Reading]:
        """Nothing to read."""
        return []
