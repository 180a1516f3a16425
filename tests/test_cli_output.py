"""Tables printed to a pipe or a log (CI, `| tee`, a notebook) keep their cells whole.

Off a terminal rich used to assume 80 columns and fold a wide table into columns a few
characters wide ("onnx / runt / ime"). These run real commands with their output captured, as
a pipe sees it, and no COLUMNS in the environment, as in CI.
"""

import json
import os
import subprocess
import sys

from .conftest import ROOT


def run_piped(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.pop("FORCE_COLOR", None)
    env.pop("TTY_COMPATIBLE", None)
    return subprocess.run([sys.executable, "-m", "infermux", *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)


def rows(text: str) -> list[list[str]]:
    """The table's body rows, cells stripped (rich draws them between │ characters)."""
    out = []
    for line in text.splitlines():
        if line.startswith("│"):
            out.append([cell.strip() for cell in line.strip("│").split("│")])
    return out


def test_a_wide_table_in_a_pipe_keeps_every_cell_whole(tiny_factory, db):
    proc = run_piped("bench", "--model", f"{tiny_factory}:build", "--units", "cpu",
                     "--engine", "torch,onnxruntime", "--batch", "1", "--min-duration", "0.1s",
                     "--min-queries", "8", "--warmup", "0s", "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    body = rows(proc.stdout)
    # One line per point: nothing folded onto continuation lines.
    assert [r[:3] for r in body] == [["cpu", "torch", "1"], ["cpu", "onnxruntime", "1"]]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("┃"))
    assert "items/s" in header and "h2d/comp/d2h ms" in header
    assert max(len(line) for line in proc.stdout.splitlines()) > 80
    for row in body:
        float(row[4].replace(",", ""))  # a whole throughput figure, e.g. 2,166 or 266.5
    # --json is unchanged by the width.
    again = run_piped("results", "show", "1", "--db", str(db), "--json")
    assert json.loads(again.stdout)["results"][1]["engine"] == "onnxruntime"
    shown = run_piped("results", "show", "1", "--db", str(db))
    assert [r[:2] for r in rows(shown.stdout)] == [["cpu", "torch"], ["cpu", "onnxruntime"]]


def test_errors_in_a_pipe_stay_on_one_line():
    proc = run_piped("bench", "--model", "resnet18", "--units", "cpu", "--option",
                     "compile=" + "x" * 120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
