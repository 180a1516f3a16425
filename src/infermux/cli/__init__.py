"""The command line: parses, calls the library, prints. Every command has `--json`.

`_app` holds the typer app, the consoles, the shared options and the entry point; each
command group is a module of its own that registers on that app; every table is drawn by
`render`. Errors infermux raises on purpose print as one line on stderr (exit 2 for usage,
1 for failures); `--debug` shows the traceback instead.
"""

from __future__ import annotations

from infermux.cli import (  # noqa: F401  (each module registers its commands)
    bench,
    cache,
    characterize,
    monitor,
    partition,
    quantize,
    report,
    results,
    run,
    serve,
    study,
    train,
    tune,
    units,
)
from infermux.cli._app import app, main

__all__ = ["app", "main"]
