"""The figures of a characterization, from plain arrays: accuracy, agreement, spread between runs.

Pure numpy, so the figures can be checked independently and computed in a build's own process.

- Proportions (top-1, top-5, agreement with the fp32 reference) carry Wilson score intervals
  (95%): unlike the normal approximation they stay inside [0, 1] and are honest at 0 or 100%.
- The mean absolute logit error carries a normal-approximation interval over items (each item's
  mean error is one observation; the items are independent, there are hundreds of them).
- Spread between output sets (builds, repeated runs, batch sizes): how many are byte-identical,
  the largest absolute difference from the first, and the items whose top-1 class is not the
  same in all of them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "Proportion",
    "Spread",
    "accuracy_figures",
    "digest",
    "mean_interval",
    "spread",
    "top1_flips",
    "wilson",
]

#: z for 95% two-sided intervals.
Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion `successes / n` (95% by default)."""
    if n <= 0:
        return (math.nan, math.nan)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True)
class Proportion:
    """`k` of `n`, as a share with its 95% Wilson interval."""

    k: int
    n: int
    value: float
    low: float
    high: float

    @classmethod
    def of(cls, hits: np.ndarray) -> Proportion:
        """The share of True in a boolean array."""
        k, n = int(np.count_nonzero(hits)), int(hits.size)
        low, high = wilson(k, n)
        return cls(k, n, k / n if n else math.nan, low, high)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


def mean_interval(values: np.ndarray, z: float = Z95) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` with a normal-approximation 95% interval."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if values.size == 0:
        return (math.nan, math.nan, math.nan)
    mean = float(values.mean())
    if values.size < 2:
        return (mean, mean, mean)
    half = z * float(values.std(ddof=1)) / math.sqrt(values.size)
    return (mean, mean - half, mean + half)


def accuracy_figures(logits: np.ndarray, labels: np.ndarray | None,
                     reference: np.ndarray) -> dict[str, Any]:
    """Accuracy against labels, agreement with the reference, and logit error, for (N, C) logits.

    - `top1`, `top5`: against `labels` (None without labels; top-5 needs at least 5 classes);
    - `agree_top1`: items whose top-1 class is the reference's;
    - `max_abs_err`, `mean_abs_err` (with its interval): |logits − reference| over every logit;
    - `rel_err`: the max absolute error over the largest |reference| logit (the output's scale),
      `mean_rel_err`: the mean absolute error over the mean |reference| logit.
    """
    got = np.asarray(logits, dtype=np.float64).reshape(len(logits), -1)
    ref = np.asarray(reference, dtype=np.float64).reshape(len(reference), -1)
    if got.shape != ref.shape:
        raise ValueError(f"outputs {got.shape} and reference {ref.shape} differ in shape")
    figures: dict[str, Any] = {"items": len(got), "classes": int(got.shape[1])}
    if labels is not None and got.shape[1] > 1:
        y = np.asarray(labels).reshape(-1)
        figures["top1"] = Proportion.of(got.argmax(axis=1) == y).to_dict()
        if got.shape[1] >= 5:
            top5 = np.argsort(-got, axis=1, kind="stable")[:, :5]
            figures["top5"] = Proportion.of(np.any(top5 == y[:, None], axis=1)).to_dict()
        else:
            figures["top5"] = None
    else:
        figures["top1"] = figures["top5"] = None
    figures["agree_top1"] = Proportion.of(got.argmax(axis=1) == ref.argmax(axis=1)).to_dict()
    err = np.abs(got - ref)
    figures["max_abs_err"] = float(err.max()) if err.size else 0.0
    mean, low, high = mean_interval(err.mean(axis=1))
    figures["mean_abs_err"] = {"value": mean, "low": low, "high": high}
    scale = float(np.abs(ref).max()) or 1.0
    mean_scale = float(np.abs(ref).mean()) or 1.0
    figures["rel_err"] = figures["max_abs_err"] / scale
    figures["mean_rel_err"] = mean / mean_scale
    return figures


def digest(array: np.ndarray) -> str:
    """A hash of an array's exact bytes, shape and dtype: equal digests mean identical outputs."""
    a = np.ascontiguousarray(array)
    h = hashlib.sha256(f"{a.dtype}|{a.shape}".encode())
    h.update(a.tobytes())
    return h.hexdigest()[:16]


def top1_flips(outputs: Sequence[np.ndarray]) -> int:
    """Items whose top-1 class is not the same in every one of `outputs` ((N, C) each)."""
    if len(outputs) < 2:
        return 0
    picks = np.stack([np.asarray(o).reshape(len(o), -1).argmax(axis=1) for o in outputs])
    return int(np.count_nonzero(np.any(picks != picks[0], axis=0)))


@dataclass(frozen=True)
class Spread:
    """How output sets of the same inputs differ: distinct sets, largest difference, top-1 flips."""

    sets: int
    distinct: int
    max_abs_diff: float
    top1_flips: int
    items: int

    @property
    def varies(self) -> bool:
        """True when not every set is byte-identical to the others."""
        return self.distinct > 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


def spread(outputs: Sequence[np.ndarray]) -> Spread:
    """Compare output sets of the same inputs (each (N, C)): see `Spread`."""
    if not outputs:
        return Spread(0, 0, 0.0, 0, 0)
    first = np.asarray(outputs[0], dtype=np.float64)
    diff = 0.0
    for other in outputs[1:]:
        d = np.abs(np.asarray(other, dtype=np.float64) - first)
        diff = max(diff, float(np.nanmax(d)) if d.size else 0.0)
    return Spread(len(outputs), len({digest(o) for o in outputs}), diff, top1_flips(outputs),
                  len(first))
