"""Statistics derived from raw samples; the samples are the record, these are views of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PERCENTILES", "LatencySummary", "latency_summary_ms"]

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """`latency_summary_ms` as a type: percentiles, max and mean in ms.

    A bench point's batch latency and every latency of a runtime trial use it.
    """

    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float

    def to_dict(self) -> dict[str, float]:
        """The keys `latency_summary_ms` gives, in its order."""
        return {"p50_ms": self.p50_ms, "p90_ms": self.p90_ms, "p95_ms": self.p95_ms,
                "p99_ms": self.p99_ms, "max_ms": self.max_ms, "mean_ms": self.mean_ms}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencySummary:
        """From `latency_summary_ms`'s output or a stored record carrying its keys."""
        return cls(float(data["p50_ms"]), float(data["p90_ms"]), float(data["p95_ms"]),
                   float(data["p99_ms"]), float(data["max_ms"]), float(data["mean_ms"]))


def latency_summary_ms(latencies_ns: Sequence[int]) -> dict[str, float]:
    """p50/p90/p95/p99/max/mean of latencies in milliseconds; empty input gives an empty dict."""
    if len(latencies_ns) == 0:
        return {}
    arr = np.asarray(latencies_ns, dtype=np.float64) / 1e6
    values = np.percentile(arr, PERCENTILES)
    summary = {f"p{p}_ms": float(v) for p, v in zip(PERCENTILES, values, strict=True)}
    summary["max_ms"] = float(arr.max())
    summary["mean_ms"] = float(arr.mean())
    return summary
