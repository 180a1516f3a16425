"""Reports opened in headless Chromium (Debian's `chromium`): every figure draws (its SVG has
marks), nothing logs an error, and a 20-run comparison stays under 10 MB and opens in under 5 s.
Skipped, with the reason, where Chromium is not installed (`make test` installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from infermux.report import write_report
from infermux.store import Store

from .test_report import MODEL, _bench, report_runs  # noqa: F401 - the shared fixture

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser",
                                                        "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed: apt-get install chromium "
                             "(make test installs it where apt-get exists)")


def _copy_run(store: Store, run_id: int) -> int:
    """A new run in the store holding a copy of bench run `run_id`'s rows; its id."""
    con = store.connection

    def copy(table: str, where: str, arg: int, **fixed: int | None) -> list[tuple[int, int]]:
        """Rows of `table` matching `where = arg`, inserted again with `fixed` values: (old
        id, new id) pairs (ids are 0 for a table without an id)."""
        cols = [r[1] for r in con.execute(f"PRAGMA table_info({table})")]
        pairs = []
        for row in con.execute(f"SELECT * FROM {table} WHERE {where} = ?", (arg,)).fetchall():
            values = dict(zip(cols, row, strict=True))
            old = values.pop("id", 0)
            values.update(fixed)
            cur = con.execute(f"INSERT INTO {table} ({', '.join(values)}) VALUES "
                              f"({', '.join('?' * len(values))})", tuple(values.values()))
            pairs.append((old, cur.lastrowid or 0))
        return pairs

    [(_, new_run)] = copy("runs", "id", run_id)
    for old, new in copy("results", "run_id", run_id, run_id=new_run):
        copy("samples", "result_id", old, result_id=new)
        copy("telemetry", "result_id", old, run_id=new_run, result_id=new)
    con.commit()
    return new_run


def open_in_chromium(path: Path, tmp: Path) -> tuple[dict[str, str], list[str], str, float]:
    """Load `path` headless; (body data attributes, console lines, DOM, seconds it took)."""
    assert CHROMIUM is not None
    started = time.monotonic()
    r = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", f"--user-data-dir={tmp / 'chromium-profile'}",
         "--enable-logging=stderr", "--v=0", "--virtual-time-budget=20000",
         "--window-size=1280,2000", "--dump-dom", path.resolve().as_uri()],
        capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - started
    assert r.returncode == 0, r.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", r.stdout)
    assert body is not None, r.stdout[:500]
    attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body.group(1)))
    console = [line for line in r.stderr.splitlines() if ":CONSOLE" in line]
    return attrs, console, r.stdout, wall


def assert_drew(attrs: dict[str, str], console: list[str], dom: str) -> None:
    assert attrs.get("errors") == "0", (attrs, console)
    assert int(attrs["figures"]) > 0 and attrs["drawn"] == attrs["figures"], attrs
    marks = re.findall(r'id="(fig-\d+)"[^>]*data-marks="(\d+)"', dom)
    assert len(marks) == int(attrs["figures"])
    empty = [fig for fig, n in marks if int(n) == 0]
    assert not empty, f"figures drew no marks: {empty}"
    assert dom.count('class="main-svg"') >= int(attrs["figures"])
    bad = [line for line in console if re.search(r"Uncaught|Error|error", line)]
    assert not bad, bad


def test_every_kind_renders_in_chromium(report_runs, tmp_path):  # noqa: F811
    ids = report_runs["ids"]
    out = tmp_path / "every-kind.html"
    write_report(report_runs["db"], [ids[k] for k in ("bench", "failures", "interrupted", "tune",
                                                       "partition", "run", "serve")], out)
    attrs, console, dom, _ = open_in_chromium(out, tmp_path)
    assert_drew(attrs, console, dom)


def test_a_twenty_run_comparison_is_small_and_opens_fast(report_runs, tmp_path):  # noqa: F811
    ids = dict(report_runs["ids"])
    chosen = [ids[k] for k in ("bench", "failures", "interrupted", "tune", "partition", "run",
                               "serve")]
    with Store(report_runs["db"]) as store:
        measured = _bench(store, MODEL, [1, 4], telemetry=0.05, agreement=False)
        chosen.append(measured)
        while len(chosen) < 20:  # what is drawn, not what is measured, is the subject here
            chosen.append(_copy_run(store, measured))
    out = tmp_path / "twenty.html"
    report = write_report(report_runs["db"], chosen, out)
    assert len(report.runs) == 20
    assert out.stat().st_size < 10 * 2**20, f"{out.stat().st_size / 2**20:.1f} MiB"
    attrs, console, dom, wall = open_in_chromium(out, tmp_path)
    assert_drew(attrs, console, dom)
    # From navigation start until the first screen is drawn, in the page's own clock; the
    # rest draws after it, one figure at a time.
    assert int(attrs["open-ms"]) < 5000, (attrs, wall)
    assert int(attrs["all-ms"]) < 20000, (attrs, wall)
