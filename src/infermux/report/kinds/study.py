"""`study` runs: the paper-shaped headline table and this machine's figures.

The published figures stand beside them in a box of their own, labelled with the paper's
hardware, and are never mixed into this machine's tables or plots.
"""

from __future__ import annotations

import html
from typing import Any

from infermux.report.data import RunData
from infermux.report.figures import bar, colour, factor_heatmap, figure, line
from infermux.report.kinds import Headline, register_kind
from infermux.report.kinds.common import status_cell
from infermux.report.page import Cell, Section, fmt

__all__ = ["render_study"]


def _points(run: RunData) -> list[dict[str, Any]]:
    return run.rows("study_points", order="point")


def _name(run: RunData) -> str:
    return str(run.config.get("name") or "")


def _headline(run: RunData) -> Headline | None:
    from infermux.study import headline_for

    points = _points(run)
    if not points:
        return None
    head = headline_for(_name(run), points)
    best = head.get("best_combination") or head.get("best_single")
    if best and best.get("items_per_s"):
        return (f"best: {best['combination']} b{best['batch']}", best["items_per_s"], "items/s")
    if head.get("best"):
        return (f"best: {head['best']['variant']}", head["best"]["items_per_s"], "items/s")
    gains = [r["pipeline_over_single"] for r in head.get("rows") or []
             if r.get("pipeline_over_single")]
    if gains:
        return ("pipeline ÷ best single unit, best network", max(gains), "×")
    return None


def _published(section: Section, name: str) -> None:
    from infermux.study.published import PUBLISHED

    pub = PUBLISHED.get(name)
    if pub is None:
        return
    items = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>"
                    for k, v in pub["figures"])
    also = "".join(f"<li>{html.escape(k)}: {html.escape(v)}</li>" for k, v in pub["also"])
    section.raw(
        '<div class="paper"><h4>Published figures, for context — measured on '
        f'{html.escape(pub["hardware"])}, not on this machine</h4>'
        f'<p class="dim">{html.escape(pub["source"])}</p><ul>{items}</ul>'
        + (f'<p class="dim">Also published:</p><ul>{also}</ul>' if also else "") + "</div>")


def _cell(c: dict[str, Any] | None, *, p99: bool = True) -> Cell:
    if not c:
        return "–"
    if c.get("status") not in ("ok", None) and not c.get("items_per_s"):
        return (str(c.get("status")).upper() if c.get("status") in ("oom", "error")
                else str(c.get("status")), "bad" if c.get("status") in ("oom", "error") else "warn")
    text = fmt(c.get("items_per_s"))
    if p99 and c.get("p99_ms") is not None:
        text += f" ({fmt(c['p99_ms'], 1)} ms)"
    return text


def _multi_instance(section: Section, head: dict[str, Any]) -> None:
    batches = head["batches"]
    best_s, best_c = head.get("best_single"), head.get("best_combination")
    section.heading("Headline: items/s (query p99 ms) per unit combination and batch size")
    section.table(["combination", "instances", *(f"batch {b}" for b in batches)],
                  ([r["combination"], str(r["instances"]),
                    *(_cell(r["cells"].get(str(b))) for b in batches)] for r in head["rows"]),
                  numeric=[f"batch {b}" for b in batches])
    pairs = []
    if best_s:
        pairs.append(("best single unit", f"{best_s['combination']} at batch {best_s['batch']} "
                      f"×{best_s['instances']}: {fmt(best_s['items_per_s'])} items/s"))
    if best_c:
        pairs.append(("best combination", f"{best_c['combination']} at batch {best_c['batch']} "
                      f"×{best_c['instances']}: {fmt(best_c['items_per_s'])} items/s"))
    if head.get("combination_over_single"):
        pairs.append(("best combination ÷ best single", f"{head['combination_over_single']:.2f}×"))
    section.kv(pairs)
    for f in head.get("findings") or []:
        section.text(f)
    traces = []
    for i, r in enumerate(head["rows"]):
        xs = [b for b in batches if (r["cells"].get(str(b)) or {}).get("items_per_s")]
        traces.append(line(xs, [r["cells"][str(b)]["items_per_s"] for b in xs],
                           f"{r['combination']} ×{r['instances']}", color=colour(i),
                           dash=None if r["instances"] == 1 else "dash"))
    section.figure(figure(traces, title="Throughput against batch size per unit combination "
                          "(dashed: more instances)", x="batch size", y="items/s", x_log=True,
                          x_ticks=batches))
    cont = head.get("contention") or []
    if cont:
        section.heading("Contention: each combination against its units alone")
        section.table(["combination", "batch", "instances", "measured items/s",
                       "sum alone items/s", "measured ÷ sum", "each unit inside ÷ alone"],
                      ([c["combination"], str(c["batch"]), str(c["instances"]),
                        fmt(c["measured_items_per_s"]), fmt(c["summed_solo_items_per_s"]),
                        f"{fmt(c['factor'], 2)}×",
                        "; ".join(f"{u} {fmt(v['factor'], 2)}×" for u, v in c["per_unit"].items())]
                       for c in cont),
                      numeric=("measured items/s", "sum alone items/s", "measured ÷ sum"))
        combos = sorted({(c["combination"], c["instances"]) for c in cont})
        z = [[next((c["factor"] for c in cont if (c["combination"], c["instances"]) == k
                    and c["batch"] == b), None) for b in batches] for k in combos]
        section.figure(figure([factor_heatmap(
            [f"b{b}" for b in batches], [f"{k[0]} ×{k[1]}" for k in combos], z,
            colorbar="measured ÷ sum alone",
            hover="%{y} at %{x}: %{z:.2f}× the sum of its units alone")],
            title="Contention factor (1 = the units' solo figures add up)", x="batch size",
            y="combination", height=max(260, 80 + 40 * len(combos)), legend_below=False))


