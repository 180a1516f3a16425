"""How busy each test keeps the machine: a pytest plugin writing (test, wall s, CPU s) rows.

    PYTHONPATH=bench .venv/bin/pytest -q -p suite_cpu  # rows in suite-cpu.json

CPU seconds are the whole machine's busy time over the test (from /proc/stat, so the worker
and server processes a test starts count too); cores busy = CPU s / wall s. This is the
measurement behind running the suite in two processes (docs/architecture.md, "Keeping the test
suite short"). Linux only; run it on an otherwise quiet machine.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

_ROWS: list[tuple[str, float, float]] = []
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    return sum(values) - values[3] - values[4]  # all but idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    started, busy = time.perf_counter(), _busy_ticks()
    yield
    _ROWS.append((item.nodeid, time.perf_counter() - started,
                  (_busy_ticks() - busy) / _TICKS_PER_S))


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _ROWS:
        return
    path = os.environ.get("SUITE_CPU_OUT", "suite-cpu.json")
    with open(path, "w") as f:
        json.dump([{"test": t, "wall_s": w, "cpu_s": c} for t, w, c in _ROWS], f, indent=1)
    wall = sum(w for _, w, _ in _ROWS)
    cpu = sum(c for _, _, c in _ROWS)
    print(f"\nsuite_cpu: {len(_ROWS)} tests, {wall:.0f} s wall, {cpu:.0f} CPU s, "
          f"{cpu / wall:.2f} cores busy on average; rows in {path}")
