"""The app, the consoles, the shared options and the entry point of the command line.

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


def _click_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """The exception types click raises for bad command lines, and for an abort.

    Newer typer releases carry their own copy of click, whose exceptions derive from
    `typer.TyperException` rather than from the `click` package's: both are handled.
    """
    import click

    usage: list[type[BaseException]] = [click.exceptions.ClickException]
    abort: list[type[BaseException]] = [click.exceptions.Abort]
    own = getattr(typer, "TyperException", None)
    if isinstance(own, type) and issubclass(own, BaseException):
        usage.append(own)
    own_abort = getattr(typer, "Abort", None)
    if isinstance(own_abort, type) and issubclass(own_abort, BaseException):
        abort.append(own_abort)
    return tuple(usage), tuple(abort)


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
        usage, abort = _click_errors()
        if isinstance(exc, usage):
            # Click's own message: a usage error prints the usage line and one error line
            # (exit 2), any other click error its one line (exit 1).
            show = getattr(exc, "show", None)
            if callable(show):
                show()
            else:
                err.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
            sys.exit(getattr(exc, "exit_code", 1))
        if isinstance(exc, abort):
            sys.exit(130)
        if _state["debug"]:
            raise
        err.print(f"error: unexpected {type(exc).__name__}: {exc} (run with --debug for the "
                  "traceback)", markup=False, highlight=False, soft_wrap=True)
        sys.exit(1)
