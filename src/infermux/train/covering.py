"""Which configurations to profile: a covering design over the knob levels and the model's cells.

`choose_profiled` takes the few configurations a `train-predict` run profiles, covering every
pair of knob levels and every cell the simple model fits a line in (`model_cell`); `covered`
says whether a configuration's cell lies inside profiled ones (else it is extrapolated).
"""

from __future__ import annotations

from typing import Any

from infermux.train.knobs import Knobs

__all__ = ["choose_profiled", "covered", "covering_order", "model_cell"]


def _levels(knobs: Knobs) -> tuple[Any, ...]:
    return (knobs.batch, knobs.workers, knobs.prefetch_factor, knobs.pin_memory,
            knobs.persistent_workers, knobs.storage, knobs.cores, knobs.precision)


def choose_profiled(configs: list[Knobs], count: int) -> list[int]:
    """`count` configurations that cover every pair of knob levels as far as they can.

    Greedy pairwise coverage (a covering array, the usual design for few runs over many
    factors), ties broken by the distance to the configurations chosen so far, then grid order.
    Where `count` allows, every cell the simple model fits a line in the batch over (cores,
    precision, with or without loader workers) gets its smallest and its largest batch first:
    a line from a single batch size is a guess, and pairwise coverage alone leaves such cells.
    """
    count = max(1, min(count, len(configs)))
    return sorted(covering_order(configs, count, limit=count))


def model_cell(k: Knobs) -> tuple[Any, ...]:
    """The simple model's cell of a configuration: (cores, precision, with workers, batch)."""
    return (k.cores, k.precision, k.workers > 0, k.batch)


def _cells(configs: list[Knobs]) -> list[Any]:
    ends = (min(k.batch for k in configs), max(k.batch for k in configs))
    return [model_cell(k) if k.batch in ends else None for k in configs]


def covering_order(configs: list[Knobs], count: int, limit: int | None = None) -> list[int]:
    """The configurations in the order the covering design of `choose_profiled` adds them.

    The model's cells come first where there are no more of them than `count` (the number of
    configurations that will be taken from the front of the order); `limit`: only that many.
    """
    levels = [_levels(k) for k in configs]
    cell = _cells(configs)
    by_cell = len({c for c in cell if c is not None}) <= count
    factors = range(len(levels[0]))
    ordinal = [sorted({lv[f] for lv in levels}, key=str) for f in factors]

    def pairs(lv: tuple[Any, ...]) -> set[tuple[int, Any, int, Any]]:
        return {(f, lv[f], g, lv[g]) for f in factors for g in factors if f < g}

    def distance(a: tuple[Any, ...], b: tuple[Any, ...]) -> float:
        return sum(abs(ordinal[f].index(a[f]) - ordinal[f].index(b[f])) / max(1, len(ordinal[f]) - 1)
                   for f in factors)

    chosen: list[int] = []
    covered: set[tuple[int, Any, int, Any]] = set()
    cells_covered: set[Any] = set()
    stop = len(configs) if limit is None else min(limit, len(configs))
    while len(chosen) < stop:
        best, best_score = None, (-1.0, -1.0, -1.0)
        for i, lv in enumerate(levels):
            if i in chosen:
                continue
            new_cell = float(by_cell and cell[i] is not None and cell[i] not in cells_covered)
            gain = len(pairs(lv) - covered)
            spread = min((distance(lv, levels[j]) for j in chosen), default=0.0)
            if (new_cell, gain, spread) > best_score:
                best, best_score = i, (new_cell, gain, spread)
        assert best is not None
        chosen.append(best)
        covered |= pairs(levels[best])
        cells_covered.add(cell[best])
    return chosen


def covered(knobs: Knobs, profiled: list[Knobs], probed: list[Knobs] | tuple[()] = ()) -> bool:
    """Whether a configuration's model cell was profiled or lies inside profiled ones.

    The cell is (cores, precision, with or without workers, batch); a batch size between two
    profiled ones of the same (cores, precision, workers) group is interpolated by its lines.
    `probed`: compute probes (`profile.measure_compute`); a batch size whose compute was probed,
    in a (cores, precision, workers) group profiled at another batch size, is covered: its
    compute is measured, its loader's and start-up's terms are per item or per worker.
    """
    group = [p.batch for p in profiled if model_cell(p)[:3] == model_cell(knobs)[:3]]
    if knobs.batch in group or bool(group and min(group) < knobs.batch < max(group)):
        return True
    return bool(group) and any(
        (p.cores, p.precision, p.batch) == (knobs.cores, knobs.precision, knobs.batch)
        for p in probed)
