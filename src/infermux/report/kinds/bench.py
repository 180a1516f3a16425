"""`bench` runs: curves against batch size per unit × engine, and every point's details.

Throughput and latency percentiles against batch, energy per item, agreement with the fp32
reference, where a batch's time went, and the telemetry of every point.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from infermux.report.data import RunData
from infermux.report.figures import bar, colour, figure, line, scatter
from infermux.report.kinds import Headline, register_kind
from infermux.report.kinds.common import (
    failed_points_note,
    point_label,
    status_cell,
    telemetry_figures,
)
from infermux.report.page import Cell, Section, fmt

__all__ = ["bench_curves", "render_bench", "series_key"]

#: Most points whose latency distributions are drawn (one line each).
_MAX_CDF_POINTS = 40


def series_key(r: dict[str, Any]) -> str:
    """One curve per unit × engine × instances."""
    key = f"{r.get('unit')} {r.get('engine')}"
    if (r.get("instances") or 1) > 1:
        key += f" ×{r['instances']}"
    return key


def _series(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(series_key(r), []).append(r)
    for points in out.values():
        points.sort(key=lambda r: r.get("batch") or 0)
    return out


def _hover(r: dict[str, Any]) -> str:
    text = point_label(r)
    if r.get("status") != "ok":
        return text + f" — {str(r.get('status')).upper()}: {(r.get('error') or '')[:120]}"
    if not r.get("valid"):
        return text + f" — invalid: {(r.get('validity_note') or '')[:120]}"
    return text


def bench_curves(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], *, what: str
                 ) -> list[dict[str, Any]]:
    """Throughput and latency against batch; `runs` are (prefix, rows) — one prefix per run."""
    thr, lat, energy = [], [], []
    failed_x, failed_y, failed_text = [], [], []
    batches: set[int] = set()
    n = 0
    for prefix, rows in runs:
        for key, points in _series(rows).items():
            name = f"{prefix}{key}"
            batches.update(r["batch"] for r in points if r.get("batch"))
            ok = [r for r in points if r.get("status") == "ok" and r.get("items_per_s")]
            for r in points:
                if r.get("status") != "ok":
                    failed_x.append(r.get("batch"))
                    failed_y.append(0.0)
                    failed_text.append(f"{prefix}{_hover(r)}")
            if not ok:
                continue
            xs = [r["batch"] for r in ok]
            texts = [_hover(r) for r in ok]
            c = colour(n)
            n += 1
            thr.append(line(xs, [r["items_per_s"] for r in ok], name, text=texts,
                            group=name, color=c))
            lat.append(line(xs, [r.get("p50_ms") for r in ok], f"{name} p50", text=texts,
                            group=name, color=c))
            lat.append(line(xs, [r.get("p99_ms") for r in ok], f"{name} p99", text=texts,
                            group=name, dash="dash", color=c))
            if any(r.get("energy_per_item_j") for r in ok):
                energy.append(line(xs, [r.get("energy_per_item_j") for r in ok], name,
                                   text=texts, color=c))
    invalid_x, invalid_y, invalid_text = [], [], []
    for prefix, rows in runs:
        for r in rows:
            if r.get("status") == "ok" and not r.get("valid") and r.get("items_per_s"):
                invalid_x.append(r["batch"])
                invalid_y.append(r["items_per_s"])
                invalid_text.append(f"{prefix}{_hover(r)}")
    if invalid_x:
        thr.append(scatter(invalid_x, invalid_y, "invalid point", text=invalid_text,
                           symbol="circle-open", size=14, color="#9a6700"))
    if failed_x:
        thr.append(scatter(failed_x, failed_y, "failed / OOM / interrupted point",
                           text=failed_text, symbol="x", size=12, color="#cf222e"))
    ticks = sorted(batches)
    figs = [figure(thr, title=f"{what}: throughput against batch size", x="batch size",
                   y="items/s", x_log=True, x_ticks=ticks)]
    values = [v for t in lat for v in t["y"] if v]
    spread = (max(values) / min(values)) if values and min(values) > 0 else 1.0
    figs.append(figure(lat, title=f"{what}: batch latency p50 (solid) and p99 (dashed)",
                       x="batch size", y="ms per batch", x_log=True, y_log=spread > 50,
                       x_ticks=ticks))
    if energy:
        figs.append(figure(energy, title=f"{what}: energy per item", x="batch size",
                           y="J per item", x_log=True, x_ticks=ticks))
    return [f for f in figs if f is not None]


def _agree(r: dict[str, Any]) -> Cell:
    a = r.get("agreement")
    if not a:
        return "–"
    status = str(a.get("status"))
    err = a.get("rel_err")
    text = f"{status} {err:.0e}" if isinstance(err, (int, float)) else status
    if a.get("precision"):
        text += f" {a['precision']}"
    return (text, "bad" if status == "fail" else ("ok" if status == "pass" else "warn"))


def _phases(r: dict[str, Any]) -> str:
    if r.get("compute_ms") is None:
        return "–"
    return "/".join(fmt(r.get(k), 2) if r.get(k) else "–" for k in ("h2d_ms", "compute_ms",
                                                                     "d2h_ms"))


def _latency_cdfs(run: RunData, rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    points = [r for r in rows if r.get("samples")][:_MAX_CDF_POINTS]
    traces = []
    for r in points:
        q = run.reader.latency_quantiles_ms(r["id"])
        if q:
            traces.append(line(q, [i / (len(q) - 1) for i in range(len(q))], point_label(r),
                               markers=False, width=1.5))
    values = [v for t in traces for v in t["x"] if v]
    spread = (max(values) / min(values)) if values and min(values) > 0 else 1.0
    return figure(traces, title="Batch latency distribution (every measured batch)",
                  x="ms per batch", y="share of batches at or below", x_log=spread > 20,
                  y_range=[0, 1.02])


def _phase_bars(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [r for r in rows if r.get("compute_ms") is not None]
    if not any((r.get("h2d_ms") or 0) > 0 or (r.get("d2h_ms") or 0) > 0 for r in ok):
        return None  # CPU points: all compute, nothing to split
    labels = [point_label(r) for r in ok]
    traces = [bar(labels, [r.get(f"{p}_ms") or 0.0 for r in ok], name)
              for p, name in (("h2d", "host→device copy"), ("compute", "compute"),
                              ("d2h", "device→host copy"))]
    return figure(traces, title="Where a batch's time went (means, from device events)",
                  x="point", y="ms per batch", barmode="stack", x_category=True)


def _headline(run: RunData) -> Headline | None:
    valid = [r for r in run.results if r.get("valid") and r.get("items_per_s")]
    if not valid:
        return None
    best = max(valid, key=lambda r: r["items_per_s"])
    return (f"best valid point ({point_label(best)})", best["items_per_s"], "items/s")


@register_kind("bench", headline=_headline)
def render_bench(run: RunData, section: Section) -> None:
    """Curves against batch size, the table of points, distributions and telemetry."""
    rows = run.results
    if not rows:
        section.note("No point was stored for this run.", "warn")
        return
    failed_points_note(run, section, rows)
    weights = {r.get("weights_note") for r in rows if r.get("weights_note")}
    for note in weights:
        section.text(f"model: {note}", "dim")
    for fig in bench_curves([("", rows)], what=run.model or "bench"):
        section.figure(fig)
    section.heading("Points")
    cols = ["unit", "engine", "batch", "inst", "status", "items/s", "p50 ms", "p90 ms", "p99 ms",
            "max ms", "h2d/comp/d2h ms", "J/item", "mean W", "agree", "note"]
    section.table(cols, ([str(r.get("unit")), str(r.get("engine")), fmt(r.get("batch")),
                          fmt(r.get("instances")),
                          status_cell(str(r.get("status")), bool(r.get("valid"))),
                          fmt(r.get("items_per_s")), fmt(r.get("p50_ms"), 2),
                          fmt(r.get("p90_ms"), 2), fmt(r.get("p99_ms"), 2), fmt(r.get("max_ms"), 2),
                          _phases(r), fmt(r.get("energy_per_item_j"), 4),
                          fmt(r.get("mean_power_w")), _agree(r),
                          (r.get("error") or r.get("validity_note") or "")[:200]]
                         for r in rows),
                  numeric=("batch", "inst", "items/s", "p50 ms", "p90 ms", "p99 ms", "max ms",
                           "h2d/comp/d2h ms", "J/item", "mean W"))
    sources = {r.get("energy_source") for r in rows if r.get("energy_source")}
    if sources:
        section.text("energy: " + "; ".join(sorted(str(s) for s in sources)), "dim")
    section.figure(_latency_cdfs(run, rows))
    section.figure(_phase_bars(rows))
    windows = [(point_label(r), run.reader.telemetry(result_id=r["id"])) for r in rows]
    figs = telemetry_figures(windows, title="Telemetry during the measured windows")
    if figs:
        section.heading("Telemetry")
        flags = sorted({f for r in rows for f in r.get("telemetry_flags") or []})
        if flags:
            section.note("telemetry flags: " + "; ".join(flags), "warn")
        for fig in figs:
            section.figure(fig)
    else:
        section.text("No telemetry was stored for this run (--telemetry off).", "dim")
