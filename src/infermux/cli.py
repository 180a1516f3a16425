"""The command line: parses, calls the library, prints. Every command has `--json`.

Errors infermux raises on purpose print as one line on stderr (exit 2 for usage, 1 for
failures); `--debug` shows the traceback instead.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from infermux.errors import InfermuxError, UsageError

__all__ = ["app", "main"]

app = typer.Typer(
    name="infermux",
    help="Get the most inference throughput out of every accelerator a machine has.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
results_app = typer.Typer(help="List, show, compare and export stored runs.",
                          no_args_is_help=True)
app.add_typer(results_app, name="results")

_state: dict[str, Any] = {"debug": False}
#: Columns a table may take off a terminal: enough that no cell is ever folded.
_OFF_TERMINAL_WIDTH = 1000


class _Console(Console):
    """A console whose tables read the same in a pipe, a log file or CI as on a terminal.

    Off a terminal rich assumes 80 columns (or whatever terminal the process's other streams
    are on) and folds wide tables into columns a few characters wide ("onnx / runt / ime").
    There nothing wraps the lines afterwards, so a table gets the width it needs instead; on
    a terminal (and in Jupyter) the terminal's width still applies.
    """

    @property
    def size(self) -> ConsoleDimensions:
        """The terminal's size; off a terminal, as wide as any table needs."""
        dims = Console.size.fget(self)  # type: ignore[attr-defined]
        if self.is_terminal or self.is_jupyter:
            return dims
        return ConsoleDimensions(_OFF_TERMINAL_WIDTH, dims.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


out = _Console()
err = _Console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
DbOpt = Annotated[str, typer.Option("--db", help="Results database (SQLite file).")]


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    _state["debug"] = debug


@app.command()
def version(as_json: JsonOpt = False) -> None:
    """Print infermux's version."""
    from infermux import __version__

    if as_json:
        _print_json({"version": __version__})
    else:
        out.print(f"infermux {__version__}")


@app.command()
def units(
    select: Annotated[str | None, typer.Argument(help="Glob or list, e.g. 'cuda:*/fp16'.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List this machine's execution units (CPU, GPUs per numeric mode, DLAs, OpenVINO)."""
    from infermux.render import units_table
    from infermux.units import discover, select_units

    found = discover()
    chosen = select_units(select, found) if select else found.units
    if as_json:
        data = found.to_dict()
        data["units"] = [u.to_dict() for u in chosen]
        _print_json(data)
        return
    out.print(units_table(u.to_dict() for u in chosen))
    for name, info in found.runtimes.items():
        if info.get("available"):
            extra = info.get("providers") or info.get("devices") or ""
            out.print(f"[green]{name}[/] {info['version']} {extra}")
    for note in found.notes:
        out.print(f"[dim]{note}[/]")


@app.command()
def models(
    pattern: Annotated[str, typer.Argument(help="Glob over architecture names.")] = "*",
    as_json: JsonOpt = False,
) -> None:
    """List the architecture names infermux can build (torchvision, and timm if installed)."""
    from infermux.models import list_models

    found = list_models(pattern)
    if as_json:
        _print_json(found)
        return
    for source, names in found.items():
        out.print(f"[bold]{source}[/] ({len(names)}): " + ", ".join(names))


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(), console=err, transient=True,
    )


def _run_with_progress(fn: Callable[..., Any], config: Any, *, db: str, no_store: bool,
                       **kwargs: Any) -> Any:
    """Call a library run behind a progress bar, with the results store open for it.

    `fn(config, store=, progress=, command=, **kwargs)`; the store (none with `no_store`) is
    closed after, whatever happens.
    """
    from infermux.store import open_store

    store = None if no_store else open_store(db)
    command = "infermux " + shlex.join(sys.argv[1:])
    try:
        with _progress() as progress:
            task = progress.add_task("starting", total=1.0)

            def on_progress(label: str, fraction: float) -> None:
                progress.update(task, description=label[:80], completed=fraction)

            return fn(config, store=store, progress=on_progress, command=command, **kwargs)
    finally:
        if store is not None:
            store.close()


@app.command()
def bench(
    model: Annotated[str, typer.Option("--model", "-m", help="resnet50, timm:NAME, file.py:fn, x.onnx")],
    units: Annotated[str, typer.Option("--units", "-u", help="Units or globs, comma-separated.")] = "cpu",
    batch: Annotated[str, typer.Option("--batch", "-b", help="Batch sizes, e.g. 1,8,64.")] = "1,8,64",
    engine: Annotated[str, typer.Option("--engine", help="torch, onnxruntime, openvino, tensorrt, a comma list, or auto (every engine usable on each unit, side by side).")] = "torch",
    instances: Annotated[int, typer.Option("--instances", help="Instances per unit.")] = 1,
    data: Annotated[str, typer.Option("--data", help="host: copies timed; device: pre-staged.")] = "host",
    min_duration: Annotated[str, typer.Option("--min-duration", help="e.g. 10s")] = "10s",
    min_queries: Annotated[int, typer.Option("--min-queries", help="Minimum items measured.")] = 1024,
    max_duration: Annotated[str | None, typer.Option("--max-duration", help="Stop a point after this (invalid).")] = None,
    warmup: Annotated[str, typer.Option("--warmup", help="Warm-up per point, excluded.")] = "1s",
    weights: Annotated[str | None, typer.Option("--weights", help="State dict or checkpoint file.")] = None,
    input_shape: Annotated[str | None, typer.Option("--input-shape", help="One item, e.g. 3x224x224.")] = None,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="Engine option KEY=VALUE or ENGINE.KEY=VALUE (repeatable).")] = None,
    db: DbOpt = "infermux.db",
    no_store: Annotated[bool, typer.Option("--no-store", help="Do not write the results database.")] = False,
    telemetry: Annotated[str, typer.Option("--telemetry", help="Sampler period (e.g. 100ms) or off.")] = "100ms",
    as_json: JsonOpt = False,
) -> None:
    """Offline benchmark: throughput and latency per (unit, batch), stored in the database."""
    from infermux._parse import parse_batches, parse_duration_s, parse_shape
    from infermux.bench import BenchConfig, run_bench
    from infermux.models import ModelSpec
    from infermux.render import bench_table
    from infermux.store import open_store

    config = BenchConfig(
        model=ModelSpec(model, weights, parse_shape(input_shape) if input_shape else None),
        units=units,
        batches=parse_batches(batch),
        engine=engine,
        instances=instances,
        data=data,
        min_duration_s=parse_duration_s(min_duration, name="--min-duration"),
        min_queries=min_queries,
        max_duration_s=parse_duration_s(max_duration, name="--max-duration") if max_duration else None,
        warmup_s=parse_duration_s(warmup, name="--warmup"),
        options=parse_options(option or []),
        telemetry_interval_s=None if telemetry.strip().lower() == "off" else _sampler_period_s(telemetry),
    )
    store = None if no_store else open_store(db)
    command = "infermux " + shlex.join(sys.argv[1:])
    with _progress() as progress:
        task = progress.add_task("starting", total=1.0)

        def on_progress(label: str, fraction: float) -> None:
            progress.update(task, description=label, completed=fraction)

        report = run_bench(config, store=store, progress=on_progress, command=command)
    if as_json:
        _print_json(report.to_dict())
    else:
        out.print(bench_table(report.to_dict()["results"],
                              title=f"{report.model.name} — offline benchmark"))
        out.print(f"[dim]model: {report.model.weights_note}[/]")
        if report.run_id is not None:
            out.print(f"[dim]stored as run {report.run_id} in {db}[/]")
    if report.status == "interrupted":
        err.print("interrupted: the points measured so far are kept")
        raise typer.Exit(130)


def _sampler_period_s(text: str) -> float:
    from infermux._parse import parse_duration_s

    period = parse_duration_s(text, name="--telemetry")
    if period <= 0:
        raise UsageError(f"--telemetry {text!r} must be a positive period, e.g. 100ms, or off")
    return period


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """`["cuda_graph=false", "compile=max-autotune"]` → typed dict (YAML scalars)."""
    import yaml

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--option {pair!r} is not KEY=VALUE, e.g. --option cuda_graph=false")
        options[key.strip()] = yaml.safe_load(value) if value.strip() else None
    return options


@results_app.command("list")
def results_list(
    db: DbOpt = "infermux.db",
    limit: Annotated[int, typer.Option("--limit", help="How many runs, newest first.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List stored runs, newest first."""
    from infermux.render import runs_table
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
    from infermux.render import bench_table
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
    from infermux.render import compare_rows, compare_table
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
    from dataclasses import asdict

    from infermux.store import open_store

    fmt = "csv" if as_csv else ("json" if as_json else fmt)
    if fmt not in ("json", "csv"):
        raise UsageError(f"--format {fmt!r} unknown: use json or csv")
    with open_store(db) as store:
        if fmt == "csv":
            sys.stdout.write(store.export_csv(run_ids))
            return
        runs = []
        for run_id in run_ids:
            run = store.run(run_id)
            for result in run["results"]:
                result["raw_samples"] = [asdict(s) for s in store.samples(result["id"])]
            runs.append(run)
    _print_json(runs)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning infermux errors into one line and an exit code."""
    try:
        # Without standalone mode click returns the code of a `typer.Exit` instead of exiting.
        code = app(args=argv, standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except InfermuxError as exc:
        if _state["debug"]:
            raise
        err.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except Exception as exc:
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, click.exceptions.Abort):
            sys.exit(130)
        if _state["debug"]:
            raise
        err.print(f"error: unexpected {type(exc).__name__}: {exc} (run with --debug for the "
                  "traceback)", markup=False, highlight=False, soft_wrap=True)
        sys.exit(1)
from infermux import cli_characterize as _cli_characterize  # noqa: E402,F401
from infermux import cli_monitor as _cli_monitor  # noqa: E402,F401
from infermux import cli_partition as _cli_partition  # noqa: E402,F401
from infermux import cli_report as _cli_report  # noqa: E402,F401
from infermux import cli_run as _cli_run  # noqa: E402,F401
from infermux import cli_serve as _cli_serve  # noqa: E402,F401
from infermux import cli_train as _cli_train  # noqa: E402,F401
from infermux import cli_tune as _cli_tune  # noqa: E402,F401
