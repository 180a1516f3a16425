"""Every table the command line prints, and its one number formatter.

Rendering never changes the data it is given.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

from infermux.cache import KINDS

if TYPE_CHECKING:
    from infermux.cache import CacheEntry, CacheSummary, PruneResult
    from infermux.runtime.trial import LatencySummary, TrialSummary

__all__ = [
    "accuracy_table",
    "age_text",
    "bench_table",
    "cache_entries_table",
    "cache_table",
    "candidates_table",
    "causes_table",
    "compare_rows",
    "compare_table",
    "determinism_table",
    "explain_table",
    "num",
    "pareto_table",
    "partition_tables",
    "phase_table",
    "pipelines_table",
    "predict_table",
    "prune_line",
    "prune_table",
    "readings_table",
    "run_headline",
    "run_models_table",
    "runs_table",
    "size_text",
    "stages_table",
    "study_points_table",
    "timeline_text",
    "units_table",
    "workers_table",
]


def num(value: Any, digits: int = 1) -> str:
    """A figure for a table: – when absent, thousands without decimals, else `digits` decimals."""
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def units_table(units: Iterable[dict[str, Any]]) -> Table:
    """One row per unit: id, name, contention domain, availability and key facts."""
    table = Table(title="Execution units")
    for col in ("unit", "name", "contention domain", "available", "details"):
        table.add_column(col)
    for unit in units:
        d = unit.get("details", {})
        facts = []
        if "memory_bytes" in d:
            facts.append(f"{d['memory_bytes'] / 2**30:.0f} GiB, {d['sm_count']} SMs, "
                         f"cc {d['compute_capability']}")
        if unit.get("kind") == "cpu":
            facts.append(f"{len(unit['cores'])} cores, {' '.join(d.get('isa', [])) or 'no ISA flags'}")
        table.add_row(unit["id"], unit["name"], unit["contention_domain"],
                      "yes" if unit["available"] else f"no: {unit['reason']}", "; ".join(facts))
    return table


def bench_table(results: Iterable[dict[str, Any]], title: str = "Offline benchmark") -> Table:
    """One row per measured point: throughput, latency percentiles and where the time went.

    p90/p95 are left to `--json` and `results show --json` so the table fits 100 columns.
    """
    table = Table(title=title)
    for col, justify in (("unit", "left"), ("engine", "left"), ("batch", "right"),
                         ("inst", "right"), ("items/s", "right"), ("p50 ms", "right"),
                         ("p99 ms", "right"), ("max ms", "right"),
                         ("h2d/comp/d2h ms", "right"), ("agree", "left"), ("valid", "left")):
        table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    results = list(results)
    energy = any(r.get("energy_per_item_j") is not None for r in results)
    if energy:
        table.add_column("J/item", justify="right")
        table.add_column("W mean/peak", justify="right")
    for r in results:
        extra = [num(r.get("energy_per_item_j"), 4),
                 f"{num(r.get('mean_power_w'))}/{num(r.get('peak_power_w'))}"] if energy else []
        if r["status"] != "ok":
            table.add_row(r["unit"], r["engine"], _batch_cell(r), str(r["instances"]),
                          r["status"].upper(), "", "", "", "", "", (r.get("error") or "")[:80],
                          *(["", ""] if energy else []))
            continue
        phases = "/".join(num(r.get(f"{p}_ms"), 2) for p in ("h2d", "compute", "d2h"))
        if not r.get("h2d_ms") and not r.get("d2h_ms"):
            phases = f"–/{num(r.get('compute_ms'), 2)}/–"  # host units: no copies
        table.add_row(
            r["unit"], r["engine"], _batch_cell(r), str(r["instances"]),
            num(r.get("items_per_s")) + (f" ({num(r['tokens_per_s'])} tok/s)"
                                         if r.get("tokens_per_s") else ""),
            num(r.get("p50_ms"), 2),
            num(r.get("p99_ms"), 2), num(r.get("max_ms"), 2), phases,
            _agreement(r.get("agreement")),
            "yes" if r["valid"] else f"no: {r.get('validity_note', '')}", *extra,
        )
    return table


def _batch_cell(r: dict[str, Any]) -> str:
    """`8`, or `8×128` for a point at a sequence length."""
    return f"{r['batch']}×{r['seq_len']}" if r.get("seq_len") else str(r["batch"])


def _agreement(entry: dict[str, Any] | None) -> str:
    """`ok 3e-06` / `FAIL 0.4` / `skipped`: the agreement check in a few characters."""
    if not entry:
        return "–"
    if entry.get("status") == "skipped":
        return "skipped"
    err = entry.get("rel_err")
    figure = f" {err:.0e}" if isinstance(err, float) else ""
    if entry.get("status") == "fail":
        return f"[bold red]FAIL{figure}[/]"
    return f"ok{figure} {entry.get('precision', '')}".rstrip()


def runs_table(runs: Iterable[dict[str, Any]]) -> Table:
    """One row per stored run."""
    table = Table(title="Runs")
    for col in ("id", "kind", "status", "started (UTC)", "model", "results", "command"):
        table.add_column(col)
    for run in runs:
        table.add_row(str(run["id"]), run["kind"], run["status"], run["started_at"],
                      str(run.get("model") or ""), str(run.get("results", "")),
                      (run.get("command") or "")[:60])
    return table


def compare_table(a: dict[str, Any], b: dict[str, Any]) -> Table:
    """Points of two runs matched by (model, unit, engine, batch, instances, data, length).

    The length is the sequence length of a model that has one (None otherwise).
    """
    table = Table(title=f"Run {a['id']} vs run {b['id']}")
    for col in ("model", "unit", "engine", "batch", "inst", f"items/s #{a['id']}",
                f"items/s #{b['id']}", "ratio", f"p99 ms #{a['id']}", f"p99 ms #{b['id']}"):
        table.add_column(col)
    for row in compare_rows(a, b):
        table.add_row(row["model"], row["unit"], row["engine"], _batch_cell(row),
                      str(row["instances"]), num(row["a_items_per_s"]),
                      num(row["b_items_per_s"]), num(row["ratio"], 3),
                      num(row["a_p99_ms"], 2), num(row["b_p99_ms"], 2))
    return table


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Matched points of two runs; `ratio` is b's throughput over a's."""
    def key(r: dict[str, Any]) -> tuple:
        return (r["model"], r["unit"], r["engine"], r["batch"], r["instances"], r["data"],
                r.get("seq_len"))

    left = {key(r): r for r in a["results"]}
    right = {key(r): r for r in b["results"]}
    rows = []
    for k in sorted(set(left) | set(right), key=lambda t: tuple(str(x) for x in t)):
        ra, rb = left.get(k, {}), right.get(k, {})
        ta, tb = ra.get("items_per_s"), rb.get("items_per_s")
        rows.append({
            "model": k[0], "unit": k[1], "engine": k[2], "batch": k[3], "instances": k[4],
            "data": k[5], "seq_len": k[6], "a_items_per_s": ta, "b_items_per_s": tb,
            "ratio": (tb / ta) if ta and tb else None,
            "a_p99_ms": ra.get("p99_ms"), "b_p99_ms": rb.get("p99_ms"),
        })
    return rows


