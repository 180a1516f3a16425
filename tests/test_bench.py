import json

import numpy as np
import pytest

from infermux.bench import BenchConfig, Measurement, run_bench
from infermux.errors import UsageError
from infermux.models import ModelSpec
from infermux.stats import latency_summary_ms
from infermux.store import Sample, Store

OOM_MODEL = '''
import torch
from torch import nn


class FailsAtBatch4(nn.Module):
    """Runs like a tiny CNN, but a batch of 4 or more exhausts 'device memory'."""

    input_shape = (3, 16, 16)

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        if x.shape[0] >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return self.conv(x).mean((2, 3))


def build():
    return FailsAtBatch4()
'''


def _samples(latencies_ms):
    return [Sample(0, int(ms * 1e6), 0, int(ms * 1e6), 0) for ms in latencies_ms]


def test_statistics_from_known_samples():
    summary = latency_summary_ms([int(ms * 1e6) for ms in range(1, 101)])
    assert summary["p50_ms"] == pytest.approx(50.5)
    assert summary["p90_ms"] == pytest.approx(90.1)
    assert summary["p99_ms"] == pytest.approx(99.01)
    assert summary["max_ms"] == pytest.approx(100.0)
    assert latency_summary_ms([]) == {}


def test_validity_needs_both_duration_and_queries():
    point = Measurement("m", "cpu", "torch", 8, 1, "host", min_duration_s=1.0, min_queries=100)
    point.samples, point.window_s = _samples([10.0] * 20), 2.0  # 160 items in 2 s
    assert point.validity == (True, "")
    assert point.throughput == pytest.approx(80.0)
    point.window_s = 0.5
    assert point.validity[0] is False and "min duration" in point.validity[1]
    point.window_s, point.samples = 2.0, _samples([10.0] * 5)  # 40 items
    valid, note = point.validity
    assert not valid and "40 items < min queries 100" in note
    record = point.point().to_dict()
    assert record["valid"] is False and record["p50_ms"] == pytest.approx(10.0)
    assert record["compute_ms"] == pytest.approx(10.0)


def test_config_rejects_bad_values():
    spec = ModelSpec("resnet18")
    with pytest.raises(UsageError, match="--instances 0"):
        BenchConfig(spec, instances=0)
    with pytest.raises(UsageError, match="--data 'gpu'"):
        BenchConfig(spec, data="gpu")
    with pytest.raises(UsageError, match="shorter than --min-duration"):
        BenchConfig(spec, min_duration_s=5, max_duration_s=1)


def test_run_bench_measures_and_stores(tiny_factory, db):
    config = BenchConfig(ModelSpec(f"{tiny_factory}:build"), units="cpu", batches=[1, 4],
                         min_duration_s=0.3, min_queries=40, warmup_s=0.05)
    seen = []
    with Store(db) as store:
        report = run_bench(config, store=store, progress=lambda label, f: seen.append((label, f)))
        run = store.run(report.run_id)
    assert report.status == "complete" and len(report.measurements) == 2
    for point in report.measurements:
        assert point.validity == (True, "")
        assert point.window_s >= 0.3 and point.items >= 40
        assert point.throughput > 0
    assert run["status"] == "complete"
    assert run["config"]["min_queries"] == 40
    assert run["environment"]["libraries"]["torch"]
    stored = {r["batch"]: r for r in run["results"]}
    for point in report.measurements:
        rec = point.point().to_dict()
        assert stored[point.batch]["samples"] == len(point.samples)
        # statistics shown from the store are derived again from the raw samples
        assert stored[point.batch]["p99_ms"] == pytest.approx(rec["p99_ms"])
        assert "randomly initialised" in stored[point.batch]["weights_note"]
    assert seen[0][1] == 0.0 and seen[-1][1] == 1.0


def test_deadline_marks_point_invalid(tiny_factory):
    config = BenchConfig(ModelSpec(f"{tiny_factory}:build"), batches=[2], min_duration_s=0.1,
                         min_queries=10**9, max_duration_s=0.3, warmup_s=0.0)
    (point,) = run_bench(config).measurements
    assert 0.3 <= point.window_s < 2.0
    valid, note = point.validity
    assert not valid and "< min queries" in note


def test_two_instances_both_contribute(tiny_factory):
    config = BenchConfig(ModelSpec(f"{tiny_factory}:build"), batches=[2], instances=2,
                         min_duration_s=0.3, min_queries=20, warmup_s=0.0)
    (point,) = run_bench(config).measurements
    assert {s.instance for s in point.samples} == {0, 1}
    assert point.point().to_dict()["instances"] == 2


def test_out_of_memory_is_recorded_and_the_sweep_goes_on(tmp_path, db):
    factory = tmp_path / "oom.py"
    factory.write_text(OOM_MODEL)
    config = BenchConfig(ModelSpec(f"{factory}:build"), batches=[2, 4, 1], min_duration_s=0.1,
                         min_queries=4, warmup_s=0.0)
    with Store(db) as store:
        report = run_bench(config, store=store)
        run = store.run(report.run_id)
    statuses = [m.status for m in report.measurements]
    assert statuses == ["ok", "oom", "ok"]
    assert "ran out of memory" in report.measurements[1].error
    assert [r["status"] for r in run["results"]] == statuses
    assert run["summary"] == {"points": 3, "valid": 2}


def test_engine_rejects_unit_it_cannot_run(tiny_factory):
    config = BenchConfig(ModelSpec(f"{tiny_factory}:build"), units="cpu", engine="nope")
    with pytest.raises(UsageError, match="unknown engine"):
        run_bench(config)


def test_samples_round_trip(db):
    with Store(db) as store:
        run_id = store.begin_run("bench", {"model": "m"}, {"cpu": {}})
        samples = [Sample(i % 2, 1000 + i, i, 900 + i, 3) for i in range(50)]
        record = {"model": "m", "unit": "cpu", "engine": "torch", "batch": 1, "instances": 2,
                  "data": "host", "status": "ok", "valid": True, "items": 50, "window_s": 1.0,
                  "items_per_s": 50.0}
        result_id = store.add_result(run_id, record, samples)
        assert store.samples(result_id) == samples
        assert np.isclose(store.run(run_id)["results"][0]["h2d_ms"], np.mean(range(50)) / 1e6)


def test_bench_whose_every_point_failed_exits_1(tmp_path, db):
    from .conftest import invoke_cli

    factory = tmp_path / "oom.py"
    factory.write_text(OOM_MODEL)
    args = ("bench", "--model", f"{factory}:build", "--units", "cpu", "--min-duration", "0.1s",
            "--min-queries", "4", "--warmup", "0s", "--telemetry", "off", "--db", str(db))
    failed = invoke_cli(*args, "--batch", "4,8", "--json")
    assert failed.returncode == 1, failed.stderr
    assert [r["status"] for r in json.loads(failed.stdout)["results"]] == ["oom", "oom"]
    assert "every point failed (2 of 2)" in failed.stderr and "Traceback" not in failed.stderr
    partly = invoke_cli(*args, "--batch", "2,4")
    assert partly.returncode == 0, partly.stderr
