"""Records as types: each is made on a real tiny run, kept in SQLite, read back equal.

Each type's `to_dict()` is the stored JSON and `from_dict()` reads it back; a row as earlier
versions stored it (a faithful dict, keys in their order) still reads, and the JSON written
from the type is the same text the dict gave.
"""

from __future__ import annotations

import json

from infermux.bench import BenchConfig, BenchPoint, run_bench
from infermux.models import ModelSpec
from infermux.store import Store

from .conftest import TINY

MODEL = f"{TINY}:tiny_cnn"

#: A point as the store kept it before points were a type: telemetry on, one sample's worth.
_STORED_POINT = {
    "model": "tiny.build", "unit": "cpu", "engine": "torch", "batch": 4, "instances": 1,
    "data": "host", "status": "ok", "valid": True, "validity_note": "", "items": 400,
    "window_s": 0.31, "items_per_s": 1290.3, "build_s": 0.02, "options": {"threads": 2},
    "error": None, "weights_note": "randomly initialised", "agreement": {"status": "pass"},
    "seq_len": None, "tokens_per_s": None, "p50_ms": 3.0, "p90_ms": 3.2, "p95_ms": 3.3,
    "p99_ms": 3.9, "max_ms": 4.1, "mean_ms": 3.05, "h2d_ms": 0.0, "compute_ms": 3.05,
    "d2h_ms": 0.0, "energy_j": None, "energy_per_item_j": None, "mean_power_w": None,
    "peak_power_w": None, "items_per_s_per_w": None, "energy_source": None,
    "energy_devices": [], "energy_by_device_j": {},
    "utilisation": {"cpu": {"device": "cpu", "util_pct_mean": 51.0}},
    "telemetry_flags": [], "telemetry_ticks": 3, "sampler_cost": {"cpu_pct": 0.4},
}


def test_bench_point_round_trips_through_the_store(tiny_factory, db):
    config = BenchConfig(ModelSpec(f"{tiny_factory}:build"), units="cpu", batches=[2],
                         min_duration_s=0.2, min_queries=20, warmup_s=0.02,
                         telemetry_interval_s=0.05)
    with Store(db) as store:
        report = run_bench(config, store=store)
        rows = store.run(report.run_id)["results"]
    (measured,) = report.measurements
    point = measured.point()
    assert isinstance(point, BenchPoint) and point.valid and point.items >= 20
    assert point.latency is not None and point.p99_ms == point.latency.p99_ms > 0
    assert point.energy is not None and point.energy.telemetry_ticks > 0
    (row,) = rows
    assert row["samples"] == len(measured.samples)
    assert BenchPoint.from_dict(row) == point
    # the `--json` entry is the type's dict
    assert report.to_dict()["results"] == [point.to_dict()]


def test_a_bench_point_stored_as_a_dict_still_reads(db):
    point = BenchPoint.from_dict(_STORED_POINT)
    assert point.p99_ms == 3.9 and point.mean_power_w is None
    assert point.energy is not None and point.energy.utilisation["cpu"]["util_pct_mean"] == 51.0
    # the stored JSON from the type is the text the dict gave, key for key
    assert json.dumps(point.to_dict()) == json.dumps(_STORED_POINT)
    with Store(db) as store:
        run_id = store.begin_run("bench", {}, {})
        store.add_result(run_id, dict(_STORED_POINT), [])
        (row,) = store.run(run_id)["results"]
    # without raw samples the store derives no latency: what it kept is what was written
    assert BenchPoint.from_dict(row) == point
    # a row from before sequence lengths, agreement and telemetry reads with neutral values
    older = {k: v for k, v in _STORED_POINT.items()
             if k in ("model", "unit", "engine", "batch", "instances", "data", "status",
                      "valid", "validity_note", "items", "window_s", "items_per_s", "options",
                      "error")}
    aged = BenchPoint.from_dict(older)
    assert aged.seq_len is None and aged.agreement is None and aged.energy is None
    assert aged.latency is None and aged.build_s == 0.0 and aged.items_per_s == 1290.3


#: A tuner trial as the store kept it before trials kept their build time and raw record.
_STORED_TRIAL = {
    "plan": "cpu torch b4", "configs": [{"unit": "cpu", "engine": "torch", "instances": 1,
                                         "batch": 4, "options": {}, "model": "net"}],
    "method": "engine", "status": "ok", "items_per_s": 812.5, "p99_ms": 5.5,
    "energy_per_item_j": None, "power_w": None, "memory_bytes": None,
    "per_unit": {"cpu": 812.5}, "cost_s": 1.4, "reused": False, "error": None,
}


def _evaluator(store, units, **kw):
    from infermux.tune import TrialSettings
    from infermux.tune.evaluate import LiveEvaluator

    return LiveEvaluator({"net": ModelSpec(MODEL)}, units, TrialSettings(
        min_duration_s=0.2, min_queries=16, warmup_s=0.05), store=store, telemetry=False, **kw)


