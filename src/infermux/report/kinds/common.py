"""Parts every kind of run shares: the status banner, telemetry figures, generic tables."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from infermux.report.data import RAW_TABLES, RunData
from infermux.report.figures import figure, line
from infermux.report.page import Cell, Section, fmt

__all__ = [
    "TELEMETRY_METRICS", "failed_points_note", "generic_table", "point_label", "status_cell",
    "status_note", "telemetry_figures",
]

#: Telemetry columns drawn as time series: (column, axis title).
TELEMETRY_METRICS = (
    ("power_w", "power (W)"),
    ("util_pct", "utilisation (%)"),
    ("mem_util_pct", "memory utilisation (%)"),
    ("clock_mhz", "clock (MHz)"),
    ("temp_c", "temperature (°C)"),
)

_STATUS_TEXT = {
    "interrupted": ("warn", "This run was interrupted (Ctrl-C or a stop): what it measured "
                            "before it stopped is shown, and nothing after."),
    "failed": ("bad", "This run failed: what it measured before the failure is shown."),
    "running": ("warn", "This run never finished: it was still running when this report was "
                        "made, or its process died. What it stored is shown."),
}


def status_note(run: RunData, section: Section) -> None:
    """A banner when the run did not complete, with the error it stored."""
    if run.status == "complete":
        return
    level, text = _STATUS_TEXT.get(run.status, ("warn", f"Run status: {run.status}."))
    error = run.summary.get("error")
    if error:
        text += f" Error: {error}"
    section.note(text, level)


def status_cell(status: str, valid: bool | None = None) -> Cell:
    """A status in its colour: ok (and valid) green, invalid amber, failures red."""
    if status in ("ok", "complete"):
        if valid is False:
            return ("invalid", "warn")
        return (status, "ok")
    if status in ("oom", "error", "failed", "disagrees"):
        return (status.upper(), "bad")
    return (status, "warn")


def point_label(r: dict[str, Any]) -> str:
    """`cpu torch b8 ×2` for a results row."""
    text = f"{r.get('unit')} {r.get('engine')} b{r.get('batch')}"
    if (r.get("instances") or 1) > 1:
        text += f" ×{r['instances']}"
    return text


def failed_points_note(run: RunData, section: Section, rows: Sequence[dict[str, Any]]) -> None:
    """Banners naming the points that failed, ran out of memory, were interrupted or are invalid."""
    by_status: dict[str, list[str]] = {}
    for r in rows:
        if r.get("status") != "ok":
            by_status.setdefault(str(r.get("status")), []).append(
                f"{point_label(r)} ({(r.get('error') or r.get('validity_note') or '').strip()})")
    for status, points in by_status.items():
        what = {"oom": "ran out of memory", "error": "failed", "interrupted": "was interrupted"
                }.get(status, f"ended with status {status}")
        level = "warn" if status == "interrupted" else "bad"
        section.note(f"{len(points)} point(s) {what}: " + "; ".join(points)[:900], level)
    invalid = [r for r in rows if r.get("status") == "ok" and not r.get("valid")]
    if invalid:
        section.note(f"{len(invalid)} point(s) measured but invalid: " + "; ".join(
            f"{point_label(r)} ({r.get('validity_note')})" for r in invalid)[:900], "warn")


def telemetry_figures(windows: Sequence[tuple[str, list[dict[str, Any]]]], *, title: str
                      ) -> list[dict[str, Any]]:
    """One time-series figure per metric that has readings.

    `windows` are (label, telemetry rows) in order; they are laid end to end on one time
    axis (each window from its own 0 s, a gap between them), each labelled when hovered.
    """
    figs: list[dict[str, Any]] = []
    spans: list[tuple[str, float, float]] = []
    offset = 0.0
    placed: list[tuple[str, float, list[dict[str, Any]]]] = []
    for label, rows in windows:
        if not rows:
            continue
        times = [r["t_ns"] / 1e9 for r in rows]
        t0, t1 = min(0.0, min(times)), max(times)
        placed.append((label, offset - t0, rows))
        spans.append((label, offset, offset + (t1 - t0)))
        offset += (t1 - t0) + max(0.2, 0.05 * (t1 - t0))
    if not placed:
        return figs
    for column, axis in TELEMETRY_METRICS:
        series: dict[str, tuple[list[Any], list[Any], list[str]]] = {}
        for label, shift, rows in placed:
            for r in rows:
                value = r.get(column)
                if value is None:
                    continue
                device = f"{r.get('device')} ({r.get('source')})"
                xs, ys, texts = series.setdefault(device, ([], [], []))
                if xs and texts and texts[-1] != label:
                    xs.append(None)
                    ys.append(None)
                    texts.append("")
                xs.append(shift + r["t_ns"] / 1e9)
                ys.append(value)
                texts.append(label)
        if not series:
            continue
        traces = [line(xs, ys, device, markers=False, text=texts, width=1.5)
                  for device, (xs, ys, texts) in series.items()]
        shapes = [{"type": "rect", "xref": "x", "yref": "paper", "x0": a, "x1": b, "y0": 0,
                   "y1": 1, "fillcolor": "#eef1f6" if i % 2 == 0 else "#f8f9fb",
                   "line": {"width": 0}, "layer": "below"}
                  for i, (_label, a, b) in enumerate(spans)] if len(spans) > 1 else None
        fig = figure(traces, title=f"{title}: {axis}", x="time (s)" + (
            ", measured windows end to end" if len(spans) > 1 else ""), y=axis, height=300,
            shapes=shapes)
        if fig is not None:
            figs.append(fig)
    return figs


def _cell_text(value: Any) -> str:
    if isinstance(value, (dict, list)):
        text = json.dumps(value, default=str, separators=(", ", ": "))
    elif isinstance(value, float):
        text = fmt(value, 3)
    else:
        text = fmt(value)
    return text if len(text) <= 160 else text[:157] + "…"


def generic_table(run: RunData, section: Section, table: str, *, limit: int = 200) -> None:
    """Every row of `table` for this run (raw per-batch tables only counted)."""
    if table in RAW_TABLES:
        section.text(f"{table}: {run.reader.count(table, run.id):,} raw rows (summarised "
                     "above; `infermux results export` has them)", "dim")
        return
    rows = run.reader.rows(table, run.id, limit=limit + 1)
    if not rows:
        return
    columns = [c for c in rows[0] if c != "run_id"]
    section.heading(f"Table {table}", 4)
    total = run.reader.count(table, run.id)
    section.table(columns, ([_cell_text(r.get(c)) for c in columns] for r in rows[:limit]),
                  caption=f"{total:,} rows" + (f", first {limit} shown" if total > limit else ""),
                  numeric=[c for c in columns if isinstance(rows[0].get(c), (int, float))
                           and not isinstance(rows[0].get(c), bool)])