def _multi_tenancy(section: Section, head: dict[str, Any]) -> None:
    batches = head["batches"]
    section.heading("Headline: offline items/s per execution mode and batch size "
                    "(× sequential)")
    rows = []
    for r in head["rows"]:
        row: list[Cell] = [str(r["variant"])]
        for b in batches:
            c = r["cells"].get(str(b))
            text = _cell(c, p99=False)
            if c and c.get("gain_over_sequential"):
                text = f"{text} ({c['gain_over_sequential']:.2f}×)" if isinstance(text, str) else text
            row.append(text)
        row.append(f"{r['batching_gain']:.2f}×" if r.get("batching_gain") else "–")
        rows.append(row)
    section.table(["mode", *(f"batch {b}" for b in batches), "batching gain"], rows,
                  numeric=[*(f"batch {b}" for b in batches), "batching gain"])
    for f in head.get("findings") or []:
        section.text(f)
    traces = [bar([str(r["variant"]) for r in head["rows"]],
                  [(r["cells"].get(str(b)) or {}).get("items_per_s") for r in head["rows"]],
                  f"batch {b}", color=colour(i)) for i, b in enumerate(batches)]
    section.figure(figure(traces, title="Offline throughput per execution mode and batch size",
                          x="mode", y="items/s", barmode="group", x_category=True))
    server = head.get("server") or []
    if server:
        bound = head.get("p99_bound_ms")
        section.heading(f"Server load: peak rate within p99 ≤ "
                        f"{format(bound, 'g') if bound is not None else '–'} ms at batch "
                        f"{head.get('server_batch')}")
        section.table(["mode", "peak qps", "× sequential", "status / why no peak"],
                      ([s["variant"], fmt(s.get("peak_qps")),
                        f"{s['gain_over_sequential']:.2f}×" if s.get("gain_over_sequential")
                        else "–", (s.get("reason") or s.get("status") or "")[:200]]
                       for s in server), numeric=("peak qps", "× sequential"))
        section.figure(figure([bar([s["variant"] for s in server],
                                   [s.get("peak_qps") for s in server], "peak qps")],
                              title="Server load: peak queries/s within the p99 bound",
                              x="mode", y="queries/s", x_category=True, legend_below=False))


