"""The GPU measurement script's logic, run on CPU units with a tiny model (--smoke)."""

import json
import subprocess
import sys

from .conftest import ROOT


def test_runtime_gpu_bench_smoke(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "runtime_gpu.py"), "--smoke",
                          "--duration", "0.15", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((tmp_path / "runtime_gpu.json").read_text())
    parts = {r["part"] for r in data["rows"]}
    assert parts == {"1 vs plain", "2 instances", "3 mixed", "4 peak"}
    assert all(r["value"] is not None for r in data["rows"] if r["part"] != "4 peak")
    assert "| part | configuration |" in run.stdout
