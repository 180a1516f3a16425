"""`partition` runs: cut points on the network, candidates and stages predicted vs measured.

The network's pieces with the kept plan's cut points, every candidate's predicted and measured
throughput, and each stage's time per batch predicted and measured.
"""

from __future__ import annotations

from typing import Any

import yaml

from infermux.report.data import RunData
from infermux.report.figures import bar, figure
from infermux.report.kinds import Headline, register_kind
from infermux.report.kinds.common import status_cell
from infermux.report.page import Cell, Section, fmt

__all__ = ["render_partition"]


def _candidates(run: RunData) -> list[dict[str, Any]]:
    out = []
    for row in run.rows("partition_candidates", order="rank"):
        rec = row.get("record") or {}
        try:
            plan = yaml.safe_load(row.get("plan_yaml") or "") or {}
        except yaml.YAMLError:
            plan = {}
        out.append({**rec, "chosen": bool(row["chosen"]), "status": row["status"],
                    "measured_items_per_s": row["measured_items_per_s"],
                    "predicted_items_per_s": row["predicted_items_per_s"], "plan_doc": plan})
    return out


def _headline(run: RunData) -> Headline | None:
    chosen = [c for c in _candidates(run) if c["chosen"] and c.get("measured_items_per_s")]
    if not chosen:
        return None
    return (f"kept pipeline ({chosen[0].get('plan')})", chosen[0]["measured_items_per_s"],
            "items/s")


def _stages(c: dict[str, Any]) -> list[dict[str, Any]]:
    models = (c.get("plan_doc") or {}).get("models") or [{}]
    return list(models[0].get("stages") or [])


def _measured_stage_ms(c: dict[str, Any]) -> list[float | None]:
    """Each stage's busy time per batch: busy share × window ÷ batches (None if unmeasured)."""
    m = c.get("measurement") or {}
    busy = m.get("stage_busy") or []
    stages = _stages(c)
    batch = (stages[0].get("batch") if stages else None) or 1
    batches = (m.get("items") or 0) / batch
    if not batches or not m.get("window_s"):
        return [None] * len(busy)
    return [b * m["window_s"] / batches * 1000 for b in busy]


def _cut_figure(run: RunData, candidates: list[dict[str, Any]]) -> dict[str, Any] | None:
    profiles = [p for p in run.rows("partition_profiles") if p["kind"] == "compute"]
    if not profiles:
        return None
    pieces: dict[int, str] = {}
    per_unit: dict[str, dict[int, float]] = {}
    for p in profiles:
        pieces[p["position"]] = p["name"]
        per_unit.setdefault(p["unit"], {})[p["position"]] = p["time_s"] * 1000
    order = sorted(pieces)
    traces = [bar(order, [times.get(i) for i in order], f"on {unit}",
                  hover=[pieces[i] for i in order]) for unit, times in sorted(per_unit.items())]
    kept = next((c for c in candidates if c["chosen"]), candidates[0] if candidates else None)
    shapes, notes = [], []
    if kept is not None:
        ends = [s.get("end") for s in _stages(kept)[:-1] if s.get("end")]
        for i in order:
            if pieces[i].rsplit("→", 1)[-1] in ends:
                shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": i + 0.5,
                               "x1": i + 0.5, "y0": 0, "y1": 1,
                               "line": {"color": "#cf222e", "width": 2, "dash": "dash"}})
                notes.append({"xref": "x", "yref": "paper", "x": i + 0.5, "y": 1,
                              "text": f"cut after {pieces[i].rsplit('→', 1)[-1]}",
                              "showarrow": False, "xanchor": "left", "yanchor": "top",
                              "font": {"color": "#cf222e", "size": 11}})
    batch = profiles[0]["batch"]
    fig = figure(traces, title="The network's pieces: compute time per batch on each unit, with "
                 + ("the kept plan's cut points" if kept and kept["chosen"] else
                    "the best predicted plan's cut points"),
                 x="piece (between consecutive cut points)", y=f"ms per batch of {batch}",
                 barmode="group", shapes=shapes, annotations=notes, height=400)
    if fig is not None:
        fig["layout"]["xaxis"]["tickvals"] = order
        fig["layout"]["xaxis"]["ticktext"] = [pieces[i].rsplit("→", 1)[-1][:18] for i in order]
        fig["layout"]["xaxis"]["tickangle"] = -40
    return fig


