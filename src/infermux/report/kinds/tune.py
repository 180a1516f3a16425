"""`tune` runs: the chosen plan and why, every trial, the Pareto front, contention.

The Pareto front is of throughput × batch p99 × energy per item; the contention matrix sets
each measured combination against its units' solo figures.

Everything is rebuilt from the `tune_trials` rows of the run: a combination's figure and
each of its units' figures inside it (`per_unit`) against the same config measured alone
through the runtime, as `infermux tune` itself compares them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from infermux.report.data import RunData
from infermux.report.figures import bar, factor_heatmap, figure, line, scatter
from infermux.report.kinds import Headline, register_kind
from infermux.report.kinds.common import status_cell
from infermux.report.page import Cell, Section, fmt

__all__ = ["contention_rows", "pareto", "render_tune"]


def _trials(run: RunData) -> list[dict[str, Any]]:
    out = []
    for row in run.rows("tune_trials", order="id"):
        data = row.get("record") or {}
        out.append({**data, "id": row["id"], "key": row["key"], "label": row["label"],
                    "method": row["method"], "status": row["status"],
                    "items_per_s": row["items_per_s"], "p99_ms": row["p99_ms"],
                    "energy_per_item_j": row["energy_per_item_j"], "power_w": row["power_w"],
                    "memory_bytes": row["memory_bytes"], "cost_s": row["cost_s"],
                    "reused": bool(row["reused"])})
    return out


def pareto(trials: Sequence[dict[str, Any]], *, with_energy: bool) -> list[dict[str, Any]]:
    """Trials no other beats on every one of items/s ↑, batch p99 ↓ (and J/item ↓)."""

    def vec(t: dict[str, Any]) -> tuple[float, ...]:
        v = [-(t.get("items_per_s") or 0.0),
             t["p99_ms"] if t.get("p99_ms") is not None else math.inf]
        if with_energy:
            e = t.get("energy_per_item_j")
            v.append(e if e is not None else math.inf)
        return tuple(v)

    pool: dict[str, dict[str, Any]] = {}
    for t in trials:
        if t.get("status") == "ok" and t.get("items_per_s"):
            pool.setdefault(t["key"].partition("|")[2], t)
    front = []
    for t in pool.values():
        a = vec(t)
        if not any(all(x <= y for x, y in zip(vec(o), a, strict=True)) and vec(o) != a
                   for o in pool.values()):
            front.append(t)
    return sorted(front, key=lambda t: -(t.get("items_per_s") or 0.0))


def contention_rows(trials: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measured combination against its units' solo figures.

    Its figure, the sum of its units' solo figures, and each unit's figure inside it ÷ alone
    (the contention factor).
    """
    by_key = {t["key"]: t for t in trials}
    out = []
    for t in trials:
        configs = t.get("configs") or []
        if len(configs) < 2:
            continue
        method, _, rest = t["key"].partition("|")
        parts = rest.split("|")
        per_unit = t.get("per_unit") or {}
        units = []
        summed = 0.0
        complete = True
        for part, cfg in zip(parts, configs, strict=False):
            alone = by_key.get(f"runtime|{part}") or by_key.get(f"engine|{part}")
            alone_v = alone.get("items_per_s") if alone and alone.get("status") == "ok" else None
            if alone_v is None:
                complete = False
            summed += alone_v or 0.0
            inside = per_unit.get(cfg["unit"])
            units.append({"unit": cfg["unit"], "alone": alone_v, "inside": inside,
                          "alone_method": alone.get("method") if alone else None,
                          "factor": inside / alone_v if inside is not None and alone_v else None})
        out.append({"plan": t.get("label"), "status": t.get("status"), "error": t.get("error"),
                    "measured": t.get("items_per_s"), "summed": summed if complete else None,
                    "factor": (t["items_per_s"] / summed) if complete and summed
                    and t.get("items_per_s") else None, "units": units, "method": method})
    return out


