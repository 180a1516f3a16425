"""Any kind of run this report has no renderer for: its summary, results, telemetry, tables."""

from __future__ import annotations

from typing import Any

from infermux.report.data import RunData
from infermux.report.kinds import register_kind
from infermux.report.kinds.common import (
    failed_points_note,
    generic_table,
    point_label,
    status_cell,
    telemetry_figures,
)
from infermux.report.page import Section, fmt

__all__ = ["render_generic", "results_table", "summary_pairs"]


def summary_pairs(summary: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """A run's summary flattened to (label, value) pairs of scalars (one level of nesting)."""
    pairs: list[tuple[str, Any]] = []
    for key, value in summary.items():
        if isinstance(value, dict) and not prefix:
            pairs.extend(summary_pairs(value, f"{key}."))
        elif isinstance(value, (str, int, float, bool)) or value is None:
            pairs.append((prefix + key, value))
        elif isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
            pairs.append((prefix + key, ", ".join(map(str, value))))
    return pairs


def results_table(run: RunData, section: Section, title: str = "Points") -> None:
    """The run's rows of `results` as a table (what every measuring kind stores there)."""
    if not run.results:
        return
    section.heading(title)
    failed_points_note(run, section, run.results)
    cols = ["point", "model", "status", "items/s", "p50 ms", "p99 ms", "items", "window s",
            "note"]
    section.table(cols, ([point_label(r), str(r.get("model")),
                          status_cell(str(r.get("status")), bool(r.get("valid"))),
                          fmt(r.get("items_per_s")), fmt(r.get("p50_ms"), 2),
                          fmt(r.get("p99_ms"), 2), fmt(r.get("items")), fmt(r.get("window_s"), 2),
                          (r.get("error") or r.get("validity_note") or "")[:200]]
                         for r in run.results),
                  numeric=("items/s", "p50 ms", "p99 ms", "items", "window s"))


def run_telemetry(run: RunData, section: Section) -> None:
    """The run's own telemetry window and each result's, if any were stored."""
    windows = []
    own = run.reader.telemetry(run_id=run.id)
    if own:
        windows.append(("run", own))
    for r in run.results:
        rows = run.reader.telemetry(result_id=r["id"])
        if rows:
            windows.append((point_label(r), rows))
    figs = telemetry_figures(windows, title="Telemetry")
    if figs:
        section.heading("Telemetry")
        for fig in figs:
            section.figure(fig)


@register_kind("generic")
def render_generic(run: RunData, section: Section) -> None:
    """Summary, results, telemetry and every table of the run, for any kind."""
    section.note(f"Runs of kind {run.kind!r} have no dedicated view in this version of the "
                 "report: their stored records are shown as tables.", "info")
    pairs = summary_pairs(run.summary)
    if pairs:
        section.heading("Summary")
        section.kv(pairs)
    results_table(run, section)
    run_telemetry(run, section)
    for table in run.own_tables():
        generic_table(run, section, table)
