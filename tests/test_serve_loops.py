"""The event loop of the server's processes (serve/loops.py): uvloop where installed."""

from __future__ import annotations

import asyncio

import pytest

from infermux.errors import UsageError
from infermux.serve import ServeSettings
from infermux.serve.loops import loop_name, run


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_runs_uvloop_where_installed_and_asyncio_keeps_the_standard_loop() -> None:
    pytest.importorskip("uvloop")
    assert loop_name("auto") == "uvloop"
    assert run(_loop_module(), "auto").startswith("uvloop")
    assert run(_loop_module(), "uvloop").startswith("uvloop")
    assert loop_name("asyncio") == "asyncio"
    assert run(_loop_module(), "asyncio").startswith("asyncio")


def test_a_loop_that_is_not_one_is_refused_before_anything_starts() -> None:
    with pytest.raises(UsageError, match=r"--loop 'tokio' is not an event loop: use auto, "
                                         r"asyncio, uvloop"):
        ServeSettings(loop="tokio")
    with pytest.raises(UsageError, match="--connection-age -1.0s must not be negative"):
        ServeSettings(connection_age_s=-1.0)
