"""The asyncio event loop the server's processes run: uvloop where installed, else asyncio's.

Every server process (the runtime process with its front hub, each front process) is an
asyncio loop of callbacks: the gRPC server's call events, HTTP reads and writes, the frames
between the fronts and the runtime process, the answers the workers hand over with
`call_soon_threadsafe`. uvloop (libuv, the loop uvicorn itself picks when installed) runs those
callbacks with less interpreter work each than asyncio's own loop: a gRPC front's CPU per
request fell from 535 to 474 µs on an H200 host (docs/benchmarks.md). It is a dependency of the
`serve` extra on Linux and macOS; `--loop asyncio` keeps the standard loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from infermux.errors import UsageError

__all__ = ["LOOPS", "loop_factory", "loop_name", "run"]

#: The `--loop` choices: `auto` is uvloop where it imports, else asyncio's own loop.
LOOPS = ("auto", "asyncio", "uvloop")

T = TypeVar("T")


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A factory of the loop `name` names (None: asyncio's own)."""
    if name not in LOOPS:
        raise UsageError(f"--loop {name!r} is not an event loop: use {', '.join(LOOPS)}")
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise UsageError("--loop uvloop: uvloop is not installed (pip install uvloop), or "
                             "use --loop asyncio") from None
        return None
    return uvloop.new_event_loop


def loop_name(name: str) -> str:
    """The loop `name` resolves to here: `uvloop` or `asyncio`."""
    return "asyncio" if loop_factory(name) is None else "uvloop"


def run(main: Coroutine[Any, Any, T], name: str) -> T:
    """`asyncio.run(main)` on the loop `name` names."""
    if loop_factory(name) is None:
        return asyncio.run(main)
    import uvloop

    return uvloop.run(main)
