"""Assembling a report: the overview (and comparison) of the runs, then one section per run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from infermux.errors import UsageError
from infermux.report.data import RunData, StoreReader, open_reader, parse_run_ids
from infermux.report.figures import bar, figure
from infermux.report.kinds import renderer_for
from infermux.report.kinds.bench import bench_curves
from infermux.report.kinds.common import status_cell, status_note
from infermux.report.kinds.generic import render_generic
from infermux.report.page import Page, Section, fmt

__all__ = ["Report", "build_report", "render_runs", "write_report"]


@dataclass
class Report:
    """A rendered report: the HTML, what it covers, and anything that could not be drawn."""

    html: str
    db: str
    runs: list[dict[str, Any]]
    figures: int
    notes: list[str] = field(default_factory=list)
    path: str | None = None

    @property
    def bytes(self) -> int:
        """Size of the HTML file in bytes."""
        return len(self.html.encode())

    def write(self, path: str | Path) -> Path:
        """Write the HTML file; a folder that does not exist is a usage error."""
        out = Path(path)
        if out.is_dir():
            raise UsageError(f"-o {str(path)!r} is a directory: give a file name, e.g. report.html")
        if not out.parent.exists():
            raise UsageError(f"-o {str(path)!r}: folder {str(out.parent)!r} does not exist")
        try:
            out.write_text(self.html, encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write the report to {str(path)!r}: {exc.strerror}") from exc
        self.path = str(out)
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: where it went, its size and what it covers."""
        return {"path": self.path, "db": self.db, "bytes": self.bytes, "figures": self.figures,
                "runs": self.runs, "notes": self.notes}


def _env_differences(runs: Sequence[RunData]) -> list[tuple[str, list[str]]]:
    """Environment facts that are not the same for every run (library versions, CPU, GPUs)."""

    def facts(run: RunData) -> dict[str, str]:
        env = run.environment
        out = {f"library {k}": str(v) for k, v in (env.get("libraries") or {}).items()}
        out["CPU"] = run.machine
        out["python"] = str(env.get("python"))
        out["host"] = str(env.get("hostname"))
        for g in env.get("gpus") or []:
            out[f"GPU {g.get('index')} driver"] = str(g.get("driver") or g.get("driver_version"))
        return out

    all_facts = [facts(r) for r in runs]
    keys = sorted({k for f in all_facts for k in f})
    return [(k, [f.get(k, "–") for f in all_facts]) for k in keys
            if len({f.get(k, "–") for f in all_facts}) > 1]


def _number(value: float) -> str:
    """A headline figure: whole numbers without decimals."""
    return fmt(int(value)) if float(value).is_integer() else fmt(value)


def _overview(page: Page, runs: Sequence[RunData]) -> None:
    sec = page.section("overview", "Runs in this report" if len(runs) > 1 else "Run")
    headlines: list[tuple[RunData, tuple[str, float, str] | None]] = []
    for run in runs:
        try:
            headlines.append((run, renderer_for(run.kind).headline(run)))
        except Exception:  # noqa: BLE001 - a headline is optional; the run's section says more
            headlines.append((run, None))
    sec.table(["run", "kind", "status", "started", "model", "machine", "headline"],
              ([f"{r.id}", r.kind, status_cell(r.status), r.started_at.replace("T", " ")[:19],
                r.model[:60], r.machine[:60],
                f"{_number(h[1])} {h[2]} — {h[0]}" if h else "–"] for r, h in headlines),
              numeric=("run",))
    if len(runs) < 2:
        return
    by_unit: dict[str, list[tuple[RunData, tuple[str, float, str]]]] = {}
    for run, h in headlines:
        if h is not None:
            by_unit.setdefault(h[2], []).append((run, h))
    for unit, items in by_unit.items():
        if len(items) < 2:
            continue
        labels = [f"run {r.id} ({r.kind})" for r, _ in items]
        sec.figure(figure([bar(labels, [h[1] for _, h in items], unit,
                               hover=[f"{h[0]} — {r.model}" for r, h in items],
                               text=[fmt(h[1]) for _, h in items])],
                          title=f"Headline figure of each run ({unit})", x="run", y=unit,
                          x_category=True, legend_below=False))
    bench = [r for r in runs if r.kind == "bench" and r.results]
    if len(bench) >= 2:
        sec.heading("Benchmarks side by side")
        for fig in bench_curves([(f"run {r.id} · ", r.results) for r in bench],
                                what=f"runs {', '.join(str(r.id) for r in bench)}"):
            sec.figure(fig)
    diffs = _env_differences(runs)
    if diffs:
        sec.heading("What differs between the runs' environments")
        sec.table(["fact", *(f"run {r.id}" for r in runs)], ([k, *v] for k, v in diffs))