def test_tune_trial_round_trips_through_the_store(db):
    from infermux.tune.evaluate import Trial
    from infermux.tune.space import Candidate, Config
    from infermux.units import discover, select_units

    units = select_units("cpu", discover())
    candidate = Candidate.of(Config.make("net", units[0].id, "torch", 4))
    with Store(db) as store:
        first = _evaluator(store, units)
        try:
            trial = first.evaluate(candidate)
        finally:
            first.close()
        assert trial.ok and trial.method == "engine" and not trial.reused
        assert trial.record["items_per_s"] == trial.items_per_s
        again = _evaluator(store, units)
        try:
            kept = again.evaluate(candidate)
        finally:
            again.close()
        assert kept.reused and kept.cost_s == 0.0
        assert kept == Trial.from_dict(trial.to_dict(with_record=True) | {
            "cost_s": 0.0, "reused": True}, candidate)
        # the raw record an engine trial keeps is its bench point, read back as the type
        assert BenchPoint.from_dict(kept.record) == BenchPoint.from_dict(trial.record)


def test_a_tune_trial_stored_as_a_dict_still_reads(db):
    from infermux.tune.evaluate import Trial
    from infermux.tune.space import Candidate, Config

    candidate = Candidate.of(Config.make("net", "cpu", "torch", 4))
    with Store(db) as store:
        store.add_tune_trial(None, "f", "k", "cpu torch b4", dict(_STORED_TRIAL), 1.4)
        found = store.tune_trial("f", "k")
    assert found is not None
    trial = Trial.from_dict(found[0], candidate)
    assert trial.ok and trial.items_per_s == 812.5 and trial.per_unit == {"cpu": 812.5}
    assert trial.build_s is None and trial.record == {}
    # the type writes the dict it was read from, plus what trials now keep
    assert trial.to_dict(with_record=True) == _STORED_TRIAL | {"build_s": None, "record": {}}
    current = trial.to_dict(with_record=True) | {"build_s": 0.3, "record": {"valid": True}}
    assert json.dumps(Trial.from_dict(current, candidate).to_dict(with_record=True)) == \
        json.dumps(current)


#: A served run's summary as the store kept it before it was a type: front processes, a trace.
_STORED_SERVE = {
    "models": {"net": {"requests_ok": 12, "requests_failed": 1, "requests_rejected": 2,
                       "items": 30, "batches": 9, "mean_request_ms": 2.5, "mean_batch": 3.33}},
    "ports": {"http": 8000, "grpc": 8001, "metrics": 8002}, "served_s": 4.2, "error": None,
    "run_id": 7, "status": "complete", "requests_dropped": 0,
    "restarts": {"net/cpu:0#0": {"restarts": 1, "failed_restarts": 0, "errors": ["killed"]}},
    "fronts": 2, "front_restarts": 0, "front_pids": [101, 102], "front_slab_items": {"net": 64},
    "trace": {"path": "t.jsonl", "every": 10, "requests": 1, "gaps": {}},
}


_FRONTS = ("fronts", "front_restarts", "front_pids", "front_slab_items")


def test_serve_summary_round_trips_through_the_store(tmp_path):
    import pytest

    pytest.importorskip("tritonclient.http")
    pytest.importorskip("uvicorn")
    import tritonclient.http as thttp

    from infermux.serve import ServeSummary

    from .test_serve import NET, Server, _plan, _x

    net = tmp_path / "net.py"
    net.write_text(NET)
    srv = Server(tmp_path, _plan("records", f"{net}:build"))
    try:
        client = thttp.InferenceServerClient(srv.http)
        for k in range(3):
            x = _x(2, seed=k)
            tensor = thttp.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            client.infer("net", [tensor])
    finally:
        code, out = srv.stop()
    assert code == 0, out
    stopped = json.loads(out[out.index("{"):])
    printed = ServeSummary.from_dict(stopped)
    net_summary = printed.models["net"]
    # six items asked for, and the one the server's start-up probe of the outputs ran
    assert (net_summary.requests_ok, net_summary.requests_failed, net_summary.items) == (3, 0, 7)
    assert printed.status == "complete" and printed.ports["http"] == int(srv.http.split(":")[1])
    with Store(srv.db) as store:
        stored = store.run(printed.run_id)["summary"]
    # the printed line is the stored summary with its event, and both read back as the type
    assert stopped == {"event": "stopped", **stored}
    assert ServeSummary.from_dict(stored) == printed
    assert printed.to_dict() == stored


