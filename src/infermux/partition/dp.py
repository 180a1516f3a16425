"""Balancing: exact dynamic programming over contiguous segments and unit assignments.

A pipeline's throughput is set by its slowest stage. Given `n` atomic pieces in order and a cost
function `stage_time_s(i, j, units, prev)` (seconds per batch for pieces `i..j-1` on the unit set
`units`, fed from the unit set `prev`), `solve` finds the cut points and the unit set of every
stage that minimise the slowest stage, exactly, and the next best `top_k` plans too.

Why it is exact: a stage's time depends only on its own pieces, its units and the stage before it
(transfers are pulled by the consumer, see `transfer.py`), so the best bottleneck of a prefix ending
at boundary `j` with last units `L`, used units `U` and `s` stages does not depend on what comes
after. K-best: each state keeps its K smallest (bottleneck, plan) pairs; `max` is monotone, so the
K best plans through a state extend the K best plans into it.

A unit serves at most one stage (units are resources). A *placement* is a unit with an engine
(`cpu:0` runs torch, `cpu:0@openvino` OpenVINO): the search picks unit and engine per stage, and
two placements of one unit never serve two stages. A stage on several units is *duplicated*:
each unit runs whole batches of it, so their rates add up (`1 / Σ 1/t_u`), as in the research's
network duplication; one stage on every unit is plain data-parallel replication.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from infermux.errors import UsageError
from infermux.runtime.transfer import HOST

__all__ = [
    "Candidate", "ProfileCost", "StageChoice", "brute_force", "placement", "placement_engine",
    "placement_unit", "solve",
]

_Entry = tuple[float, tuple["StageChoice", ...]]
#: stage_time_s(first piece, end piece (exclusive), units, previous stage's units) → seconds.
StageTimeFn = Callable[[int, int, tuple[str, ...], tuple[str, ...]], float]


def placement(unit: str, engine: str) -> str:
    """The DP's name for running on `unit` with `engine`: `cpu:0` (torch) or `cpu:0@openvino`."""
    return unit if engine == "torch" else f"{unit}@{engine}"


def placement_unit(name: str) -> str:
    """The unit of a placement (`cpu:0@openvino` → `cpu:0`)."""
    return name.split("@", 1)[0]


def placement_engine(name: str) -> str:
    """The engine of a placement (`cpu:0@openvino` → `openvino`; a bare unit is torch)."""
    return name.split("@", 1)[1] if "@" in name else "torch"


def _unit_sets(units: Sequence[str], max_dup: int) -> list[tuple[str, ...]]:
    """Placement sets a stage may use: distinct units, one engine (a stage has one engine)."""
    sets = []
    for size in range(1, min(max_dup, len(units)) + 1):
        for combo in itertools.combinations(units, size):
            physical = [placement_unit(u) for u in combo]
            if len(set(physical)) == size and len({placement_engine(u) for u in combo}) == 1:
                sets.append(combo)
    return sets


@dataclass(frozen=True)
class StageChoice:
    """Pieces `start..end-1` on `units`, predicted `time_s` per batch."""

    start: int
    end: int
    units: tuple[str, ...]
    time_s: float


@dataclass(frozen=True)
class Candidate:
    """A plan found by the search: its stages and predicted bottleneck."""

    stages: tuple[StageChoice, ...]
    bottleneck_s: float

    def items_per_s(self, batch: int) -> float:
        """Predicted pipeline throughput at `batch` items per batch."""
        return batch / self.bottleneck_s if self.bottleneck_s > 0 else float("inf")

    @property
    def key(self) -> tuple[Any, ...]:
        """Identity of the plan (cuts and units), independent of the predicted times."""
        return tuple((s.start, s.end, s.units) for s in self.stages)


class ProfileCost:
    """The cost model over a `Profile`: pull in + compute + copy out, rates adding on duplication.

    Compute times are scaled by `profile.scale(unit)`: whole model with every unit busy ÷ sum of
    its pieces (`calibration="together"`, for pipelines, where every unit is busy), or whole
    model alone ÷ sum of pieces (`"alone"`, for one unit by itself), or not at all (`None`).
    A unit's time per batch in a stage is: the slowest pull of the incoming tensor from any unit of
    the previous stage (from the host for the first), plus the sum of its pieces' compute times,
    plus its copy of the outgoing tensor into its own output buffer (into the host for the last).
    """

    def __init__(self, profile: Any, *, calibration: str | None = "together") -> None:
        if calibration not in ("together", "alone", None):
            raise UsageError(f"calibration {calibration!r}: use together, alone or None")
        self.profile = profile
        scale = getattr(profile, "scale", None)

        def factor(unit: str) -> float:
            if calibration is None or scale is None:
                return 1.0
            return float(scale(unit, alone=calibration == "alone"))

        self._prefix = {
            unit: list(itertools.accumulate((t * factor(unit) for t in times), initial=0.0))
            for unit, times in profile.compute_s.items()
        }
        self.n = profile.pieces

    def unit_time_s(self, i: int, j: int, unit: str, prev: tuple[str, ...]) -> float:
        """Seconds per batch for `unit` running pieces `i..j-1` after `prev`."""
        transfers = self.profile.transfer_s
        here = placement_unit(unit)
        pull = max(transfers[(placement_unit(p), here)][i] for p in prev)
        out = transfers[(here, HOST)][j] if j == self.n else transfers[(here, here)][j]
        prefix = self._prefix[unit]
        return pull + prefix[j] - prefix[i] + out

    def __call__(self, i: int, j: int, units: tuple[str, ...], prev: tuple[str, ...]) -> float:
        """Seconds per batch of the stage: the units' rates add up."""
        rate = sum(1.0 / max(self.unit_time_s(i, j, u, prev), 1e-12) for u in units)
        return 1.0 / rate


