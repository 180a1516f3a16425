"""Statistics derived from raw samples; the samples are the record, these are views of it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["PERCENTILES", "latency_summary_ms"]

PERCENTILES = (50, 90, 95, 99)


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