def _pipeline(section: Section, head: dict[str, Any]) -> None:
    rows = head["rows"]
    section.heading("Headline: per network, the pipeline against the best single unit and "
                    "data-parallel replicas (items/s; J/item where measured)")

    def cell(c: dict[str, Any] | None) -> str:
        if not c:
            return "–"
        if not c.get("items_per_s"):
            return str(c.get("status"))
        text = fmt(c["items_per_s"])
        if c.get("energy_per_item_j"):
            text += f" ({fmt(c['energy_per_item_j'], 4)} J)"
        return text

    def single(r: dict[str, Any]) -> str:
        best = r.get("single")
        return f"{best['unit']}: {cell(best)}" if best else "–"

    section.table(["network", "batch", "best single unit", "data-parallel", "pipeline",
                   "pipeline ÷ single", "pipeline ÷ data-parallel", "pipeline stages"],
                  ([r["model"], str(r["batch"]), single(r), cell(r.get("replicas")),
                    cell(r.get("pipeline")),
                    f"{r['pipeline_over_single']:.2f}×" if r.get("pipeline_over_single") else "–",
                    f"{r['pipeline_over_replicas']:.2f}×" if r.get("pipeline_over_replicas")
                    else "–", str((r.get("pipeline") or {}).get("stages") or
                                  (r.get("pipeline") or {}).get("error") or "")[:160]]
                   for r in rows),
                  numeric=("pipeline ÷ single", "pipeline ÷ data-parallel"))
    for f in head.get("findings") or []:
        section.text(f)
    labels = [f"{r['model']} b{r['batch']}" for r in rows]
    section.figure(figure(
        [bar(labels, [(r.get(k) or {}).get("items_per_s") for r in rows], name, color=colour(i))
         for i, (k, name) in enumerate((("single", "best single unit"),
                                        ("replicas", "data-parallel replicas"),
                                        ("pipeline", "pipeline")))],
        title="Throughput per network: best single unit, data-parallel replicas, pipeline",
        x="network", y="items/s", barmode="group", x_category=True))
    if any((r.get(k) or {}).get("energy_per_item_j") for r in rows
           for k in ("single", "replicas", "pipeline")):
        section.figure(figure(
            [bar(labels, [(r.get(k) or {}).get("energy_per_item_j") for r in rows], name,
                 color=colour(i))
             for i, (k, name) in enumerate((("single", "best single unit"),
                                            ("replicas", "data-parallel replicas"),
                                            ("pipeline", "pipeline")))],
            title="Energy per item per network", x="network", y="J per item",
            barmode="group", x_category=True))


_VERDICT_STYLE = {"held": "ok", "did not hold": "bad", "not measurable here": "warn"}


def _claims(section: Section, head: dict[str, Any]) -> None:
    """The paper's claims, one line each, beside this machine's figures and the verdict."""
    claims = head.get("claims") or []
    if not claims:
        return
    section.heading("The paper's claims on this machine")
    section.table(["claim", "the paper", "verdict", "this machine"],
                  ([c["claim"], c["paper"], (c["verdict"], _VERDICT_STYLE.get(c["verdict"], "")),
                    c["here"]] for c in claims))


@register_kind("study", headline=_headline)
def render_study(run: RunData, section: Section) -> None:
    """The claims, the published box, the headline, the figures and every point with its run."""
    from infermux.study import headline_for

    name = _name(run)
    points = _points(run)
    if points:
        _claims(section, headline_for(name, points))
    section.kv([("study", name), ("models", ", ".join(run.config.get("models") or [])),
                ("units", ", ".join(run.config.get("resolved_units") or [])),
                ("why these units", run.config.get("units_why")),
                ("engines", ", ".join(f"{u}: {e}" for u, e in
                                      (run.config.get("engines") or {}).items())),
                ("budget s", run.config.get("budget_s")),
                ("each point", f"≥ {fmt(run.config.get('duration_s'))} s and "
                               f"{run.config.get('min_queries')} samples through the runtime")])
    _published(section, name)
    if not points:
        section.note("No point was stored for this study.", "warn")
        return
    counts: dict[str, int] = {}
    for p in points:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    if counts.get("skipped") or counts.get("error") or counts.get("oom"):
        section.note("points: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                     + " (see the table of points for why)", "warn")
    head = headline_for(name, points)
    if name == "multi-instance":
        _multi_instance(section, head)
    elif name == "multi-tenancy":
        _multi_tenancy(section, head)
    elif name == "pipeline":
        _pipeline(section, head)
    section.heading("Every point (each is a `run` in this database)")
    section.table(["#", "point", "batch", "instances", "scenario", "status", "items/s", "p99 ms",
                   "run", "note"],
                  ([str(p["point"]), p["variant"], fmt(p["params"].get("batch")),
                    fmt(p["params"].get("instances")), str(p["params"].get("scenario") or "offline"),
                    status_cell(str(p["status"])), fmt((p["figures"] or {}).get("items_per_s")),
                    fmt((p["figures"] or {}).get("p99_ms"), 2),
                    str(p["sub_run_id"]) if p.get("sub_run_id") else "–",
                    (p.get("error") or "")[:200]] for p in points),
                  numeric=("batch", "instances", "items/s", "p99 ms", "run"))
