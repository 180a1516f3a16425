"""The tuner's bench script against brute force, run for real on a tiny space of this CPU."""

import json
import subprocess
import sys

from .conftest import ROOT, TINY


def test_tune_vs_brute_measures_the_space_and_replays_it(tmp_path):
    out = tmp_path / "brute.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tune_vs_brute.py"), "--model", f"{TINY}:tiny_cnn",
         "--units", "cpu", "--engines", "torch", "--batches", "1,4,16", "--max-instances", "1",
         "--trial-duration", "0.2s", "--budget", "15s", "--duration", "0.3s", "--rounds", "1",
         "--seeds", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    table = data["brute_force"]["table"]
    assert len(table) == data["space"]["solo_configs"] == 3
    optimum = max(t["items_per_s"] for t in table if t["status"] == "ok")
    assert data["brute_force"]["optimum"]["items_per_s"] == optimum
    for r in data["replays"]:
        assert 0 < r["fraction_of_optimum"] <= 1.0
        assert r["distinct_measured"] <= len(table)
    assert data["side_by_side"]["tuned"]["median_items_per_s"] > 0
    # The saved table replays elsewhere, measuring nothing, to the same choices.
    again = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tune_vs_brute.py"), "--replay-from", str(out),
         "--seeds", "2"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    for r in data["replays"]:
        assert f"| tuner replay, seed {r['seed']} | {r['chosen']} |" in again.stdout