@register_kind("partition", headline=_headline)
def render_partition(run: RunData, section: Section) -> None:
    """Cut points, candidates and stage times."""
    candidates = _candidates(run)
    if not candidates:
        section.note("No candidate was stored for this run.", "warn")
        return
    if not any(c["chosen"] for c in candidates):
        section.note("No candidate was kept: none measured, or none agreed with the fp32 "
                     "reference (see the status column).", "bad")
    for c in candidates:
        if c["status"] not in ("ok",):
            section.note(f"candidate #{c.get('rank')} {c.get('plan')}: {str(c['status']).upper()}"
                         f" {c.get('error') or ''}", "bad" if c["status"] in ("oom", "error")
                         else "warn")
    cfg = run.config
    section.kv([("units", cfg.get("units")), ("batch", cfg.get("batch")),
                ("engines", ", ".join(cfg.get("engines") or [])), ("pieces", run.summary.get(
                    "pieces")), ("graph capture", run.summary.get("capture"))])
    section.figure(_cut_figure(run, candidates))
    section.heading("Candidates")
    rows: list[list[Cell]] = []
    for c in candidates:
        m = c.get("measurement") or {}
        plan: Cell = (str(c.get("plan")) + "  ← kept", "best") if c["chosen"] else str(c.get("plan"))
        err = c.get("error_pct")
        rows.append([str(c.get("rank")), plan, fmt(c.get("predicted_items_per_s")),
                     fmt(c.get("measured_items_per_s")),
                     f"{err:+.0f}%" if isinstance(err, (int, float)) else "–",
                     status_cell(str(c["status"])),
                     " ".join(f"{b:.0%}" for b in m.get("stage_busy") or []),
                     fmt(m.get("p50_ms"), 1), fmt(m.get("p99_ms"), 1)])
    section.table(["#", "plan", "predicted/s", "measured/s", "error", "status", "stage busy",
                   "chunk p50 ms", "chunk p99 ms"], rows,
                  numeric=("predicted/s", "measured/s", "error", "chunk p50 ms", "chunk p99 ms"))
    labels = [f"#{c.get('rank')}" for c in candidates]
    hover = [str(c.get("plan")) for c in candidates]
    section.figure(figure(
        [bar(labels, [c.get("predicted_items_per_s") for c in candidates], "predicted", hover=hover),
         bar(labels, [c.get("measured_items_per_s") for c in candidates], "measured", hover=hover)],
        title="Candidates: predicted (from the profiles) against measured throughput",
        x="candidate", y="items/s", barmode="group", x_category=True))
    labels, predicted, measured, hover = [], [], [], []
    for c in candidates:
        stages = _stages(c)
        times = c.get("stage_times_s") or [s.get("predicted_time_s") for s in stages]
        got = _measured_stage_ms(c)
        for i, t in enumerate(times):
            units = "+".join(stages[i].get("units") or []) if i < len(stages) else "?"
            labels.append(f"#{c.get('rank')} stage {i} @{units}")
            predicted.append(t * 1000 if isinstance(t, (int, float)) else None)
            measured.append(got[i] if i < len(got) else None)
            hover.append(f"{stages[i].get('start', 'input')}→{stages[i].get('end', 'output')}"
                         if i < len(stages) else "")
    section.figure(figure(
        [bar(labels, predicted, "predicted", hover=hover),
         bar(labels, measured, "measured (busy share × window ÷ batches)", hover=hover)],
        title="Stage time per batch: predicted against measured", x="stage", y="ms per batch",
        barmode="group", x_category=True))
