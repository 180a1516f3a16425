"""`infermux report RUN [RUN...]`: a self-contained HTML report of stored runs."""

from __future__ import annotations

from typing import Annotated

import typer

from infermux.cli._app import DbOpt, JsonOpt, _print_json, _state, app, err, out

__all__ = ["report_command"]


@app.command("report")
def report_command(
    runs: Annotated[list[str], typer.Argument(help="Run ids (3), ranges (3-7), last or last:N; see `infermux results list`.")],
    output: Annotated[str, typer.Option("--output", "-o", help="HTML file to write.")] = "report.html",
    title: Annotated[str | None, typer.Option("--title", help="The report's title.")] = None,
    open_it: Annotated[bool, typer.Option("--open", help="Open the report in the default browser.")] = False,
    db: DbOpt = "infermux.db",
    as_json: JsonOpt = False,
) -> None:
    """Write one self-contained HTML report (plots, tables, telemetry) of stored runs."""
    from infermux.report import write_report

    report = write_report(db, runs, output, title=title, strict=bool(_state["debug"]))
    if as_json:
        _print_json(report.to_dict())
    else:
        kinds = ", ".join(f"{r['id']} ({r['kind']}{'' if r['view'] == r['kind'] else ', generic view'})"
                          for r in report.runs)
        out.print(f"report of run(s) {kinds}: {report.figures} figures, "
                  f"{report.bytes / 2**20:.1f} MiB → {report.path}", highlight=False)
        for note in report.notes:
            err.print(f"note: {note}", markup=False, highlight=False)
    if open_it and report.path:
        import webbrowser
        from pathlib import Path

        if not webbrowser.open(Path(report.path).resolve().as_uri()):
            err.print("no browser could be opened here; open the file yourself", markup=False)


# `infermux study` writes reports too; its commands register with the app here, so the app
# module imports one module of this area.

