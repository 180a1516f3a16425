"""Telemetry: power, energy, utilisation, clocks and throttling, sampled beside every run.

Hardware at the bottom (`nvml`, `cpu`, `jetson`: one `Source` each behind `base.Source`),
sampling in the middle (`sampler.Sampler`: a background thread with a ready handshake and a
bounded buffer), measurement on top (`energy`: energy of a window from counters or integrated
power, per-device utilisation, validity flags).

    with Sampler.for_units(units) as sampler:
        t0 = time.perf_counter_ns(); work(); t1 = time.perf_counter_ns()
        summary = sampler.window(t0, t1).summary([u.device for u in units])
        summary.record(items)   # energy_per_item_j, mean_power_w, items_per_s_per_w, ...
"""

from infermux.telemetry.base import EmptySource, Reading, Source, SourceUnavailable, Tick
from infermux.telemetry.energy import (
    EnergySummary,
    TelemetryWindow,
    counter_energy_j,
    integrate_power_j,
    summarize,
)
from infermux.telemetry.sampler import DEFAULT_INTERVAL_S, Sampler, SamplerCost, probe_sources

__all__ = [
    "DEFAULT_INTERVAL_S",
    "EmptySource",
    "EnergySummary",
    "Reading",
    "Sampler",
    "SamplerCost",
    "Source",
    "SourceUnavailable",
    "TelemetryWindow",
    "Tick",
    "counter_energy_j",
    "integrate_power_j",
    "probe_sources",
    "summarize",
]