def test_a_serve_summary_stored_as_a_dict_still_reads():
    from infermux.serve import ServeSummary

    summary = ServeSummary.from_dict(_STORED_SERVE)
    assert summary.models["net"].requests_rejected == 2 and summary.nodes is None
    assert summary.fronts is not None and summary.fronts["front_pids"] == [101, 102]
    assert json.dumps(summary.to_dict()) == json.dumps(_STORED_SERVE)
    # from before admission limits: no rejections counted
    old = {"models": {"net": {k: v for k, v in _STORED_SERVE["models"]["net"].items()
                              if k != "requests_rejected"}}, "ports": {}, "served_s": 1.0,
           "error": None, "run_id": None, "status": "complete"}
    aged = ServeSummary.from_dict(old)
    assert aged.models["net"].requests_rejected == 0 and aged.requests_dropped == 0
    assert aged.fronts is None and aged.trace is None and aged.restarts == {}
    # served by a cluster: a row per node, typed
    clustered = {k: v for k, v in _STORED_SERVE.items() if k not in _FRONTS} | {"nodes": [
        {"node": "a", "address": "10.0.0.1", "status": "ok", "lost_reason": None,
         "completed_items": 40, "failed_items": 0, "rejected_items": 0, "rerouted_items": 2,
         "joined": False},
        {"node": "b", "address": "10.0.0.2", "status": "lost", "lost_reason": "node died",
         "completed_items": 9, "failed_items": 1, "rejected_items": 0, "rerouted_items": 0,
         "joined": True}]}
    served = ServeSummary.from_dict(clustered)
    assert served.fronts is None and served.nodes is not None
    assert [(n.node, n.status, n.joined) for n in served.nodes] == [
        ("a", "ok", False), ("b", "lost", True)]
    assert json.dumps(served.to_dict()) == json.dumps(clustered)


def _runtime_plan(load):
    from infermux.runtime import parse_plan

    return parse_plan({
        "name": "records", "models": [{"name": "tiny", "model": MODEL,
                                       "replicas": [{"unit": "cpu", "batch": 4}]}],
        "dispatcher": {"cpu_workers": "thread", "max_queue_delay_ms": 1},
        "load": {"sample_pool": 16, "min_duration_s": 0.2, "min_queries": 24, **load}})


def test_runtime_trial_round_trips_through_the_store(db):
    from infermux.runtime import run_plan
    from infermux.runtime.trial import TrialSummary

    with Store(db) as store:
        report = run_plan(_runtime_plan({"scenario": "server", "rate_qps": 150}), store=store)
        stored = store.runtime_trials(report.run_id)
        text = store.connection.execute(
            "SELECT record_json FROM run_trials WHERE run_id = ?", (report.run_id,)).fetchone()[0]
    (trial,) = report.trials
    assert isinstance(trial, TrialSummary) and trial is report.final
    assert trial.scenario == "server" and trial.server is not None and trial.rate_qps == 150
    assert trial.completed > 0 and trial.models["tiny"].latency is not None
    assert trial.workers and all(w.ok and w.batch_latency is not None
                                 for w in trial.workers.values())
    assert trial.trial == 0 and trial.settings is not None and trial.timeline.rows
    # the stored row is the type's dict, text for text, and reads back equal
    (row,) = stored
    assert row == trial.to_dict()
    assert text == json.dumps(trial.to_dict())
    back = TrialSummary.from_dict(row)
    assert back == trial
    assert back.to_dict() == row and json.dumps(back.to_dict()) == json.dumps(row)
    # the `--json` output carries the same dict
    assert report.to_dict()["result"] == row and report.to_dict()["trials"] == [row]


def test_a_runtime_trial_stored_before_its_newer_fields_still_reads():
    from infermux.runtime import run_plan
    from infermux.runtime.trial import TrialSummary

    current = run_plan(_runtime_plan({"scenario": "offline"})).final
    assert current is not None and current.server is None and current.metric == "items_per_s"
    now = current.to_dict()
    assert json.dumps(TrialSummary.from_dict(now).to_dict()) == json.dumps(now)
    # as an earlier version stored it: samples, not items; no launch/run phases, no batch
    # latency, no loop counters or settings
    old = {k: v for k, v in now.items() if k not in (
        "completed_items", "items_per_s", "settings", "retried_items", "failed_items",
        "dropped_from_earlier_trial", "trial")}
    old |= {"completed_samples": now["completed_items"],
            "throughput_samples_per_s": now["items_per_s"]}
    old["models"] = {n: {k: v for k, v in m.items() if k not in ("completed_items", "phases")}
                     | {"completed_samples": m["completed_items"],
                        "phases": {k: p for k, p in m["phases"].items()
                                   if k not in ("launch", "run")}}
                     for n, m in now["models"].items()}
    old["workers"] = {n: {k: v for k, v in w.items() if k not in (
        "items", "items_by_model", "batch_latency", "latency_estimate_ms_by_model")}
        | {"samples": w["items"]} for n, w in now["workers"].items()}
    aged = TrialSummary.from_dict(old)
    assert aged.completed_items == current.completed_items > 0
    assert aged.items_per_s == current.items_per_s
    assert aged.models["tiny"].completed_items == current.models["tiny"].completed_items
    assert aged.models["tiny"].phases.launch is None
    assert aged.models["tiny"].phases.queueing == current.models["tiny"].phases.queueing
    (worker,) = aged.workers.values()
    assert worker.items == next(iter(current.workers.values())).items and worker.ok
    assert worker.batch_latency is None and worker.batch_p99_ms is None
    assert aged.trial is None and aged.settings is None and aged.retried_items is None
    # written back, it is the current version's record less what the old row never had
    assert set(aged.to_dict()) == set(now) - {"settings", "retried_items", "failed_items",
                                              "dropped_from_earlier_trial", "trial"}
