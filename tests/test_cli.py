import csv
import io
import json
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, invoke_cli, run_cli


def _one_error_line(proc):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_units_json():
    proc = invoke_cli("units", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["units"][0]["id"] == "cpu"
    assert "onnxruntime" in data["runtimes"]


def test_bench_then_results_commands(tiny_factory, db):
    args = ("bench", "--model", f"{tiny_factory}:build", "--units", "cpu", "--batch", "1,2",
            "--min-duration", "0.2s", "--min-queries", "16", "--warmup", "0s", "--db", str(db))
    first = invoke_cli(*args, "--json")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert [r["batch"] for r in report["results"]] == [1, 2]
    assert all(r["valid"] for r in report["results"])
    second = invoke_cli(*args)  # the table, no JSON
    assert second.returncode == 0 and "offline benchmark" in second.stdout

    runs = json.loads(invoke_cli("results", "list", "--db", str(db), "--json").stdout)
    assert [r["id"] for r in runs] == [2, 1]
    shown = json.loads(invoke_cli("results", "show", "1", "--db", str(db), "--json").stdout)
    assert shown["status"] == "complete" and len(shown["results"]) == 2
    assert shown["command"].startswith("infermux bench")
    compared = json.loads(invoke_cli("results", "compare", "1", "2", "--db", str(db), "--json").stdout)
    assert len(compared) == 2 and all(row["ratio"] > 0 for row in compared)
    exported = invoke_cli("results", "export", "1", "2", "--db", str(db), "--csv")
    rows = list(csv.DictReader(io.StringIO(exported.stdout)))
    assert len(rows) == 4 and rows[0]["unit"] == "cpu"
    raw = json.loads(invoke_cli("results", "export", "1", "--db", str(db), "--json").stdout)
    assert len(raw[0]["results"][0]["raw_samples"]) == raw[0]["results"][0]["samples"]
    missing = invoke_cli("results", "show", "99", "--db", str(db))
    assert missing.returncode == 2 and "run 99 is not in" in _one_error_line(missing)


@pytest.mark.parametrize(("args", "code", "message"), [
    (("bench", "--model", "resnet5"), 2, "unknown model 'resnet5'"),
    (("bench", "--model", "resnet18", "--units", "tpu:0"), 2, "unit 'tpu:0' is not on this machine"),
    (("bench", "--model", "resnet18", "--batch", "0"), 2, "batch size 0 must be at least 1"),
    (("bench", "--model", "resnet18", "--min-duration", "soon"), 2, "--min-duration 'soon'"),
    (("bench", "--model", "resnet18", "--weights", "nowhere.pt"), 2, "weights file 'nowhere.pt'"),
    (("bench", "--model", "resnet18", "--option", "turbo"), 2, "is not KEY=VALUE"),
    (("bench", "--model", "resnet18", "--data", "disk"), 2, "--data 'disk' unknown"),
    (("bench", "--model", "resnet18", "--telemetry", "0s"), 2, "--telemetry '0s' must be a positive"),
    (("results", "show", "1", "--db", "/nonexistent/dir/x.db"), 2, "does not exist"),
])
def test_errors_are_one_line_with_exit_code(args, code, message):
    proc = invoke_cli(*args)
    assert proc.returncode == code
    assert message in _one_error_line(proc)


def test_debug_shows_the_traceback():
    proc = run_cli("--debug", "bench", "--model", "resnet5")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "UsageError" in proc.stderr


def test_corrupt_database_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    proc = invoke_cli("results", "list", "--db", str(bad))
    assert proc.returncode == 2 and "not an infermux results database" in _one_error_line(proc)


def test_ctrl_c_keeps_what_was_measured(tiny_factory, db):
    proc = subprocess.Popen(
        [sys.executable, "-m", "infermux", "bench", "--model", f"{tiny_factory}:build",
         "--batch", "1,2,4,8", "--min-duration", "3s", "--warmup", "0s", "--db", str(db)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.time() + 120
    stored = 0
    while time.time() < deadline and stored < 1:
        time.sleep(0.2)
        if db.exists():
            try:
                with sqlite3.connect(db) as con:
                    stored = con.execute("SELECT COUNT(*) FROM results").fetchone()[0]
            except sqlite3.OperationalError:
                pass
    assert stored >= 1, "the first point never reached the store"
    time.sleep(0.5)  # inside the second point's measurement
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    with sqlite3.connect(db) as con:
        status = con.execute("SELECT status FROM runs").fetchone()[0]
        results = con.execute("SELECT batch, status FROM results ORDER BY id").fetchall()
        samples = con.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
    assert status == "interrupted"
    assert results[0] == (1, "ok")
    assert results[-1][1] == "interrupted" and len(results) < 4
    assert samples > 0


@pytest.mark.parametrize("args, says", [
    (("partition",), "Missing option '--model'"),
    (("no-such-command",), "No such command 'no-such-command'"),
])
def test_a_usage_error_click_finds_is_its_own_message_and_exit_2(args, says) -> None:
    proc = invoke_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "unexpected" not in proc.stderr
    assert "Traceback" not in proc.stderr
