"""The knobs of a training run: one configuration (`Knobs`) and a grid of them (`Grid`).

A configuration is what the data loader and the training step are set to: loader workers,
prefetch factor, pinned memory, persistent workers, minibatch size, where the data lives, the
CPU core set, the precision. Values are checked when a configuration is built, and a bad one is
reported as one line naming it, what is allowed and the flag that fixes it.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from infermux.errors import UsageError
from infermux.units.base import parse_core_set

__all__ = ["OPTIMIZERS", "PRECISIONS", "Grid", "Knobs", "parse_bools", "parse_cores", "parse_ints"]

#: fp32; amp: autocast (fp16 on CUDA with a gradient scaler, bf16 on CPUs); bf16/fp16: autocast
#: in that dtype (fp16 only on CUDA).
PRECISIONS = ("fp32", "amp", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class Knobs:
    """One training configuration. `cores` None means every core this process may use."""

    batch: int
    workers: int = 0
    prefetch_factor: int = 2
    pin_memory: bool = False
    persistent_workers: bool = False
    storage: str = "disk"
    cores: tuple[int, ...] | None = None
    precision: str = "fp32"

    def validate(self, device: str = "cpu") -> None:
        """Reject impossible values with one line: the value, what is allowed, the flag."""
        if self.batch < 1:
            raise UsageError(f"--batch {self.batch} must be at least 1, e.g. --batch 16,64")
        if self.workers < 0:
            raise UsageError(f"--workers {self.workers} must be 0 (load in the training "
                             "process) or more, e.g. --workers 0,1,2")
        if self.prefetch_factor < 1:
            raise UsageError(f"--prefetch {self.prefetch_factor} must be at least 1 batch per "
                             "worker, e.g. --prefetch 2")
        if self.precision not in PRECISIONS:
            raise UsageError(f"--precision {self.precision!r} is not one of "
                             f"{', '.join(PRECISIONS)}: e.g. --precision fp32,amp")
        on_cuda = device.startswith("cuda")
        if self.precision == "fp16" and not on_cuda:
            raise UsageError("--precision fp16 needs a CUDA device: on a CPU use bf16 or amp "
                             "(bf16 autocast), or train on --unit cuda:0")
        if self.pin_memory and not on_cuda:
            raise UsageError("--pin-memory true needs a CUDA device (pinned pages speed up "
                             "host→device copies): use --pin-memory false on a CPU")
        if self.persistent_workers and self.workers == 0:
            raise UsageError("--persistent true needs loader workers: use --workers 1 or more, "
                             "or --persistent false")
        if self.cores is not None:
            allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            bad = [c for c in self.cores if allowed and c not in allowed]
            if bad or not self.cores:
                raise UsageError(
                    f"--cores {_cores_text(self.cores)}: core {bad[0] if bad else '?'} is not "
                    f"one this process may use ({_cores_text(tuple(allowed))}): e.g. --cores "
                    f"{allowed[0] if allowed else 0}")

    @property
    def threads(self) -> int:
        """Intra-op threads of the training process: one per core of its core set."""
        if self.cores is not None:
            return len(self.cores)
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)

    @property
    def label(self) -> str:
        """`b64 w2 pf2 tmpfs c0-1 fp32` (+ `pin`, `persist` when on)."""
        parts = [f"b{self.batch}", f"w{self.workers}"]
        if self.workers:
            parts.append(f"pf{self.prefetch_factor}")
        if self.pin_memory:
            parts.append("pin")
        if self.persistent_workers:
            parts.append("persist")
        parts += [self.storage, f"c{_cores_text(self.cores) if self.cores else 'all'}",
                  self.precision]
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        data = asdict(self)
        data["cores"] = list(self.cores) if self.cores is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Knobs:
        """The inverse of `to_dict`."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if known.get("cores") is not None:
            known["cores"] = tuple(known["cores"])
        return cls(**known)


def _cores_text(cores: tuple[int, ...] | None) -> str:
    if not cores:
        return "all"
    runs: list[str] = []
    start = prev = cores[0]
    for c in [*cores[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        runs.append(f"{start}" if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return "+".join(runs)


def parse_ints(text: str, flag: str, *, minimum: int) -> list[int]:
    """`"0,1,2"` → [0, 1, 2]; one line naming the flag for junk or values below `minimum`."""
    values = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise UsageError(f"{flag} {part!r} is not an integer: pass integers ≥ {minimum}, "
                             f"e.g. {flag} {minimum},{minimum + 1}") from None
        if value < minimum:
            raise UsageError(f"{flag} {value} must be at least {minimum}: e.g. {flag} "
                             f"{minimum},{minimum + 1}")
        values.append(value)
    if not values:
        raise UsageError(f"{flag} is empty: give at least one value, e.g. {flag} {minimum}")
    return list(dict.fromkeys(values))


def parse_bools(text: str, flag: str) -> list[bool]:
    """`"false,true"` → [False, True]."""
    table = {"true": True, "on": True, "yes": True, "1": True,
             "false": False, "off": False, "no": False, "0": False}
    values = []
    for part in (p.strip().lower() for p in str(text).split(",")):
        if not part:
            continue
        if part not in table:
            raise UsageError(f"{flag} {part!r} is not true or false: e.g. {flag} false,true")
        values.append(table[part])
    if not values:
        raise UsageError(f"{flag} is empty: e.g. {flag} false")
    return list(dict.fromkeys(values))


def parse_cores(text: str) -> list[tuple[int, ...] | None]:
    """`"0,0-1"` → [(0,), (0, 1)]; `all` → None (every core this process may use)."""
    sets: list[tuple[int, ...] | None] = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        if part == "all":
            sets.append(None)
            continue
        try:
            sets.append(parse_core_set(part))
        except UsageError:
            raise UsageError(f"--cores {part!r} is not a core set: write e.g. --cores 0,0-1 "
                             "(`+` joins ranges: 0-1+4-5), or all") from None
    if not sets:
        raise UsageError("--cores is empty: e.g. --cores all or --cores 0,0-1")
    return list(dict.fromkeys(sets))


@dataclass
class Grid:
    """Every combination of the listed values; combinations that cannot differ are merged.

    With no loader workers, prefetch factor and persistence do not apply: those combinations
    collapse into one (workers 0, prefetch 2, not persistent).
    """

    batch: list[int]
    workers: list[int] = field(default_factory=lambda: [0])
    prefetch_factor: list[int] = field(default_factory=lambda: [2])
    pin_memory: list[bool] = field(default_factory=lambda: [False])
    persistent_workers: list[bool] = field(default_factory=lambda: [False])
    storage: list[str] = field(default_factory=lambda: ["disk"])
    cores: list[tuple[int, ...] | None] = field(default_factory=lambda: [None])
    precision: list[str] = field(default_factory=lambda: ["fp32"])

    def configs(self, device: str = "cpu") -> list[Knobs]:
        """The grid's configurations in a stable order, each validated."""
        seen: dict[Knobs, None] = {}
        for b, w, pf, pin, per, st, co, pr in itertools.product(
                self.batch, self.workers, self.prefetch_factor, self.pin_memory,
                self.persistent_workers, self.storage, self.cores, self.precision):
            knobs = Knobs(b, w, pf, pin, per, st, co, pr)
            if w == 0:
                knobs = replace(knobs, prefetch_factor=2, persistent_workers=False)
            knobs.validate(device)
            seen.setdefault(knobs, None)
        return list(seen)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        data = asdict(self)
        data["cores"] = [list(c) if c is not None else None for c in self.cores]
        return data