def _check(n: int, units: Sequence[str], max_stages: int, max_dup: int, top_k: int) -> None:
    if n < 1:
        raise UsageError("a network with no segment cannot be partitioned")
    if not units:
        raise UsageError("no unit to place stages on: pass --units, e.g. cpu:0,cpu:1")
    if len(set(units)) != len(units):
        raise UsageError(f"units {list(units)} repeat a unit: name each unit once")
    for name, value in (("max stages", max_stages), ("max duplication", max_dup), ("top k", top_k)):
        if value < 1:
            raise UsageError(f"{name} {value} must be at least 1")


def solve(
    n: int,
    units: Sequence[str],
    stage_time_s: StageTimeFn,
    *,
    max_stages: int | None = None,
    max_dup: int = 1,
    top_k: int = 1,
) -> list[Candidate]:
    """The `top_k` plans with the smallest bottleneck, best first (exact; ties by fewer stages).

    `max_stages` defaults to the number of units; `max_dup` is how many units one stage may use.
    """
    max_stages = max_stages or len({placement_unit(u) for u in units})
    _check(n, units, max_stages, max_dup, top_k)
    unit_sets = _unit_sets(units, max_dup)
    # (boundary, last stage's units, used units, stages) → [(bottleneck, stages so far)]
    states: dict[tuple[int, tuple[str, ...], frozenset[str], int], list[_Entry]] = {
        (0, (HOST,), frozenset(), 0): [(0.0, ())]}
    finished: list[_Entry] = []
    for j in range(n):
        for key in [k for k in states if k[0] == j]:
            _, last, used, count = key
            entries = sorted(states.pop(key), key=_rank)[:top_k]
            if count == max_stages:
                continue
            for k in range(j + 1, n + 1):
                for combo in unit_sets:
                    physical = {placement_unit(u) for u in combo}
                    if used.intersection(physical):
                        continue
                    cost = stage_time_s(j, k, combo, last)
                    stage = StageChoice(j, k, combo, cost)
                    extended = [(max(v, cost), (*path, stage)) for v, path in entries]
                    if k == n:
                        finished.extend(extended)
                    else:
                        states.setdefault((k, combo, used.union(physical), count + 1), []).extend(
                            extended)
    best = sorted(finished, key=_rank)[:top_k]
    return [Candidate(path, value) for value, path in best]


def _rank(entry: tuple[float, tuple[StageChoice, ...]]) -> tuple[float, int, tuple[Any, ...]]:
    value, path = entry
    return (value, len(path), tuple((s.start, s.end, s.units) for s in path))


def brute_force(
    n: int,
    units: Sequence[str],
    stage_time_s: StageTimeFn,
    *,
    max_stages: int | None = None,
    max_dup: int = 1,
    top_k: int = 1,
) -> list[Candidate]:
    """Every contiguous split × every assignment of disjoint unit sets, ranked (for checking)."""
    max_stages = max_stages or len({placement_unit(u) for u in units})
    _check(n, units, max_stages, max_dup, top_k)
    unit_sets = _unit_sets(units, max_dup)
    found: list[tuple[float, tuple[StageChoice, ...]]] = []
    for stages in range(1, min(max_stages, n) + 1):
        for inner in itertools.combinations(range(1, n), stages - 1):
            bounds = (0, *inner, n)
            for sets in itertools.product(unit_sets, repeat=stages):
                flat = [placement_unit(u) for s in sets for u in s]
                if len(flat) != len(set(flat)):
                    continue
                path = []
                prev: tuple[str, ...] = (HOST,)
                for (i, j), combo in zip(itertools.pairwise(bounds), sets, strict=True):
                    path.append(StageChoice(i, j, combo, stage_time_s(i, j, combo, prev)))
                    prev = combo
                found.append((max(s.time_s for s in path), tuple(path)))
    best = sorted(found, key=_rank)[:top_k]
    return [Candidate(path, value) for value, path in best]
