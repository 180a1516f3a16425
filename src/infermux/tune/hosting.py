"""How a server tune hosts its CPU workers: processes or threads, decided on repeated peaks.

The tune measures the chosen plan's find-peak with its CPU workers as processes and as threads,
alternated (process, thread, process, thread) so that a host's drift over the run falls on both,
and writes the hosting `choose_hosting` picks from those peaks. One peak of each does not rank
them on a shared host: one stall in a trial of a few hundred queries moves its p99 past the
bound and the edge by a bisection step.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HOSTINGS", "TIE_SHARE", "HostingChoice", "HostingPeak", "choose_hosting",
           "hosting_word"]

#: The two ways the runtime hosts CPU workers; the first is its default.
HOSTINGS = ("process", "thread")

#: Median peaks closer than this share of the higher one are a tie: one find-peak's bisection
#: step and its confirmation's spread are about this wide on a shared host.
TIE_SHARE = 0.05


@dataclass(frozen=True)
class HostingPeak:
    """One find-peak of the plan under one hosting.

    `peak_qps` is None when no rate held the bound (it counts as 0 in the median); `p99_ms` is
    the p99 of the trial at the peak rate.
    """

    cpu_workers: str
    peak_qps: float | None
    p99_ms: float | None = None
    edge_confirmed: bool | None = None


@dataclass
class HostingChoice:
    """The hosting written, the figures it was decided on, and why, in words."""

    cpu_workers: str
    median_peak_qps: dict[str, float]
    median_p99_ms: dict[str, float | None]
    peaks_qps: dict[str, list[float | None]]
    reason: str
    runs: list[HostingPeak] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the tune's result and its store record)."""
        return {"cpu_workers": self.cpu_workers, "median_peak_qps": self.median_peak_qps,
                "median_p99_ms": self.median_p99_ms, "peaks_qps": self.peaks_qps,
                "reason": self.reason, "tie_share": TIE_SHARE,
                "runs": [{"cpu_workers": r.cpu_workers, "peak_qps": r.peak_qps,
                          "p99_ms": r.p99_ms, "edge_confirmed": r.edge_confirmed}
                         for r in self.runs]}


def hosting_word(hosting: str) -> str:
    """How a `cpu_workers` value reads in a sentence: processes, threads."""
    return {"process": "processes", "thread": "threads"}.get(hosting, hosting)


def choose_hosting(runs: Sequence[HostingPeak], *, tie_share: float = TIE_SHARE
                   ) -> HostingChoice:
    """The hosting with the higher median peak; within `tie_share`, the lower median p99.

    A run without a peak counts as 0 queries/s. Medians, not means or the best run: one lucky or
    stalled find-peak of the two or four does not decide. When the medians are within
    `tie_share` of the higher, the peaks sit on the same rung of the search, and the hosting
    whose peak trials had the lower median p99 keeps more of the bound at that rate; with no
    p99 to compare either, the runtime's default (processes) is kept. A hosting with no run is
    not chosen.
    """
    if not runs:
        raise ValueError("choose_hosting needs at least one find-peak run")
    peaks: dict[str, list[float | None]] = {}
    p99s: dict[str, list[float]] = {}
    for r in runs:
        peaks.setdefault(r.cpu_workers, []).append(r.peak_qps)
        if r.peak_qps is not None and r.p99_ms is not None:
            p99s.setdefault(r.cpu_workers, []).append(r.p99_ms)
    medians = {h: float(statistics.median([p or 0.0 for p in ps])) for h, ps in peaks.items()}
    mid_p99: dict[str, float | None] = {
        h: (float(statistics.median(p99s[h])) if p99s.get(h) else None) for h in peaks}
    order = sorted(medians, key=lambda h: (-medians[h], HOSTINGS.index(h)
                                           if h in HOSTINGS else len(HOSTINGS)))
    top = order[0]

    def said(h: str) -> str:
        return f"{hosting_word(h)} {medians[h]:.1f}"

    if len(order) == 1:
        return HostingChoice(top, medians, mid_p99, peaks,
                             f"only {hosting_word(top)} measured (median peak {medians[top]:.1f} "
                             "queries/s)", list(runs))
    other = order[1]
    counts = "/".join(str(len(peaks[h])) for h in (top, other))
    if medians[top] <= 0:
        return HostingChoice(HOSTINGS[0] if HOSTINGS[0] in medians else top, medians, mid_p99,
                             peaks, "neither hosting held the bound: the runtime's default "
                             "(processes) is kept", list(runs))
    gap = (medians[top] - medians[other]) / medians[top]
    if gap > tie_share:
        return HostingChoice(top, medians, mid_p99, peaks,
                             f"median peaks {said(top)} vs {said(other)} queries/s "
                             f"({counts} runs, {gap:.0%} apart)", list(runs))
    a, b = mid_p99.get(top), mid_p99.get(other)
    if a is not None and b is not None and a != b:
        pick = top if a < b else other
        rest = other if pick == top else top
        return HostingChoice(pick, medians, mid_p99, peaks,
                             f"median peaks {said(top)} vs {said(other)} queries/s are within "
                             f"{tie_share:.0%} ({counts} runs): {hosting_word(pick)} held the lower "
                             f"p99 at the peak ({mid_p99[pick]:.1f} vs {mid_p99[rest]:.1f} ms)",
                             list(runs))
    pick = HOSTINGS[0] if HOSTINGS[0] in medians else top
    return HostingChoice(pick, medians, mid_p99, peaks,
                         f"median peaks {said(top)} vs {said(other)} queries/s are within "
                         f"{tie_share:.0%} ({counts} runs) with no p99 to tell them apart: the "
                         "runtime's default (processes) is kept", list(runs))
