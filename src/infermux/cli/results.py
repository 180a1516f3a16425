"""`infermux results`: list, show, compare and export stored runs."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from infermux.cli._app import DbOpt, JsonOpt, _print_json, app, out
from infermux.errors import UsageError

results_app = typer.Typer(help="List, show, compare and export stored runs.",
                          no_args_is_help=True)
app.add_typer(results_app, name="results")


@results_app.command("list")
def results_list(
    db: DbOpt = "infermux.db",
    limit: Annotated[int, typer.Option("--limit", help="How many runs, newest first.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List stored runs, newest first."""
    from infermux.cli.render import runs_table
    from infermux.store import open_store

    with open_store(db) as store:
        runs = store.runs(limit)
    if as_json:
        _print_json(runs)
    else:
        out.print(runs_table(runs))


@results_app.command("show")
def results_show(
    run_id: Annotated[int, typer.Argument(help="Run id (see `results list`).")],
    db: DbOpt = "infermux.db",
    as_json: JsonOpt = False,
) -> None:
    """Show one run: configuration, environment and every point."""
    from infermux.cli.render import bench_table
    from infermux.store import open_store

    with open_store(db) as store:
        run = store.run(run_id)
    if as_json:
        _print_json(run)
        return
    out.print(f"run {run['id']} ({run['kind']}, {run['status']}) started {run['started_at']}")
    out.print(f"[dim]{run.get('command') or ''}[/]")
    env = run["environment"]
    gpus = ", ".join(g["name"] for g in env.get("gpus", [])) or "no GPU"
    out.print(f"[dim]{env['cpu']['model']} · {gpus} · torch {env['libraries'].get('torch')}[/]")
    out.print(bench_table(run["results"], title=f"run {run['id']}"))


@results_app.command("compare")
def results_compare(
    run_a: Annotated[int, typer.Argument(help="Baseline run id.")],
    run_b: Annotated[int, typer.Argument(help="Run id compared with it.")],
    db: DbOpt = "infermux.db",
    as_json: JsonOpt = False,
) -> None:
    """Compare two runs point by point (ratio = second / first)."""
    from infermux.cli.render import compare_rows, compare_table
    from infermux.store import open_store

    with open_store(db) as store:
        a, b = store.run(run_a), store.run(run_b)
    if as_json:
        _print_json(compare_rows(a, b))
    else:
        out.print(compare_table(a, b))


@results_app.command("export")
def results_export(
    run_ids: Annotated[list[int], typer.Argument(help="Run ids to export.")],
    db: DbOpt = "infermux.db",
    fmt: Annotated[str, typer.Option("--format", help="json or csv.")] = "json",
    as_json: JsonOpt = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="Same as --format csv.")] = False,
) -> None:
    """Export runs with every point (and raw samples in JSON) to stdout."""
    from infermux.store import open_store

    fmt = "csv" if as_csv else ("json" if as_json else fmt)
    if fmt not in ("json", "csv"):
        raise UsageError(f"--format {fmt!r} unknown: use json or csv")
    with open_store(db) as store:
        if fmt == "csv":
            sys.stdout.write(store.export_csv(run_ids))
            return
        runs = store.export_json(run_ids)
    _print_json(runs)