def _chosen(run: RunData, trials: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    label = run.summary.get("best")
    if not label:
        return None
    same = [t for t in trials if t.get("label") == label and t.get("status") == "ok"]
    runtime = [t for t in same if t.get("method") == "runtime"]
    found = runtime or same
    return found[-1] if found else None


def _headline(run: RunData) -> Headline | None:
    value = run.summary.get("best_items_per_s")
    if not value:
        return None
    return (f"chosen plan ({run.summary.get('best')})", float(value), "items/s")


def _mib(value: Any) -> str:
    return fmt(value / 2**20, 0) if isinstance(value, (int, float)) else "–"


def _why(run: RunData, section: Section, trials: Sequence[dict[str, Any]],
         chosen: dict[str, Any] | None) -> None:
    cfg = run.config
    constraints = {k: v for k, v in (cfg.get("constraints") or {}).items() if v is not None}
    section.heading("The chosen plan and why")
    if chosen is None:
        section.note("No plan was chosen: no candidate was measured valid within the "
                     "constraints" + (f" ({constraints})" if constraints else "") + ".", "bad")
        return
    ok = [t for t in trials if t.get("status") == "ok" and t.get("items_per_s")]
    rank = sorted(ok, key=lambda t: -(t["items_per_s"] or 0))
    section.kv([
        ("chosen plan", chosen.get("label")),
        ("items/s", chosen.get("items_per_s")),
        ("measured", f"{chosen.get('method')} (" + ("through the runtime: dispatcher, workers, "
                                                      "batching" if chosen.get("method") == "runtime"
                                                      else "in-process, like bench") + ")"),
        ("batch p99 ms", chosen.get("p99_ms")),
        ("J/item", chosen.get("energy_per_item_j")),
        ("objective", cfg.get("objective")),
        ("scenario", cfg.get("scenario")),
        ("constraints", ", ".join(f"{k} {v}" for k, v in constraints.items()) or "none"),
        ("plan file", run.summary.get("plan_path")),
        ("candidates measured", run.summary.get("measured")),
        ("budget s", cfg.get("budget_s")),
    ])
    objective = cfg.get("objective") or "throughput"
    why = (f"The tuner keeps the candidate with the best {objective} that holds the constraints; "
           "a figure measured in-process is measured again through the runtime before it is "
           "compared with a runtime figure, so the plan's figure is what `infermux run` gets.")
    if rank and rank[0] is not chosen and rank[0].get("method") != chosen.get("method"):
        why += (f" The highest single figure, {rank[0]['label']} at {fmt(rank[0]['items_per_s'])} "
                f"items/s, was measured {rank[0]['method']}.")
    section.text(why)


@register_kind("tune", headline=_headline)
def render_tune(run: RunData, section: Section) -> None:
    """The choice, the trials, the Pareto front and the contention matrix."""
    trials = _trials(run)
    if not trials:
        section.note("No trial was stored for this run.", "warn")
        return
    chosen = _chosen(run, trials)
    _why(run, section, trials, chosen)
    failed = [t for t in trials if t.get("status") != "ok"]
    if failed:
        section.note(f"{len(failed)} trial(s) did not measure: " + "; ".join(
            f"{t['label']} {str(t['status']).upper()} ({(t.get('error') or '')[:100]})"
            for t in failed)[:900], "bad" if any(t["status"] in ("oom", "error") for t in failed)
            else "warn")
    with_energy = any(t.get("energy_per_item_j") for t in trials)
    front = pareto(trials, with_energy=with_energy)
    section.figure(_pareto_figure(trials, front, chosen, with_energy))
    section.figure(_progress_figure(trials, chosen))
    section.heading("Pareto front (throughput ↑, batch p99 ↓" + (", energy per item ↓)"
                                                                  if with_energy else ")"))
    section.table(["plan", "items/s", "batch p99 ms", "J/item", "measured"],
                  ([t["label"], fmt(t.get("items_per_s")), fmt(t.get("p99_ms"), 2),
                    fmt(t.get("energy_per_item_j"), 4), str(t["method"])] for t in front),
                  numeric=("items/s", "batch p99 ms", "J/item"))
    _contention(section, trials)
    section.heading("Every trial")
    section.table(["#", "plan", "measured", "status", "items/s", "batch p99 ms", "J/item", "W",
                   "MiB", "cost s", "build s", "reused", "error"],
                  (_trial_row(i, t, t is chosen) for i, t in enumerate(trials, start=1)),
                  numeric=("#", "items/s", "batch p99 ms", "J/item", "W", "MiB", "cost s",
                           "build s"))


def _trial_row(i: int, t: dict[str, Any], chosen: bool) -> list[Cell]:
    label: Cell = (t["label"] + "  ← chosen", "best") if chosen else t["label"]
    return [str(i), label, str(t["method"]), status_cell(str(t["status"])),
            fmt(t.get("items_per_s")), fmt(t.get("p99_ms"), 2), fmt(t.get("energy_per_item_j"), 4),
            fmt(t.get("power_w")), _mib(t.get("memory_bytes")), fmt(t.get("cost_s"), 1),
            fmt(t.get("build_s"), 1), "yes" if t.get("reused") else "",
            (t.get("error") or "")[:160]]


def _pareto_figure(trials: Sequence[dict[str, Any]], front: Sequence[dict[str, Any]],
                   chosen: dict[str, Any] | None, with_energy: bool) -> dict[str, Any] | None:
    ok = [t for t in trials if t.get("status") == "ok" and t.get("items_per_s")
          and t.get("p99_ms") is not None]
    if not ok:
        return None
    traces = []
    for method, symbol in (("engine", "circle"), ("runtime", "diamond")):
        pts = [t for t in ok if t["method"] == method]
        if not pts:
            continue
        energy = [t.get("energy_per_item_j") for t in pts]
        traces.append(scatter(
            [t["items_per_s"] for t in pts], [t["p99_ms"] for t in pts],
            f"trial measured {'in-process' if method == 'engine' else 'through the runtime'}",
            text=[t["label"] for t in pts], symbol=symbol, size=10,
            color=energy if with_energy and all(e is not None for e in energy) else None,
            colorbar="J/item" if with_energy and method == "engine"
            and all(e is not None for e in energy) else None))
    line_pts = sorted((t for t in front if t.get("p99_ms") is not None),
                      key=lambda t: t["items_per_s"])
    if line_pts:
        traces.append(line([t["items_per_s"] for t in line_pts], [t["p99_ms"] for t in line_pts],
                           "Pareto front", text=[t["label"] for t in line_pts], color="#1a7f37",
                           dash="dot"))
    if chosen is not None and chosen.get("p99_ms") is not None:
        traces.append(scatter([chosen["items_per_s"]], [chosen["p99_ms"]], "chosen plan",
                              text=[chosen["label"]], symbol="star", size=18, color="#cf222e"))
    values = [t["p99_ms"] for t in ok if t["p99_ms"]]
    spread = max(values) / min(values) if values and min(values) > 0 else 1.0
    return figure(traces, title="Every trial: throughput against batch p99"
                  + (" (colour: energy per item)" if with_energy else ""),
                  x="items/s", y="batch p99 (ms)", y_log=spread > 30, height=420)


def _progress_figure(trials: Sequence[dict[str, Any]], chosen: dict[str, Any] | None
                     ) -> dict[str, Any] | None:
    xs = list(range(1, len(trials) + 1))
    ys = [t.get("items_per_s") if t.get("status") == "ok" else None for t in trials]
    best, running = [], 0.0
    for y in ys:
        running = max(running, y or 0.0)
        best.append(running or None)
    traces = [scatter(xs, ys, "trial", text=[f"{t['label']} ({t['method']})" for t in trials],
                      size=8, color="#0a58ca"),
              line(xs, best, "best so far", markers=False, color="#8c959f", width=1.5)]
    bad = [(i, t) for i, t in zip(xs, trials, strict=True) if t.get("status") != "ok"]
    if bad:
        traces.append(scatter([i for i, _ in bad], [0.0] * len(bad), "not measured (failed, "
                              "OOM or invalid)", text=[f"{t['label']}: {t['status']}"
                                                       for _, t in bad],
                              symbol="x", size=11, color="#cf222e"))
    return figure(traces, title="The search, trial by trial", x="trial", y="items/s",
                  height=300, x_ticks=xs if len(xs) <= 30 else None)


def _contention(section: Section, trials: Sequence[dict[str, Any]]) -> None:
    rows = contention_rows(trials)
    if not rows:
        section.text("No combination of units was measured (one unit, or the units were "
                     "weighed as alternatives): no contention to show.", "dim")
        return
    section.heading("Contention: combinations measured against the sum of their solo figures")
    table_rows: list[list[Cell]] = []
    for c in rows:
        if c["status"] != "ok":
            table_rows.append([c["plan"], status_cell(str(c["status"])), "–", fmt(c["summed"]),
                               "–", (c.get("error") or "")[:160]])
            continue
        inside = "; ".join(f"{u['unit']} {fmt(u['inside'])} vs {fmt(u['alone'])} alone "
                           f"({fmt(u['factor'], 2)}×)" for u in c["units"])
        table_rows.append([c["plan"], status_cell("ok"), fmt(c["measured"]), fmt(c["summed"]),
                           fmt(c["factor"], 2) + ("×" if c["factor"] is not None else ""), inside])
    section.table(["combination", "status", "measured items/s", "sum of solo items/s",
                   "measured ÷ sum", "each unit inside ÷ alone"], table_rows,
                  numeric=("measured items/s", "sum of solo items/s", "measured ÷ sum"))
    ok = [c for c in rows if c["status"] == "ok"]
    if ok:
        labels = [c["plan"] for c in ok]
        section.figure(figure(
            [bar(labels, [c["measured"] for c in ok], "measured together"),
             bar(labels, [c["summed"] for c in ok], "sum of the solo figures")],
            title="Combinations: measured together against what the solo figures add up to",
            x="combination", y="items/s", barmode="group", x_category=True))
        units = sorted({u["unit"] for c in ok for u in c["units"]})
        z = [[next((u["factor"] for u in c["units"] if u["unit"] == unit), None) for unit in units]
             for c in ok]
        heat = factor_heatmap(units, labels, z, colorbar="inside ÷ alone",
                              hover="%{y}<br>%{x}: %{z:.2f}× its solo figure")
        section.figure(figure([heat], title="Contention matrix: each unit's figure inside a "
                              "combination ÷ alone (1 = no contention)", x="unit",
                              y="combination", height=max(260, 60 + 40 * len(ok)),
                              legend_below=False))