def _run_header(sec: Section, run: RunData) -> None:
    env = run.environment
    libs = env.get("libraries") or {}
    sec.kv([("status", run.status), ("started", run.started_at), ("finished", run.finished_at),
            ("command", run.command), ("model", run.model), ("machine", run.machine),
            ("libraries", ", ".join(f"{k} {v}" for k, v in libs.items()))])
    status_note(run, sec)


def render_runs(page: Page, runs: Sequence[RunData], *, strict: bool = False) -> list[str]:
    """The overview and one section per run; returns notes on sections that fell back."""
    notes: list[str] = []
    _overview(page, runs)
    for run in runs:
        sec = page.section(f"run-{run.id}", f"Run {run.id} · {run.kind}"
                           + (f" · {run.model}" if run.model else ""))
        _run_header(sec, run)
        renderer = renderer_for(run.kind)
        mark = len(sec.parts)
        figures = len(page.figures)
        try:
            renderer.render(run, sec)
        except Exception as exc:
            if strict:
                raise
            # A record shape this version does not know must not cost the whole report: the
            # run's view is replaced by its records as tables, and the report says so.
            del sec.parts[mark:]
            del page.figures[figures:]
            text = f"run {run.id} ({run.kind}): its view failed ({type(exc).__name__}: {exc})"
            notes.append(text)
            sec.note(text + "; its stored records are shown as tables instead.", "bad")
            render_generic(run, sec)
        sec.details("configuration", run.config)
        sec.details("environment", run.environment)
        if run.summary:
            sec.details("summary", run.summary)
    return notes


def build_report(db: str | Path, runs: Sequence[str | int], *, title: str | None = None,
                 strict: bool = False) -> Report:
    """A self-contained HTML report of `runs` (ids, `A-B` ranges, `last`, `last:N`) from `db`."""
    with open_reader(db) as reader:
        ids = parse_run_ids([str(r) for r in runs], reader)
        data = [reader.load(i) for i in ids]
        return _build(reader, data, title=title, strict=strict)


def _build(reader: StoreReader, data: Sequence[RunData], *, title: str | None,
           strict: bool) -> Report:
    from infermux import __version__

    if title is None:
        kinds = sorted({r.kind for r in data})
        title = (f"infermux report — run {data[0].id} ({data[0].kind})" if len(data) == 1 else
                 f"infermux report — {len(data)} runs ({', '.join(kinds)})")
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    page = Page(title, subtitle=f"from {reader.path} · made {now} by infermux {__version__}")
    notes = render_runs(page, data, strict=strict)
    html = page.render(footer="Every figure is drawn from the results database alone; "
                              "`infermux results export RUN --json` has the raw samples.")
    return Report(html, str(reader.path), [
        {"id": r.id, "kind": r.kind, "status": r.status, "model": r.model,
         "view": r.kind if renderer_for(r.kind).kind == r.kind else "generic"} for r in data],
        len(page.figures), notes)


def write_report(db: str | Path, runs: Sequence[str | int], out: str | Path, *,
                 title: str | None = None, strict: bool = False) -> Report:
    """Build the report and write it to `out`."""
    report = build_report(db, runs, title=title, strict=strict)
    report.write(out)
    return report

