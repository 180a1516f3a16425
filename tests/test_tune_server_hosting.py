"""A server tune measures a CPU plan of lock-releasing engines hosted both ways and keeps the
higher peak: the written plan's `cpu_workers` is the measured winner's."""

import yaml

from infermux.models import ModelSpec
from infermux.runtime import parse_plan
from infermux.tune import Constraints, TrialSettings, TuneRequest, run_tune
from infermux.tune.run import _cpu_workers, _thread_hosted

from .conftest import TINY


def _plan(engine="onnxruntime", unit="cpu", **dispatcher):
    return {"name": "p", "models": [{"name": "m", "model": f"{TINY}:tiny_cnn", "replicas": [
        {"unit": unit, "engine": engine, "instances": 1, "batch": 4}]}],
        "dispatcher": {"max_queue_delay_ms": 2.0, **dispatcher},
        "load": {"scenario": "server", "p99_bound_ms": 50.0, "find_peak": True}}


def test_thread_hosting_is_tried_for_lock_releasing_cpu_engines_only():
    for engine in ("onnxruntime", "openvino", "litert"):
        plan = _plan(engine)
        threaded = _thread_hosted(plan)
        assert threaded is not None and threaded["dispatcher"]["cpu_workers"] == "thread"
        # Nothing else changes, and the original is left as it was.
        assert threaded["models"] == plan["models"] and "cpu_workers" not in plan["dispatcher"]
        assert threaded["dispatcher"]["max_queue_delay_ms"] == 2.0
        parse_plan(threaded)  # what is measured must be a valid plan
        assert (_cpu_workers(plan), _cpu_workers(threaded)) == ("process", "thread")
    # Torch's eager CPU runners hold the lock between kernels: processes only.
    assert _thread_hosted(_plan("torch")) is None
    # Already threads, or no CPU replica: nothing to compare.
    assert _thread_hosted(_plan(cpu_workers="thread")) is None
    gpu = _plan("torch", unit="cuda:0/fp16")
    assert _thread_hosted(gpu) is None and _cpu_workers(gpu) is None
    # One torch CPU replica beside an ONNX Runtime one keeps the whole plan in processes.
    mixed = _plan()
    mixed["models"][0]["replicas"].append({"unit": "cpu:1", "engine": "torch", "instances": 1,
                                           "batch": 4})
    assert _thread_hosted(mixed) is None


def test_server_tune_measures_both_hostings_and_writes_the_higher_peak(tmp_path):
    # The bound is far above tiny_cnn's latency: only the plumbing is judged here (which
    # hosting wins on a shared 2-core host is bench/server_batching.py's question). The small
    # space is searched well within the budget, which leaves the peaks their time.
    req = TuneRequest(models=[ModelSpec(f"{TINY}:tiny_cnn")], units="cpu",
                      engines="onnxruntime", scenario="server",
                      constraints=Constraints(p99_bound_ms=1000.0), budget_s=150.0,
                      batches=[1, 4], max_instances=1, fine_tune=False,
                      trial=TrialSettings(min_duration_s=0.3, min_queries=48, warmup_s=0.1))
    out = tmp_path / "s.yaml"
    report = run_tune(req, out_path=out)
    rows = report.server_peaks
    assert [r["cpu_workers"] for r in rows[:2]] == ["process", "thread"]
    assert rows[0]["plan"] == rows[1]["plan"]
    chosen = next(r for r in rows if r["chosen"])
    assert chosen["peak_qps"] == max(r["peak_qps"] or 0 for r in rows)
    text = out.read_text()
    data = yaml.safe_load(text)
    assert data["dispatcher"].get("cpu_workers", "process") == chosen["cpu_workers"]
    assert "CPU workers as processes" in text and "CPU workers as threads" in text
