"""Plotly figure specifications as plain dicts: one look for every report.

Figures are written as the JSON plotly.js reads (`{"data": [...], "layout": {...}}`), not through
plotly's Python objects: the data stays small and exact, and building a hundred figures costs
milliseconds. Numbers are rounded to 4 significant figures before they go into the page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["PALETTE", "Trace", "bar", "colour", "factor_heatmap", "figure", "hline", "line", "r4",
           "scatter", "vline"]

Trace = dict[str, Any]

#: Series colours (plotly's default sequence), so one series keeps its colour across figures.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")


def colour(i: int) -> str:
    """The i-th series colour."""
    return PALETTE[i % len(PALETTE)]


def r4(value: Any) -> Any:
    """`value` rounded to 4 significant figures (None, text and non-finite values pass as None/text)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        if value == 0:
            return 0.0
        return round(value, 3 - math.floor(math.log10(abs(value))))
    return value


def _rs(values: Sequence[Any]) -> list[Any]:
    return [r4(v) for v in values]


def line(x: Sequence[Any], y: Sequence[Any], name: str, *, dash: str | None = None,
         markers: bool = True, text: Sequence[str] | None = None, color: str | None = None,
         group: str | None = None, width: float = 2.0, fill: str | None = None,
         show_legend: bool = True) -> Trace:
    """A line (with markers) trace."""
    trace: Trace = {"type": "scatter", "mode": "lines+markers" if markers else "lines",
                    "x": _rs(x), "y": _rs(y), "name": name,
                    "line": {"width": width}, "showlegend": show_legend}
    if dash:
        trace["line"]["dash"] = dash
    if color:
        trace["line"]["color"] = color
        trace["marker"] = {"color": color}
    if text is not None:
        trace["text"] = list(text)
        trace["hovertemplate"] = "%{text}<br>%{x}, %{y}<extra>" + name + "</extra>"
    if group:
        trace["legendgroup"] = group
    if fill:
        trace["fill"] = fill
    return trace


def scatter(x: Sequence[Any], y: Sequence[Any], name: str, *, text: Sequence[str] | None = None,
            symbol: str | Sequence[str] = "circle", size: float | Sequence[float] = 9,
            color: Any = None, colorbar: str | None = None, labels: bool = False,
            hover: Sequence[str] | None = None) -> Trace:
    """A markers trace; `color` may be a list of numbers (with a colorbar title)."""
    marker: dict[str, Any] = {"symbol": symbol, "size": size,
                              "line": {"width": 1, "color": "#333"}}
    if color is not None:
        marker["color"] = _rs(color) if isinstance(color, list) else color
    if colorbar:
        marker["colorbar"] = {"title": {"text": colorbar}}
        marker["colorscale"] = "Viridis"
        marker["showscale"] = True
    trace: Trace = {"type": "scatter", "mode": "markers+text" if labels else "markers",
                    "x": _rs(x), "y": _rs(y), "name": name, "marker": marker}
    if text is not None:
        trace["text"] = list(text)
        trace["hovertemplate"] = "%{text}<br>%{x}, %{y}<extra></extra>"
        if labels:
            trace["textposition"] = "top center"
            trace["textfont"] = {"size": 10}
    if hover is not None:
        trace["hovertext"] = list(hover)
        trace["hovertemplate"] = "%{hovertext}<br>%{x}, %{y}<extra></extra>"
    return trace


def bar(x: Sequence[Any], y: Sequence[Any], name: str, *, text: Sequence[str] | None = None,
        color: str | None = None, horizontal: bool = False,
        hover: Sequence[str] | None = None) -> Trace:
    """A bar trace (vertical, or horizontal with x as values and y as categories)."""
    trace: Trace = {"type": "bar", "x": _rs(x), "y": _rs(y), "name": name}
    if horizontal:
        trace["orientation"] = "h"
    if text is not None:
        trace["text"] = list(text)
        trace["textposition"] = "auto"
    if hover is not None:
        trace["hovertext"] = list(hover)
        trace["hoverinfo"] = "text+name"
    if color:
        trace["marker"] = {"color": color}
    return trace


