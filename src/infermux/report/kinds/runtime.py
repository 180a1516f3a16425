"""`run` runs: the runtime under a LoadGen scenario, trial by trial.

Every trial, the throughput–latency curve of a peak search with its bound, per-model phases,
workers, the placement timeline, pipeline stages and the latency of every query.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from infermux.report.data import RunData
from infermux.report.figures import bar, figure, hline, line, scatter, vline
from infermux.report.kinds import Headline, register_kind
from infermux.report.kinds.common import status_cell
from infermux.report.page import Section, fmt

if TYPE_CHECKING:
    from infermux.runtime.trial import LatencySummary, ModelSummary, TrialSummary, WorkerSummary

__all__ = ["final_trial", "render_run"]


def _trials(run: RunData) -> list[dict[str, Any]]:
    return run.rows("run_trials", order="trial")


def final_trial(run: RunData, trials: Sequence[dict[str, Any]] | None = None
                ) -> dict[str, Any] | None:
    """The trial that answers the question: the peak's (the best valid rate), else the last."""
    trials = list(trials if trials is not None else _trials(run))
    if not trials:
        return None
    search = run.summary.get("peak")
    server = [t for t in trials if t.get("rate_qps")]
    if search and server:
        # A peak search: the trial nearest its peak, or without one its last server trial
        # (the offline trial after the search is not the answer).
        peak = search.get("peak_qps")
        return (min(server, key=lambda t: abs((t["rate_qps"] or 0) - peak)) if peak
                else server[-1])
    return trials[-1]


def _headline(run: RunData) -> Headline | None:
    value = run.summary.get("items_per_s")
    if value is None:
        final = final_trial(run)
        value = final and final.get("items_per_s")
    if not value:
        return None
    scenario = run.summary.get("scenario") or ""
    return (f"{scenario} throughput".strip(), float(value), "samples/s")


