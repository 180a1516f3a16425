"""`monitor` runs (a recorded telemetry window): power, utilisation, clocks and temperature."""

from __future__ import annotations

from infermux.report.data import RunData
from infermux.report.kinds import Headline, register_kind
from infermux.report.kinds.common import telemetry_figures
from infermux.report.page import Section, fmt

__all__ = ["render_monitor"]


def _headline(run: RunData) -> Headline | None:
    energy = run.summary.get("energy_j")
    if energy is None:
        return None
    return ("energy over the window", float(energy), "J")


@register_kind("monitor", headline=_headline)
def render_monitor(run: RunData, section: Section) -> None:
    """The window's summary per device and its time series."""
    summary = run.summary
    section.kv([("duration s", summary.get("duration_s")),
                ("energy J", summary.get("energy_j")),
                ("energy source", summary.get("energy_source")),
                ("sampler cost", f"{fmt((summary.get('sampler_cost') or {}).get('cpu_share_pct'), 2)}"
                                 "% of a core")])
    for flag in summary.get("flags") or []:
        section.note(f"flag: {flag}", "warn")
    devices = summary.get("summary") or {}
    if devices:
        cols = sorted({k for d in devices.values() for k in d if k not in ("device", "source")})
        section.table(["device", "source", *cols],
                      ([name, str(d.get("source")), *(fmt(d.get(c), 2) for c in cols)]
                       for name, d in devices.items()), numeric=cols)
    rows = run.reader.telemetry(run_id=run.id)
    figs = telemetry_figures([("window", rows)], title="Telemetry")
    for fig in figs:
        section.figure(fig)
    if not figs:
        section.text("No telemetry readings were stored for this window.", "dim")
