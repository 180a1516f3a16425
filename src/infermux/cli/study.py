"""`infermux study NAME`: a seed study on this machine, stored as runs, with its HTML report."""

from __future__ import annotations

from typing import Annotated

import typer

from infermux.cli._app import DbOpt, JsonOpt, _print_json, _run_with_progress, _state, app, err, out
from infermux.cli.render import study_points_table

__all__ = ["study_command"]


@app.command("study")
def study_command(
    name: Annotated[str, typer.Argument(help="multi-instance, multi-tenancy or pipeline.")],
    model: Annotated[list[str] | None, typer.Option("--model", "-m", help="Model; repeat for several (default: multi-instance resnet50, mobilenet_v3_small on CPU units only; multi-tenancy mobilenet_v3_small, resnet18; pipeline resnet50, mobilenet_v3_small, resnet18, mobilenet_v3_small on CPU units only).")] = None,
    units: Annotated[str, typer.Option("--units", "-u", help="Units or globs, comma-separated, or auto.")] = "auto",
    budget: Annotated[str, typer.Option("--budget", help="Wall-time budget, e.g. 10m; points that would not fit are skipped.")] = "10m",
    batch: Annotated[str | None, typer.Option("--batch", "-b", help="Batch sizes (default: multi-instance 1,8,64; multi-tenancy 1,8; pipeline 8).")] = None,
    instances: Annotated[str | None, typer.Option("--instances", help="Instances per unit, e.g. 1,2 (multi-instance).")] = None,
    engine: Annotated[str, typer.Option("--engine", help="Engine for every unit, or auto (torch where it runs).")] = "auto",
    duration: Annotated[str, typer.Option("--duration", help="Least measured time per point.")] = "2s",
    min_queries: Annotated[int, typer.Option("--min-queries", help="Least samples per point.")] = 64,
    p99: Annotated[str, typer.Option("--p99", help="Server load: the p99 bound of the peak search, e.g. 100ms (a bare number is ms), or auto: 100 ms, or 3x the slowest model's batch p99 alone where longer, at most 1 s.")] = "auto",
    input_shape: Annotated[str | None, typer.Option("--input-shape", help="One item, e.g. 3x224x224.")] = None,
    cpu_workers: Annotated[str, typer.Option("--cpu-workers", help="CPU workers as pinned processes (process, the runtime's default), threads (thread: quicker to start), or auto: processes beside a GPU, threads on a CPU-only host.")] = "auto",
    output: Annotated[str | None, typer.Option("--output", "-o", help="Report file (default study-NAME.html).")] = None,
    no_report: Annotated[bool, typer.Option("--no-report", help="Do not write the HTML report.")] = False,
    db: DbOpt = "infermux.db",
    as_json: JsonOpt = False,
) -> None:
    """Run a seed study (runs stored) and write its report beside the paper's figures."""
    from infermux._parse import parse_batches, parse_duration_s, parse_latency_ms, parse_shape
    from infermux.errors import InfermuxError, UsageError
    from infermux.study import STUDIES, StudyConfig, list_studies, prepare_study, run_study

    if name not in STUDIES:
        raise UsageError(f"study {name!r} unknown: use {', '.join(list_studies())}")
    defaults = STUDIES[name]
    config = StudyConfig(
        name=name, models=list(model or []), units=units,
        batches=parse_batches(batch) if batch else list(defaults["batches"]),
        instances=parse_batches(instances) if instances else list(defaults["instances"]),
        engine=engine, budget_s=parse_duration_s(budget, name="--budget"),
        duration_s=parse_duration_s(duration, name="--duration"), min_queries=min_queries,
        p99_ms=None if p99 == "auto" else parse_latency_ms(p99), input_shape=parse_shape(input_shape) if input_shape else None,
        cpu_workers=cpu_workers)
    # The report's one optional package is checked before anything is measured: asked for by
    # name (-o) it must be there; the default report is skipped with a line instead.
    skip_report = None if no_report else _no_plotly()
    if skip_report and output:
        raise UsageError(f"-o {output}: {skip_report}, or pass --no-report (the table is "
                         "printed and stored either way)")
    prepared = prepare_study(config)
    lines = prepared.header() + ([f"report skipped: {skip_report}"] if skip_report else [])
    for line in lines:
        (err if as_json else out).print(line, highlight=False)
    report = _run_with_progress(run_study, config, db=db, no_store=False, prepared=prepared)
    data = report.to_dict()
    failed_report = None
    if not no_report and not skip_report and report.run_id is not None:
        from infermux.report import write_report

        path = output or f"study-{name}.html"
        try:
            written = write_report(db, [report.run_id], path, strict=bool(_state["debug"]))
            data["report"] = written.to_dict()
        except InfermuxError as exc:  # the measured table is printed and stored regardless
            failed_report = str(exc)
    if as_json:
        _print_json(data)
    else:
        for c in report.headline.get("claims") or []:
            out.print(f"{c['verdict']:>20}  {c['claim']}: {c['here']}  [paper: {c['paper']}]",
                      highlight=False)
        out.print(study_points_table(name, report.points))
        for line in report.headline.get("findings") or []:
            out.print(line, highlight=False)
        if report.run_id is not None:
            out.print(f"[dim]stored as run {report.run_id} (kind study) in {db}[/]")
        if "report" in data:
            out.print(f"report → {data['report']['path']}", highlight=False)
    if failed_report:
        err.print(f"report not written: {failed_report}", highlight=False)
    if report.status == "interrupted":
        err.print("interrupted: the points measured so far are kept")
        raise typer.Exit(130)
    if failed_report and output:
        raise typer.Exit(1)


def _no_plotly() -> str | None:
    """Why the HTML report cannot be drawn here (plotly missing), or None."""
    try:
        import plotly.offline  # noqa: F401
    except ImportError:
        return "the report draws with plotly, which is not installed: pip install 'infermux[report]'"
    return None
