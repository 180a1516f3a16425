"""`infermux run PLAN --cluster`: a bad address, and a local plan run on a local two-node cluster."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.conftest import ROOT, invoke_cli, run_cli

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
pytest.importorskip("ray", reason="the cluster needs Ray: pip install 'infermux[cluster]'")

MODEL = f"{ROOT / 'tests' / 'tiny_models.py'}:tiny_cnn"


def _plan(tmp_path) -> str:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({
        "name": "tiny", "models": [{"name": "cnn", "model": MODEL,
                                    "replicas": [{"unit": f"cpu:{min(os.sched_getaffinity(0))}",
                                                  "batch": 4}]}],
        "dispatcher": {"cpu_workers": "thread"},
        # Enough queries that the router, which sends each piece to the node it expects to
        # finish it first, gives the second node some even when its start-up rate was
        # measured far below the first's on a busy host (32 once went all to one node).
        "load": {"scenario": "offline", "min_duration_s": 1, "min_queries": 256}}))
    return str(path)


def test_a_bad_cluster_address_is_one_line(tmp_path) -> None:
    proc = invoke_cli("run", _plan(tmp_path), "--cluster", "somewhere")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "'somewhere'" in proc.stderr and "local:N" in proc.stderr


def test_a_local_plan_runs_on_every_node_of_a_local_cluster(tmp_path, db) -> None:
    proc = run_cli("run", _plan(tmp_path), "--cluster", "local:2", "--json", "--db", str(db),
                   timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["status"] == "complete"
    nodes = data["result"]["nodes"]
    assert sorted(n["node"] for n in nodes) == ["node-0", "node-1"]
    assert all(n["status"] == "ok" and n["completed_items"] > 0 for n in nodes)
    assert data["result"]["failed"] == 0 and data["result"]["unfinished"] == 0
    assert data["run_id"] is not None