def _pct(entry: dict[str, Any] | None) -> str:
    if not entry or entry.get("value") is None:
        return "–"
    return f"{entry['value']:.1%} [{entry['low']:.1%}, {entry['high']:.1%}]"


def _g(value: float | None) -> str:
    if value is None:
        return "–"
    return "0" if value == 0 else f"{value:.2g}"


def _precision(v: dict[str, Any]) -> str:
    computed = v.get("computed_precision")
    if computed and computed != v["precision"]:
        return f"{v['precision']} ({computed})"
    return v["precision"]


def _label(v: dict[str, Any]) -> list[str]:
    engine = v["engine"] if v["config"] == "default" else f"{v['engine']} [{v['config']}]"
    return [v["unit"], engine, _precision(v)]


def accuracy_table(report: dict[str, Any]) -> Table:
    """One row per variant: accuracy against labels and the fp32 reference, logit errors."""
    table = Table(title=f"{report['model']['name']} — accuracy on {report['data']['items']} items "
                        f"of {report['data']['name']} (95% intervals)")
    failed = any(not v.get("accuracy") for v in report["variants"])
    for col, justify in (("unit", "left"), ("engine", "left"), ("precision", "left"),
                         ("top-1", "right"), ("top-5", "right"), ("agrees with fp32", "right"),
                         ("max |err|", "right"), ("mean |err|", "right"), ("rel err", "right"),
                         *((("error", "left"),) if failed else ())):
        table.add_column(col, justify=justify)
    for v in report["variants"]:
        acc = v.get("accuracy")
        if not acc:
            table.add_row(*_label(v), "–", "–", "–", "–", "–", "–", str(v.get("error")))
            continue
        mean = acc["mean_abs_err"]
        table.add_row(*_label(v), _pct(acc.get("top1")), _pct(acc.get("top5")),
                      _pct(acc.get("agree_top1")), _g(acc.get("max_abs_err")),
                      f"{_g(mean['value'])} ±{_g((mean['high'] or 0) - (mean['value'] or 0))}"
                      if mean.get("value") is not None else "–",
                      _g(acc.get("rel_err")), *(("",) if failed else ()))
    return table


