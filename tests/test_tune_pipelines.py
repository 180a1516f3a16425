"""Pipelines in the tuner: the partitioner's best pipelines measured through the runtime beside
the replica plans, on two CPU core sets, and a pipeline plan kept only when it wins."""

import yaml

from infermux.models import ModelSpec
from infermux.runtime import load_plan
from infermux.tune import TrialSettings, TuneRequest, run_tune
from infermux.tune.pipelines import PipelineTrial

from .conftest import TINY, needs_two_cores


def request(**kw):
    base = {"models": [ModelSpec(f"{TINY}:wide_cnn")], "units": "cpu:0,cpu:1",
            "engines": "torch,onnxruntime", "budget_s": 40.0, "batches": [4, 8],
            "max_instances": 1, "fine_tune": False,
            "trial": TrialSettings(min_duration_s=0.15, min_queries=16, warmup_s=0.1)}
    base.update(kw)
    return TuneRequest(**base)


@needs_two_cores
def test_tune_measures_pipelines_beside_replica_plans(tmp_path):
    out = tmp_path / "tuned.yaml"
    report = run_tune(request(), out_path=out)
    assert report.result.best is not None and report.replica_items_per_s
    assert report.pipelines, report.pipelines_note
    measured = [p for p in report.pipelines if p.status == "ok"]
    assert measured, [(p.status, p.error) for p in report.pipelines]
    for p in measured:
        assert p.items_per_s > 0 and len(p.stages) == len(p.plan.stages) >= 2
        assert {s.engine for s in p.plan.stages} <= {"torch", "onnxruntime"}
    best = max(p.items_per_s for p in measured)
    note = report.pipelines_note or ""
    written = load_plan(out)  # the plan written is runnable either way
    if best > report.replica_items_per_s:
        assert note.startswith("a pipeline wins") and written.models[0].stages
    else:
        assert note.startswith("the replica plan wins") and written.models[0].replicas
    header = out.read_text().splitlines()
    assert any(line.startswith("# pipelines: ") for line in header)
    data = report.to_dict()
    assert data["pipelines"][0]["plan"] and "predicted_items_per_s" in data["pipelines"][0]
    yaml.safe_dump(data)  # JSON-ready all the way down


def test_pipelines_are_skipped_with_a_reason():
    # Only the notes are judged: no runtime check of the chosen plan.
    one_unit = run_tune(request(units="cpu:0", budget_s=10.0, batches=[4], verify=False))
    assert not one_unit.pipelines
    assert "two or more CPU core sets or GPUs" in (one_unit.pipelines_note or "")
    off = run_tune(request(units="cpu:0", budget_s=10.0, batches=[4], pipelines=False,
                           verify=False))
    assert "--no-pipelines" in (off.pipelines_note or "")


def test_a_failed_pipeline_trial_is_reported_not_chosen():
    trial = PipelineTrial(plan=None, predicted_items_per_s=100.0, status="oom", error="out of memory")
    assert not trial.ok and trial.violations(request().constraints) == ["oom: out of memory"]