#: Red below 1 (contention), yellow at half, green at 1 (the parts add up) and above.
_FACTOR_SCALE = [[0.0, "#cf222e"], [0.4, "#f2cc60"], [0.83, "#2da44e"], [1.0, "#116329"]]


def factor_heatmap(x: Sequence[str], y: Sequence[str], z: Sequence[Sequence[float | None]], *,
                   colorbar: str, hover: str) -> Trace:
    """A heatmap of factors around 1 (1 = no contention), each cell labelled with its value."""
    values = [v for row in z for v in row if v is not None]
    return {"type": "heatmap", "x": list(x), "y": list(y),
            "z": [[r4(v) for v in row] for row in z], "zmin": 0.0,
            "zmax": max(1.2, max(values, default=1.2)), "colorscale": _FACTOR_SCALE,
            "texttemplate": "%{z:.2f}×", "colorbar": {"title": {"text": colorbar}},
            "hovertemplate": hover + "<extra></extra>"}


def figure(traces: list[Trace], *, title: str, x: str, y: str, x_log: bool = False,
           y_log: bool = False, height: int = 360, barmode: str | None = None,
           shapes: list[dict[str, Any]] | None = None,
           annotations: list[dict[str, Any]] | None = None, x_category: bool = False,
           y_range: list[float] | None = None, legend_below: bool = True,
           x_ticks: Sequence[Any] | None = None) -> dict[str, Any] | None:
    """A figure spec; None when no trace has a point (nothing to draw is said elsewhere)."""
    if not any(any(v is not None for v in (t.get("y") or t.get("z") or [])) for t in traces):
        return None
    layout: dict[str, Any] = {
        "title": {"text": title, "font": {"size": 15}, "x": 0.01, "xanchor": "left"},
        "height": height, "margin": {"l": 64, "r": 24, "t": 44, "b": 52},
        "xaxis": {"title": {"text": x}, "zeroline": False, "gridcolor": "#e8ebf0"},
        "yaxis": {"title": {"text": y}, "zeroline": False, "gridcolor": "#e8ebf0"},
        "hovermode": "closest", "plot_bgcolor": "#fff", "paper_bgcolor": "#fff",
        "font": {"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif",
                 "size": 12},
    }
    if legend_below:
        layout["legend"] = {"orientation": "h", "y": -0.22, "yanchor": "top", "x": 0}
        layout["margin"]["b"] = 64
    if x_log:
        layout["xaxis"]["type"] = "log"
    if y_log:
        layout["yaxis"]["type"] = "log"
    if x_category:
        layout["xaxis"]["type"] = "category"
    if x_ticks:
        layout["xaxis"]["tickvals"] = list(x_ticks)
    if y_range is not None:
        layout["yaxis"]["range"] = y_range
    if barmode:
        layout["barmode"] = barmode
    if any(t.get("type") == "heatmap" for t in traces):
        longest = max((len(str(v)) for t in traces for v in t.get("y") or []), default=0)
        layout["margin"]["l"] = min(400, max(64, 8 * longest + 40))
    if shapes:
        layout["shapes"] = shapes
    if annotations:
        layout["annotations"] = annotations
    return {"data": traces, "layout": layout}


def hline(y: float, text: str, color: str = "#cf222e") -> tuple[dict[str, Any], dict[str, Any]]:
    """A dashed horizontal line across the plot with a label (shape, annotation)."""
    shape = {"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": r4(y), "y1": r4(y),
             "line": {"dash": "dash", "color": color, "width": 1.5}}
    note = {"xref": "paper", "x": 0, "y": r4(y), "xanchor": "left", "yanchor": "bottom",
            "text": text, "showarrow": False, "font": {"color": color, "size": 11}}
    return shape, note


def vline(x: float, text: str, color: str = "#5b6475") -> tuple[dict[str, Any], dict[str, Any]]:
    """A dotted vertical line with a label at the top (shape, annotation)."""
    shape = {"type": "line", "yref": "paper", "y0": 0, "y1": 1, "x0": r4(x), "x1": r4(x),
             "line": {"dash": "dot", "color": color, "width": 1.5}}
    note = {"yref": "paper", "y": 1, "x": r4(x), "xanchor": "right", "yanchor": "top",
            "text": text, "showarrow": False, "font": {"color": color, "size": 11}}
    return shape, note