def _peak_figure(run: RunData, trials: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    server = [t for t in trials if t.get("scenario") == "server" and t.get("p99_ms") is not None]
    if not server:
        return None
    peak = run.summary.get("peak") or {}
    bound = peak.get("p99_bound_ms") or ((run.config.get("plan") or {}).get("load") or {}).get(
        "p99_bound_ms")
    traces = []
    for valid in (True, False):
        pts = [t for t in server if bool(t.get("valid")) == valid]
        if pts:
            traces.append(scatter(
                [t.get("items_per_s") for t in pts], [t["p99_ms"] for t in pts],
                "valid trial" if valid else "invalid trial",
                text=[f"{fmt(t.get('rate_qps'))} qps" for t in pts],
                hover=[f"trial {t['trial']}: {fmt(t.get('rate_qps'))} qps offered"
                      + ("" if valid else f" — {t.get('validity_note') or 'invalid'}")
                      for t in pts],
                symbol="circle" if valid else "x", size=11,
                color="#1a7f37" if valid else "#cf222e", labels=True))
    ordered = sorted(server, key=lambda t: t.get("items_per_s") or 0)
    traces.insert(0, line([t.get("items_per_s") for t in ordered],
                          [t["p99_ms"] for t in ordered], "server trials", markers=False,
                          color="#8c959f", width=1))
    shapes, notes = [], []
    if bound:
        s, n = hline(float(bound), f"p99 bound {float(bound):g} ms")
        shapes.append(s)
        notes.append(n)
    offline = peak.get("offline_items_per_s") or next(
        (t.get("items_per_s") for t in trials if t.get("scenario") == "offline"),
        None)
    if offline:
        s, n = vline(float(offline), f"offline {fmt(float(offline))}/s")
        shapes.append(s)
        notes.append(n)
    title = "Throughput against p99 latency of the server trials"
    if peak.get("peak_qps"):
        title += f" — peak {fmt(peak['peak_qps'])} qps within the bound"
    return figure(traces, title=title, x="samples/s achieved", y="p99 latency (ms)",
                  shapes=shapes, annotations=notes)


def _ms(latency: LatencySummary | None, key: str) -> float | None:
    return getattr(latency, key) if latency is not None else None


def _phase_figure(models: dict[str, ModelSummary]) -> dict[str, Any] | None:
    names = list(models)
    if not names:
        return None
    traces = []
    for phase, label in (("queueing", "queueing"), ("batching_wait", "batching wait"),
                         ("compute", "compute")):
        means = [_ms(getattr(models[m].phases, phase), "mean_ms") for m in names]
        p99 = [_ms(getattr(models[m].phases, phase), "p99_ms") for m in names]
        traces.append(bar(names, [v or 0.0 for v in means], label,
                          hover=[f"{label}: mean {fmt(a, 2)} ms, p99 {fmt(b, 2)} ms"
                                 for a, b in zip(means, p99, strict=True)]))
    return figure(traces, title="Where each query's time went, per model (means add up to the "
                  "mean latency)", x="model", y="ms", barmode="stack", x_category=True)


def _worker_figure(workers: dict[str, WorkerSummary]) -> dict[str, Any] | None:
    names = list(workers)
    if not names:
        return None
    util = [(workers[w].utilisation or 0.0) * 100 for w in names]
    share = [workers[w].share * 100 for w in names]
    hover = [f"{w}: {workers[w].unit} · {workers[w].status}" for w in names]
    fig = figure([bar(names, util, "utilisation (% of the trial busy)", hover=hover),
                  bar(names, share, "share of the items served (%)", hover=hover)],
                 title="Workers: utilisation and share of the work", x="worker", y="%",
                 barmode="group", x_category=True)
    return fig


def _timeline_figure(record: TrialSummary) -> dict[str, Any] | None:
    rows = record.timeline.rows
    if not rows:
        return None
    series: dict[str, dict[float, int]] = {}
    for r in rows:
        key = f"{r.unit} · {r.model}"
        series.setdefault(key, {})
        series[key][r.t_s] = series[key].get(r.t_s, 0) + r.items
    times = sorted({r.t_s for r in rows})
    bin_s = record.timeline.bin_s
    traces = [bar(times, [per.get(t, 0) for t in times], key) for key, per in series.items()]
    shapes, notes = [], []
    for e in record.events[:40]:
        if e.get("event") in ("move", "worker_failed"):
            text = (f"{e.get('worker')}: {e.get('from')}→{e.get('to')}" if e["event"] == "move"
                    else f"{e.get('worker')} failed")
            s, n = vline(float(e.get("t_s") or 0.0), text,
                         "#cf222e" if e["event"] == "worker_failed" else "#5b6475")
            shapes.append(s)
            notes.append(n)
    dynamic = len({r.model for r in rows}) > 1 or shapes
    title = ("Which unit served which model over time" if dynamic
             else "Items served over time") + f" (items per {bin_s * 1000:.0f} ms)"
    return figure(traces, title=title, x="time into the trial (s)", y="items completed",
                  barmode="stack", shapes=shapes, annotations=notes)


def _query_cdf(run: RunData, trial: int) -> dict[str, Any] | None:
    rows = run.reader.query(
        "SELECT model, latency_ns FROM run_queries WHERE run_id = ? AND trial = ? AND ok = 1 "
        "AND latency_ns IS NOT NULL", (run.id, trial)) if run.reader.has_table(
        "run_queries") else []
    by_model: dict[str, list[int]] = {}
    for r in rows:
        by_model.setdefault(r[0], []).append(r[1])
    traces = []
    for model, lat in sorted(by_model.items()):
        q = np.quantile(np.asarray(lat, dtype=np.float64), np.linspace(0, 1, 101)) / 1e6
        traces.append(line(list(q), [i / 100 for i in range(101)], f"{model} ({len(lat):,} queries)",
                           markers=False))
    return figure(traces, title=f"Query latency distribution (trial {trial}, from when each "
                  "query was due)", x="latency (ms)", y="share of queries at or below",
                  y_range=[0, 1.02])


def _stages(section: Section, record: TrialSummary) -> None:
    pipelines = record.pipelines or {}
    if not pipelines:
        return
    section.heading("Pipeline stages")
    rows = [(model, st) for model, stages in pipelines.items() for st in stages]
    section.table(["model", "#", "segment", "units", "engine", "busy", "mean batch",
                   "compute ms/batch", "transfer ms/batch", "queue depth"],
                  ([m, str(st.get("stage")), str(st.get("segment")),
                    "+".join(st.get("units") or []), str(st.get("engine")),
                    f"{(st.get('busy') or 0):.0%}", fmt(st.get("mean_batch")),
                    fmt(st.get("compute_ms_per_batch"), 2), fmt(st.get("transfer_ms_per_batch"), 2),
                    fmt(st.get("queue_depth"), 2)] for m, st in rows),
                  numeric=("busy", "mean batch", "compute ms/batch", "transfer ms/batch",
                           "queue depth"))
    labels = [f"{m} #{st.get('stage')} {'+'.join(st.get('units') or [])}" for m, st in rows]
    section.figure(figure(
        [bar(labels, [(st.get("busy") or 0) * 100 for _, st in rows], "busy %",
             hover=[str(st.get("segment")) for _, st in rows])],
        title="Busy share of each pipeline stage (a balanced pipeline has every stage near 100%)",
        x="stage", y="% of the trial", x_category=True, y_range=[0, 105], legend_below=False))


@register_kind("run", headline=_headline)
def render_run(run: RunData, section: Section) -> None:
    """Trials, the peak curve, then the deciding trial's models, workers, timeline, stages."""
    from infermux.runtime.trial import TrialSummary

    trials = _trials(run)
    errors = run.summary.get("build_errors") or {}
    for name, text in errors.items():
        section.note(f"worker {name} could not be built: {text}", "bad")
    if not trials:
        section.note("No trial was stored for this run.", "warn")
        return
    peak = run.summary.get("peak") or {}
    if peak.get("reason"):
        section.note(f"no peak: {peak['reason']}", "warn")
    section.heading("Trials")
    section.table(["trial", "scenario", "offered qps", "status", "samples/s", "completed",
                   "failed", "p50 ms", "p90 ms", "p99 ms", "s", "notes"],
                  ([str(t["trial"]), str(t["scenario"]), fmt(t.get("rate_qps")),
                    status_cell("ok", bool(t.get("valid"))) if t.get("valid") else
                    ("invalid", "warn"), fmt(t.get("items_per_s")),
                    fmt(t.get("completed")), fmt(t.get("failed")), fmt(t.get("p50_ms"), 2),
                    fmt(t.get("p90_ms"), 2), fmt(t.get("p99_ms"), 2), fmt(t.get("duration_s"), 2),
                    t.get("validity_note") or ""] for t in trials),
                  numeric=("offered qps", "samples/s", "completed", "failed", "p50 ms", "p90 ms",
                           "p99 ms", "s"))
    section.figure(_peak_figure(run, trials))
    final = final_trial(run, trials)
    assert final is not None
    record = TrialSummary.from_dict(final.get("record") or {})
    which = f"trial {final['trial']}" + (" (the peak)" if peak.get("peak_qps") else "")
    models = record.models
    if models:
        section.heading(f"Models — {which}")
        section.table(["model", "completed", "failed", "samples/s", "p50 ms", "p99 ms",
                       "queue p99", "batch-wait p99", "compute p99", "batch sizes"],
                      ([name, fmt(m.completed), fmt(m.failed), fmt(m.items_per_s),
                        fmt(_ms(m.latency, "p50_ms"), 2), fmt(_ms(m.latency, "p99_ms"), 2),
                        *(fmt(_ms(getattr(m.phases, p), "p99_ms"), 2)
                          for p in ("queueing", "batching_wait", "compute")),
                        " ".join(f"{k}×{v}" for k, v in m.batch_histogram.items())]
                       for name, m in models.items()),
                      numeric=("completed", "failed", "samples/s", "p50 ms", "p99 ms",
                               "queue p99", "batch-wait p99", "compute p99"))
        section.figure(_phase_figure(models))
    workers = record.workers
    if workers:
        section.heading(f"Workers — {which}")
        for name, w in workers.items():
            if not w.ok:
                section.note(f"worker {name} on {w.unit} failed: {w.error}", "bad")
        section.table(["worker", "unit", "model", "status", "batches", "items", "share",
                       "utilisation", "items/s", "batch sizes"],
                      ([name, w.unit, w.model, status_cell(w.status), fmt(w.batches),
                        fmt(w.items), f"{w.share:.1%}", f"{(w.utilisation or 0):.0%}",
                        fmt(w.items_per_s),
                        " ".join(f"{k}×{v}" for k, v in w.batch_histogram.items())]
                       for name, w in workers.items()),
                      numeric=("batches", "items", "share", "utilisation", "items/s"))
        section.figure(_worker_figure(workers))
    section.figure(_timeline_figure(record))
    _stages(section, record)
    section.figure(_query_cdf(run, int(final["trial"])))
