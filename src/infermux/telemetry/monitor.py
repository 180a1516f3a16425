"""A monitoring window as one record, and its recording in the store (runs of kind `monitor`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infermux.store import Store
    from infermux.telemetry.energy import TelemetryWindow
    from infermux.telemetry.sampler import Sampler

__all__ = ["record_window", "window_report"]

#: The parts of a monitoring report kept as the stored run's summary.
SUMMARY_KEYS = ("duration_s", "summary", "energy_j", "energy_source", "flags", "sampler_cost")


def window_report(sampler: Sampler, window: TelemetryWindow, interval_s: float) -> dict[str, Any]:
    """What a monitoring window saw: sources, per-device summary, energy, flags, sampler cost."""
    summary = window.summary()
    setup = sampler.describe()
    return {
        "duration_s": (window.t1_ns - window.t0_ns) / 1e9,
        "interval_s": interval_s,
        "sources": setup["sources"],
        "notes": setup["notes"],
        "summary": {d: s.to_dict() for d, s in summary.devices.items()},
        "energy_j": summary.energy_j,
        "energy_source": summary.energy_source,
        "flags": summary.flags,
        "sampler_cost": window.cost.to_dict(),
        "latest": [r.to_dict() for r in (window.ticks[-1].readings if window.ticks else [])],
    }


def record_window(store: Store, window: TelemetryWindow, report: dict[str, Any], *,
                  config: dict[str, Any], command: str = "", interrupted: bool = False) -> int:
    """Store a window's time series and summary as a run of kind `monitor`; its id."""
    with store.recording("monitor", config, command) as rec:
        assert rec.run_id is not None
        store.add_telemetry(rec.run_id, None, window.rows())
        rec.status = "interrupted" if interrupted else "complete"
        rec.summary = {k: report[k] for k in SUMMARY_KEYS}
    return rec.run_id