def _within(det: dict[str, Any]) -> tuple[str, str]:
    r2r = det.get("run_to_run")
    if r2r is None:
        run_to_run = "–"
    elif r2r["builds_varying"]:
        run_to_run = f"differs ({_g(r2r['max_abs_diff'])}, {r2r['top1_flips']} flips)"
    else:
        run_to_run = "identical"
    sizes = det.get("batch_dependence") or []
    varying = [e for e in sizes if e["builds_varying"]]
    if not sizes:
        batch = "–"
    elif varying:
        batch = ", ".join(f"b{e['batch']}: {_g(e['max_abs_diff'])}"
                          + (f" ({e['top1_flips']} flips)" if e["top1_flips"] else "")
                          for e in varying)
    else:
        batch = "identical at " + ",".join(str(e["batch"]) for e in sizes)
    return run_to_run, batch


def determinism_table(report: dict[str, Any]) -> Table:
    """One row per variant: variance across builds, within a build, and latency across builds."""
    table = Table(title="Determinism — builds in fresh processes; within a build: the same inputs "
                        "twice, items alone vs in batches")
    for col, justify in (("unit", "left"), ("engine", "left"), ("precision", "left"),
                         ("builds", "right"), ("distinct", "right"), ("max diff", "right"),
                         ("top-1 flips", "right"), ("run-to-run", "left"),
                         ("batch-size dependence", "left"), ("latency ms (min–max)", "right"),
                         ("spread", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for v in report["variants"]:
        det = v["determinism"]
        rebuild = det.get("rebuild") or {}
        lat = det.get("latency")
        run_to_run, batch = _within(det)
        builds = f"{det['builds_ok']}/{det['builds']}"
        table.add_row(
            *_label(v), builds, str(rebuild.get("distinct", "–")), _g(rebuild.get("max_abs_diff")),
            str(rebuild.get("top1_flips", "–")), run_to_run, batch,
            f"{lat['median_ms']:.3g} ({lat['min_ms']:.3g}–{lat['max_ms']:.3g})" if lat else "–",
            f"{lat['spread']:.0%}" if lat and lat.get("spread") is not None else "–")
    return table


def causes_table(report: dict[str, Any]) -> Table | None:
    """One row per knob pinned against a variance: what it removed and its throughput cost."""
    rows = [(v, c) for v in report["variants"] for c in v["causes"]]
    if not rows:
        return None
    table = Table(title="Causes — each variance measured again with one knob pinned")
    for col, justify in (("variant", "left"), ("variance", "left"), ("knob pinned", "left"),
                         ("builds", "right"), ("removes", "left"), ("left (max diff)", "left"),
                         ("items/s vs baseline", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for v, c in rows:
        removes = ", ".join(f"{k}: {'yes' if ok else 'no' if ok is False else '?'}"
                            for k, ok in c["removes"].items())
        det = c["determinism"]
        left = []
        if "rebuild" in c["variance_left"] and det.get("rebuild"):
            left.append(f"rebuild {_g(det['rebuild']['max_abs_diff'])}")
        if "run-to-run" in c["variance_left"] and det.get("run_to_run"):
            left.append(f"run-to-run {_g(det['run_to_run']['max_abs_diff'])}")
        sizes = [e for e in det.get("batch_dependence") or [] if e["builds_varying"]]
        if sizes:
            left.append("batch " + ", ".join(f"b{e['batch']} {_g(e['max_abs_diff'])}" for e in sizes))
        ratio = c.get("throughput_ratio")
        table.add_row(" ".join(_label(v)), ", ".join(v["determinism"]["variance"]), c["title"],
                      str(c["builds"]), removes,
                      "; ".join(left) or ("none" if not c["errors"] else f"error: {c['errors'][0]}"),
                      f"{ratio:.2f}×" if ratio else "–")
    return table


def _reading(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def readings_table(tick: Any, title: str = "Telemetry") -> Table:
    """One row per device reading of a tick: power, energy, utilisation, clocks, temperature."""
    table = Table(title=title)
    for col, justify in (("source", "left"), ("device", "left"), ("power W", "right"),
                         ("energy J", "right"), ("util %", "right"), ("mem util %", "right"),
                         ("clock MHz", "right"), ("temp °C", "right"), ("notes", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    if tick is None:
        return table
    for r in tick.readings:
        notes = []
        if r.throttle:
            notes.append("clocks: " + ",".join(r.throttle))
        if r.other_processes:
            notes.append(f"{len(r.other_processes)} other process(es)")
        if r.rails_w:
            notes.append(" ".join(f"{k}={v:.2f}W" for k, v in r.rails_w.items()))
        if r.cores_util_pct:
            notes.append("cores " + " ".join(f"{c:.0f}" for c in r.cores_util_pct))
        if r.mem_used_bytes is not None:
            notes.append(f"mem {r.mem_used_bytes / 2**30:.1f} GiB")
        notes.extend(f"{k}={v:g}" for k, v in r.extra.items())
        table.add_row(r.source, r.device, _reading(r.power_w), _reading(r.energy_j), _reading(r.util_pct),
                      _reading(r.mem_util_pct), _reading(r.clock_mhz, 0), _reading(r.temp_c),
                      "; ".join(notes))
    return table


def partition_tables(shown: dict[str, Any], name: str) -> list[Table]:
    """A partition's cut points and its chosen stages."""
    cuts = Table(title=f"{name} — cut points ({shown['capture']})")
    for col, justify in (("#", "right"), ("after node", "left"), ("crossing tensor", "left"),
                         ("dtype", "left"), ("KiB/item", "right")):
        cuts.add_column(col, justify=justify)  # type: ignore[arg-type]
    for i, c in enumerate(shown["cuts"], start=1):
        cuts.add_row(str(i), c["node"], "×".join(map(str, c["shape"])), c["dtype"],
                     num(c["bytes_per_item"] / 1024))
    segs = Table(title="Segments between consecutive cut points")
    for col, justify in (("#", "right"), ("segment", "left"), ("MFLOPs/item", "right"),
                         ("parameters", "right")):
        segs.add_column(col, justify=justify)  # type: ignore[arg-type]
    for i, s in enumerate(shown["segments"]):
        segs.add_row(str(i), f"{s['start']}→{s['end']}", num(s["flops_per_item"] / 1e6),
                     f"{s['parameters']:,}")
    return [cuts, segs]


def candidates_table(report: dict[str, Any]) -> Table:
    """The partition's candidate plans, predicted beside measured."""
    table = Table(title=f"{report['model']['name']} — pipeline candidates at batch {report['batch']}")
    for col, justify in (("#", "right"), ("plan", "left"), ("predicted/s", "right"),
                         ("measured/s", "right"), ("error", "right"), ("stage busy", "left"),
                         ("", "left")):
        table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for c in report["candidates"]:
        m = c["measurement"] or {}
        busy = " ".join(f"{b:.0%}" for b in m.get("stage_busy", []))
        err_pct = f"{c['error_pct']:+.0f}%" if c["error_pct"] is not None else c["status"]
        table.add_row(str(c["rank"]), c["plan"], num(c["predicted_items_per_s"]),
                      num(c["measured_items_per_s"]), err_pct, busy,
                      "kept" if c["chosen"] else "")
    return table


def _p(latency: LatencySummary | None, key: str) -> float | None:
    return getattr(latency, key) if latency is not None else None


def run_models_table(record: TrialSummary) -> Table:
    """A runtime run per model: throughput, latency percentiles and the bound."""
    table = Table(title="Models")
    for col in ("model", "completed", "failed", "samples/s", "p50 ms", "p99 ms",
                "queue p99", "batch-wait p99", "compute p99", "batch sizes"):
        table.add_column(col, justify="left" if col in ("model", "batch sizes") else "right")
    for m in record.models.values():
        ph = m.phases
        hist = " ".join(f"{k}×{v}" for k, v in m.batch_histogram.items())
        table.add_row(m.model, str(m.completed), str(m.failed),
                      num(m.items_per_s) + (f" ({num(m.tokens_per_s)} tok/s)"
                                            if m.tokens_per_s else ""),
                      num(_p(m.latency, "p50_ms"), 2), num(_p(m.latency, "p99_ms"), 2),
                      num(_p(ph.queueing, "p99_ms"), 2), num(_p(ph.batching_wait, "p99_ms"), 2),
                      num(_p(ph.compute, "p99_ms"), 2), hist[:40])
    return table


def workers_table(record: TrialSummary) -> Table:
    """A runtime run per worker: unit, batches, busy share and status."""
    table = Table(title="Workers")
    for col in ("worker", "unit", "status", "batches", "items", "share", "utilisation",
                "batch sizes"):
        table.add_column(col)
    for w in record.workers.values():
        hist = " ".join(f"{k}×{v}" for k, v in w.batch_histogram.items())
        status = w.status if not w.error else f"{w.status}: {w.error[:50]}"
        table.add_row(w.worker, w.unit, status, str(w.batches), str(w.items),
                      f"{w.share:.1%}", num((w.utilisation or 0) * 100, 0) + "%", hist[:40])
    return table


def stages_table(record: TrialSummary) -> Table | None:
    """A pipeline's stages (none when the run has no pipeline)."""
    pipelines = record.pipelines or {}
    if not pipelines:
        return None
    table = Table(title="Pipeline stages")
    for col in ("model", "#", "segment", "units", "engine", "busy", "mean batch",
                "compute ms/batch", "transfer ms/batch", "queue depth"):
        table.add_column(col)
    for model, stages in pipelines.items():
        for st in stages:
            table.add_row(model, str(st["stage"]), st["segment"], "+".join(st["units"]),
                          st["engine"], f"{st['busy']:.0%}", num(st["mean_batch"]),
                          num(st["compute_ms_per_batch"], 2), num(st["transfer_ms_per_batch"], 2),
                          num(st["queue_depth"]))
    return table


def run_headline(record: TrialSummary) -> str:
    """One line that says what a runtime run reached."""
    lat = record.latency
    parts = [f"[bold]{record.scenario}[/]",
             "[green]valid[/]" if record.valid else "[red]INVALID[/]",
             f"{num(record.items_per_s)} samples/s"
             + (f" ({num(record.tokens_per_s)} tok/s)" if record.tokens_per_s else ""),
             f"{record.completed} queries in {record.duration_s:.2f}s",
             f"p50 {num(_p(lat, 'p50_ms'), 2)} / p90 {num(_p(lat, 'p90_ms'), 2)} / "
             f"p99 {num(_p(lat, 'p99_ms'), 2)} ms"]
    if record.rate_qps:
        parts.append(f"at {record.rate_qps:.1f} qps")
    text = " · ".join(parts)
    if record.validity_notes:
        text += "\n[dim]" + "; ".join(record.validity_notes) + "[/]"
    note = record.server.load_generator_note if record.server is not None else None
    if note:
        text += "\n[yellow]note[/]: " + escape(note)
    return text


def timeline_text(record: TrialSummary) -> str:
    """Which unit served which model over time, when any unit served more than one model."""
    rows = record.timeline.rows
    per_unit: dict[str, set[str]] = {}
    for r in rows:
        per_unit.setdefault(r.unit, set()).add(r.model)
    if not rows or all(len(models) <= 1 for models in per_unit.values()):
        return ""
    units = sorted(per_unit)
    lines = ["timeline (items served per unit and model, by completion time):"]
    for t in sorted({r.t_s for r in rows}):
        cells = []
        for unit in units:
            served = {r.model: r.items for r in rows if r.t_s == t and r.unit == unit}
            text = ", ".join(f"{m} {n}" for m, n in sorted(served.items())) or "idle"
            cells.append(f"{unit}: {text}")
        lines.append(f"  {t:6.2f}s  " + " | ".join(cells))
    return "\n".join(lines)


_BAR = {"fetch": "[red]█[/]", "h2d": "[yellow]█[/]", "forward": "[green]█[/]",
        "backward": "[blue]█[/]", "optimizer": "[magenta]█[/]"}
_BAR_WIDTH = 30


def phase_table(passes: list[dict[str, Any]]) -> Table:
    """Where the time goes: per pass, ms per minibatch by phase, as numbers and a stacked bar."""
    table = Table(title="Where the time goes, per minibatch (█ fetch stall, h2d, forward, "
                        "backward, optimizer)")
    for col, justify in (("configuration", "left"), ("pass", "left"), ("ms/minibatch", "right"),
                         ("fetch", "right"), ("h2d", "right"), ("fwd", "right"),
                         ("bwd", "right"), ("opt", "right"), ("", "left"),
                         ("items/s", "right"), ("J/item", "right"), ("CPU s", "right"),
                         ("note", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    slowest = max((p["wall_s"] / max(1, p["steps"]) for p in passes if p.get("steps")),
                  default=1.0)
    for p in passes:
        if p["status"] != "ok":
            table.add_row(escape(p["label"]), p["pass"], "", "", "", "", "", "", "", "", "", "",
                          f"[red]{p['status'].upper()}[/]: {escape(p.get('error') or '')}")
            continue
        steps = max(1, p["steps"])
        phases = p["phases_s"]
        per = {k: phases[k] / steps * 1e3 for k in ("fetch", "h2d", "forward", "backward",
                                                    "optimizer")}
        total = p["wall_s"] / steps * 1e3
        bar = "".join(_BAR[k] * round(per[k] / (slowest * 1e3) * _BAR_WIDTH) for k in per)
        energy = p["energy_j"] / p["items"] if p.get("energy_j") and p["items"] else None
        note = "; ".join(p.get("flags") or [])
        if p["energy_source"].startswith("modelled"):
            note = ("J modelled" + ("; " + note if note else ""))
        table.add_row(escape(p["label"]), p["pass"], num(total), num(per["fetch"]),
                      num(per["h2d"]), num(per["forward"]), num(per["backward"]),
                      num(per["optimizer"]), bar, num(p.get("items_per_s"), 0),
                      num(energy, 4), num(p.get("cpu_s"), 1), escape(note))
    return table


def predict_table(data: dict[str, Any]) -> Table:
    """Predicted against measured epoch time and energy per configuration."""
    table = Table(title="Predicted epochs (95% bounds) and, where validated, measured")
    for col, justify in (("configuration", "left"), ("how", "left"), ("first epoch s", "right"),
                         ("later epoch s", "right"), ("later epoch J", "right"),
                         ("measured first s", "right"), ("measured later s", "right"),
                         ("error", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    rows: dict[int, dict[str, dict[str, Any]]] = {}
    for r in data["predictions"]:
        rows.setdefault(r["config"], {})[r["epoch"]] = r
    for cfg in sorted(rows):
        first, later = rows[cfg]["first"], rows[cfg]["later"]

        def span(r: dict[str, Any]) -> str:
            return f"{num(r['predicted_s'])} [{num(r['low_s'])}–{num(r['high_s'])}]"

        errors = [f"{(r['predicted_s'] - r['measured_s']) / r['measured_s']:+.0%}"
                  for r in (first, later) if r.get("measured_s")]
        how = first["method"] + (" (extrapolated)" if first.get("extrapolated") else "")
        table.add_row(escape(first["label"]), how, span(first), span(later),
                      num(later.get("predicted_energy_j"), 1), num(first.get("measured_s")),
                      num(later.get("measured_s")), " / ".join(errors))
    return table


def _how(t: dict[str, Any]) -> str:
    """How a trial was measured, with its build time when the build was a large part of it."""
    build = t.get("build_s")
    compiled = any((c.get("options") or {}).get("compile") for c in t.get("configs", []))
    if build is not None and (compiled or build >= 5.0):
        return f"{t['method']}; built in {build:.1f}s"
    return str(t["method"])


def _failed(status: str | None, error: str | None) -> str:
    return f"[bold red]{(status or 'error').upper()}[/]: {escape(error or 'no measurement')}"


def pipelines_table(data: dict[str, Any]) -> Table:
    """Pipeline candidates, predicted and measured through the runtime, against the replicas."""
    replica = data.get("replica_items_per_s")
    table = Table(title="Pipelines beside the replica plans (runtime trials)")
    for col, justify in (("pipeline", "left"), ("predicted/s", "right"), ("measured/s", "right"),
                         ("× replica plan", "right"), ("batch p99 ms", "right"),
                         ("stage busy", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for p in data["pipelines"]:
        measured = p["items_per_s"]
        ratio = f"{measured / replica:.2f}×" if measured and replica else "–"
        busy = " ".join(f"{s['busy']:.0%}" for s in p.get("stage_figures") or [])
        figure = num(measured) if p["status"] == "ok" else _failed(p["status"], p["error"])
        table.add_row(escape(p["plan"]), num(p["predicted_items_per_s"]), figure, ratio,
                      num(p["p99_ms"], 2), busy)
    table.caption = f"best replica plan through the runtime: {num(replica)} items/s"
    return table


def explain_table(data: dict[str, Any]) -> Table:
    """Each unit's best solo figure, the combinations' (or why they failed) and contention."""
    table = Table(title="Why this plan")
    for col in ("what", "plan", "items/s", "batch p99 ms", "J/item", "how measured"):
        table.add_column(col, justify="right" if col in ("items/s", "batch p99 ms", "J/item")
                         else "left")
    for key, t in data["solo_best"].items():
        table.add_row(f"best alone on {key.split('@', 1)[1]}", t["plan"], num(t["items_per_s"]),
                      num(t["p99_ms"], 2), num(t["energy_per_item_j"], 4), _how(t))
    for c in data["contention"]:
        if c.get("status", "ok") != "ok":
            table.add_row("combination", c["plan"], "–", "", "",
                          _failed(c.get("status"), c.get("error")))
        elif c["unit"] == "all":
            table.add_row("combination", c["plan"], num(c["measured_items_per_s"]), "", "",
                          f"runtime; {num(c['summed_solo_items_per_s'])} if solo figures "
                          f"added up ({num(c['factor'], 2)}×)")
        else:
            table.add_row(f"  {c['unit']} beside {', '.join(c['with'])}", "",
                          num(c["inside_items_per_s"]), "", "",
                          f"contention factor {num(c['factor'], 2)} (alone "
                          f"{num(c['alone_items_per_s'])})")
    best, verified = data["best"], data["verified"]
    if best is not None:
        table.add_row("[bold]chosen[/]", best["plan"], num(best["items_per_s"]),
                      num(best["p99_ms"], 2), num(best["energy_per_item_j"], 4), _how(best))
    if verified is not None and verified is not best and verified != best:
        table.add_row("  as `infermux run` runs it", verified["plan"],
                      num(verified["items_per_s"]), num(verified["p99_ms"], 2),
                      num(verified["energy_per_item_j"], 4), _how(verified))
    return table


def pareto_table(front: list[dict[str, Any]]) -> Table:
    """The tuner's Pareto front: throughput against p99 latency."""
    table = Table(title="Pareto front (throughput ↑, batch p99 ↓, energy per item ↓)")
    for col in ("plan", "items/s", "batch p99 ms", "J/item", "how measured"):
        table.add_column(col, justify="left" if col in ("plan", "how measured") else "right")
    for t in front[:12]:
        table.add_row(t["plan"], num(t["items_per_s"]), num(t["p99_ms"], 2),
                      num(t["energy_per_item_j"], 4), t["method"])
    return table


def study_points_table(name: str, points: list[dict[str, Any]]) -> Table:
    """A study's points: variant, batch, instances, scenario, status and figures."""
    table = Table(title=f"study {name}: every point")
    for col in ("#", "point", "batch", "inst", "scenario", "status", "items/s", "p99 ms",
                "run", "note"):
        table.add_column(col)
    for p in points:
        f = p["figures"] or {}
        table.add_row(str(p["point"]), p["variant"], num(p["params"].get("batch")),
                      num(p["params"].get("instances")),
                      str(p["params"].get("scenario") or "offline"), p["status"],
                      num(f.get("items_per_s")), num(f.get("p99_ms"), 2),
                      num(p.get("sub_run_id")), (p.get("error") or "")[:60])
    return table


def size_text(size_bytes: int | None) -> str:
    """Bytes in decimal units, as sizes are typed (`--max-size 2GB`): `512 B`, `1.2 GB`."""
    if size_bytes is None:
        return "–"
    value = float(size_bytes)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def age_text(then_s: float | None, now_s: float) -> str:
    """How long ago an epoch time was, in its largest unit: `40 s`, `3 h`, `12 d`."""
    if then_s is None:
        return "–"
    ago = max(0.0, now_s - then_s)
    for unit, span in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if ago >= span:
            return f"{ago / span:.0f} {unit} ago"
    return f"{ago:.0f} s ago"


def cache_table(summary: CacheSummary) -> Table:
    """The cache per kind: entries, files, size, least and most recent use, what it holds."""
    table = Table(title=f"cache {escape(str(summary.root))}: {size_text(summary.size_bytes)} "
                        f"in {len(summary.entries)} entries")
    for col in ("kind", "entries", "files", "size", "oldest use", "newest use", "holds"):
        table.add_column(col, justify="right" if col in ("entries", "files", "size") else "left")
    for k in summary.kinds:
        table.add_row(escape(k.kind), str(len(k.entries)), str(k.files), size_text(k.size_bytes),
                      age_text(k.oldest_used_s, summary.scanned_at_s),
                      age_text(k.newest_used_s, summary.scanned_at_s),
                      KINDS.get(k.kind, "[dim]not written by infermux: left alone[/]"))
    return table


def cache_entries_table(summary: CacheSummary, entries: Iterable[CacheEntry]) -> Table:
    """Cache entries, least recently used first: kind, name, size, files, last use."""
    table = Table(title="cache entries, least recently used first")
    for col in ("kind", "entry", "size", "files", "last use"):
        table.add_column(col, justify="right" if col in ("size", "files") else "left")
    for e in entries:
        folder = summary.root / e.kind
        name = str(e.path.relative_to(folder)) if e.path.is_relative_to(folder) else str(e.path)
        name = "(the whole folder)" if name == "." else name
        table.add_row(escape(e.kind), escape(name) + (" [dim](temporary)[/]" if e.temporary else ""),
                      size_text(e.size_bytes), str(e.files),
                      age_text(e.last_used_s, summary.scanned_at_s))
    return table


def prune_line(result: PruneResult) -> str:
    """A prune or a clear in one line: entries and bytes removed, bytes left."""
    verb = "would remove" if result.dry_run else "removed"
    count = len(result.removed)
    if not count:
        return f"nothing to remove under {result.root}; {size_text(result.kept_bytes)} left"
    return (f"{verb} {count} {'entry' if count == 1 else 'entries'} "
            f"({size_text(result.freed_bytes)}) under {result.root}; "
            f"{size_text(result.kept_bytes)} left")


def prune_table(result: PruneResult) -> Table:
    """What a prune or a clear removed (or would remove), per kind."""
    table = Table()
    for col in ("kind", "entries", "size"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    per_kind: dict[str, list[int]] = {}
    for e in result.removed:
        row = per_kind.setdefault(e.kind, [0, 0])
        row[0] += 1
        row[1] += e.size_bytes
    for kind, (count, size) in sorted(per_kind.items()):
        table.add_row(escape(kind), str(count), size_text(size))
    return table
