"""The runtime end to end on real CPU core sets: real models, real engines, real processes."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
import yaml

from infermux.runtime import parse_plan, run_plan
from infermux.store import Store

from .conftest import TINY, invoke_cli, needs_two_cores, worker_children

MNV3 = {"model": "mobilenet_v3_small", "input_shape": [3, 64, 64]}


def plan(models, *, dispatcher=None, load=None, **kw):
    data = {"name": "test", "models": models, "dispatcher": {"cpu_workers": "thread",
                                                             **(dispatcher or {})},
            "load": {"min_duration_s": 0.5, "min_queries": 20, "sample_pool": 32, **(load or {})}}
    data.update(kw)
    return parse_plan(data)


def tiny(name="tiny", factory="tiny_cnn", **kw):
    return {"name": name, "model": f"{TINY}:{factory}", **kw}


@needs_two_cores
def test_two_models_on_two_core_sets_in_worker_processes(tmp_path):
    p = plan([tiny(replicas=[{"unit": "cpu:0", "batch": 8}]),
              {"name": "mnv3", **MNV3, "replicas": [{"unit": "cpu:1", "batch": 4}]}],
             dispatcher={"cpu_workers": "process", "max_queue_delay_ms": 2},
             load={"scenario": "server", "rate_qps": 60, "min_duration_s": 1.0,
                   "min_queries": 40})
    with Store(tmp_path / "r.db") as store:
        report = run_plan(p, store=store, command="test")
    assert report.status == "complete", report.error
    rec = report.final
    assert rec.valid, rec.validity_notes
    assert rec.failed == 0 and rec.unfinished == 0
    assert {m: v.completed > 5 for m, v in rec.models.items()} == {"tiny": True, "mnv3": True}
    units = {w.unit: w for w in rec.workers.values()}
    assert set(units) == {"cpu:0", "cpu:1"}
    assert set(units["cpu:0"].items_by_model) == {"tiny"}
    assert set(units["cpu:1"].items_by_model) == {"mnv3"}
    assert {w["hosting"] for w in report.build["workers"]} == {"process"}
    db = sqlite3.connect(tmp_path / "r.db")
    kind, status, summary = db.execute("SELECT kind, status, summary_json FROM runs").fetchone()
    assert (kind, status) == ("run", "complete")
    assert json.loads(summary)["valid"] is True
    assert db.execute("SELECT COUNT(*) FROM run_models").fetchone()[0] == 2
    assert db.execute("SELECT COUNT(*) FROM run_workers").fetchone()[0] == 2
    issued = db.execute("SELECT COUNT(*) FROM run_queries WHERE latency_ns > 0").fetchone()[0]
    assert issued == rec.completed
    items = db.execute("SELECT SUM(size) FROM run_batches").fetchone()[0]
    assert items == rec.completed_items
    # the results table of the offline benchmark is untouched
    assert db.execute("SELECT COUNT(*) FROM results").fetchone()[0] == 0


def test_dynamic_batching_forms_batches():
    def run(delay_ms, rate):
        p = plan([tiny(replicas=[{"unit": "cpu:0", "batch": 8}])],
                 dispatcher={"max_queue_delay_ms": delay_ms},
                 load={"scenario": "server", "rate_qps": rate, "min_duration_s": 0.8})
        return run_plan(p).final

    final = run(20.0, 400)
    batched = final.models["tiny"]
    # A batch's own latency (launch to outputs) is part of its compute phase (take to outputs).
    (worker,) = final.workers.values()
    assert worker.batch_latency.p50_ms > 0
    assert worker.batch_latency.max_ms <= batched.phases.compute.max_ms
    hist = {int(k): v for k, v in batched.batch_histogram.items()}
    assert max(hist) >= 4 and batched.mean_batch > 2.0
    assert batched.phases.batching_wait.p50_ms > 0.5
    assert batched.phases.batching_wait.max_ms < 20.0 + 25.0  # the delay, plus noise
    unbatched = run(0.0, 50).models["tiny"]
    assert unbatched.mean_batch < 1.5


@pytest.mark.exclusive
@needs_two_cores
def test_work_stealing_gives_the_faster_unit_more_work():
    def run(policy):
        p = plan([{"name": "m", **MNV3, "replicas": [
            {"unit": "cpu:0", "batch": 8},
            {"unit": "cpu:1", "batch": 1, "batch_buckets": "none"}]}],
            dispatcher={"policy": policy}, load={"scenario": "offline", "min_duration_s": 1.5,
                                                 "min_queries": 50})
        rec = run_plan(p).final
        share = {w.unit: w.share for w in rec.workers.values()}
        return share["cpu:0"], rec.items_per_s

    pull_share, pull_rate = run("pull")
    rr_share, rr_rate = run("round_robin")
    assert pull_share > 0.6, pull_share
    assert 0.4 <= rr_share <= 0.6, rr_share
    assert pull_share > rr_share + 0.1
    assert pull_rate > rr_rate


@pytest.mark.exclusive
@needs_two_cores
def test_slo_aware_dispatch_keeps_p99_under_the_bound_where_round_robin_breaks_it():
    bound_ms = 35.0

    def run(policy, rate_qps, queries):
        # The slow unit always computes 64 items per query (padding): genuinely slower, 70-130 ms
        # a query (quiet or busy 2-core host), far above the bound, against ~3 ms on the fast one.
        p = plan([tiny(factory="wide_cnn", latency_bound_ms=bound_ms, replicas=[
            {"unit": "cpu:0", "batch": 1},
            {"unit": "cpu:1", "batch": 64, "batch_buckets": "none"}])],
            dispatcher={"policy": policy, "max_queue_delay_ms": 0},
            load={"scenario": "server", "rate_qps": rate_qps, "p99_bound_ms": bound_ms,
                  "min_duration_s": queries / rate_qps, "min_queries": queries})
        return run_plan(p).final

    # 300 queries: the p99 stands above three late ones, so one scheduler hiccup of a shared
    # host does not decide it. Round robin saturates the slow unit (its queue drains after the
    # last arrival), so it gets fewer queries: its p99 is far above the bound either way.
    slo = run("pull", 60, 300)
    blind = run("round_robin", 30, 120)
    # What the policy decides: almost nothing goes to the unit that cannot meet the bound,
    # where round robin sends it half.
    shares = {w.unit: w.share for w in slo.workers.values()}
    assert shares["cpu:1"] < 0.1
    blind_shares = {w.unit: w.share for w in blind.workers.values()}
    assert blind_shares["cpu:1"] > 0.4
    assert blind.latency.p99_ms > bound_ms, blind.latency
    assert not blind.valid
    # What it is for: the bound holds. The fast unit's own latency is a few ms, so this fails
    # only if the policy sends queries to the slow unit, or if other processes take the fast
    # unit's core for tens of ms at a time (then the share above still shows the policy).
    # A run whose p99 misses is run once more (one stall of a shared host can decide a p99);
    # a policy that breaks the bound misses in both.
    if slo.latency.p99_ms > bound_ms:
        slo = run("pull", 60, 300)
    assert slo.latency.p50_ms <= bound_ms / 4, slo.latency
    assert slo.latency.p99_ms < blind.latency.p99_ms / 2
    assert slo.latency.p99_ms <= bound_ms, slo.latency
    assert slo.valid


@needs_two_cores
@pytest.mark.parametrize("hosting", ["thread", "process"])
def test_a_failing_worker_loses_no_query(tmp_path, hosting):
    p = plan([tiny(factory="flaky_cnn", replicas=[
        {"unit": "cpu:0", "batch": 4, "batch_buckets": "none"},
        {"unit": "cpu:1", "batch": 4, "batch_buckets": "none"}])],
        dispatcher={"cpu_workers": hosting},
        load={"scenario": "offline", "min_duration_s": 0.5, "min_queries": 400})
    with Store(tmp_path / "r.db") as store:
        report = run_plan(p, store=store)
    assert report.status == "complete"
    rec = report.final
    workers = {w.unit: w for w in rec.workers.values()}
    assert workers["cpu:1"].status == "failed"
    assert "injected kernel failure" in workers["cpu:1"].error
    assert workers["cpu:0"].status == "ok"
    assert rec.issued == rec.completed and rec.failed == 0 and rec.unfinished == 0
    assert rec.retried_items >= 1
    db = sqlite3.connect(tmp_path / "r.db")
    rows = dict(db.execute("SELECT unit, status FROM run_workers").fetchall())
    assert rows == {"cpu:0": "ok", "cpu:1": "failed"}


def test_single_stream_and_multi_stream():
    single = run_plan(plan([tiny(replicas=[{"unit": "cpu:0", "batch": 8}])],
                           load={"scenario": "single-stream", "min_queries": 30,
                                 "min_duration_s": 0.3})).final
    assert single.valid and single.metric == "p90_ms"
    assert single.models["tiny"].batch_histogram == {"1": single.completed}
    multi = run_plan(plan([tiny(replicas=[{"unit": "cpu:0", "batch": 8}])],
                          dispatcher={"max_queue_delay_ms": 5},
                          load={"scenario": "multi-stream", "samples_per_query": 8,
                                "min_queries": 20, "min_duration_s": 0.3})).final
    assert multi.valid and multi.metric == "p99_ms"
    assert multi.completed_items == 8 * multi.completed
    assert "8" in multi.models["tiny"].batch_histogram


def test_server_arrivals_follow_the_requested_rate():
    rec = run_plan(plan([tiny(replicas=[{"unit": "cpu:0", "batch": 8}])],
                        load={"scenario": "server", "rate_qps": 200, "min_duration_s": 2.0,
                              "seed": 7})).final
    assert abs(rec.server.achieved_issue_rate_qps - 200) / 200 < 0.15
    assert rec.valid


@pytest.mark.exclusive  # a rate held within p99 50 ms: timing, so not beside other tests
def test_find_peak_reports_a_fraction_of_offline():
    report = run_plan(plan([tiny(replicas=[{"unit": "cpu:0", "batch": 8}])],
                           dispatcher={"max_queue_delay_ms": 2},
                           load={"scenario": "server", "find_peak": True, "p99_bound_ms": 50,
                                 "min_duration_s": 0.4}))
    peak = report.peak
    # The bisection's seven rates (to 1% of offline), then the edge run again (the last valid
    # and the first invalid), and a search above it where the first invalid one held then.
    assert peak is not None
    counted = [t for t in peak["trials"] if not t.get("disturbed")]  # a stalled host's reruns
    assert not any(t.get("repeat") for t in counted[:7]) and counted[7].get("repeat")
    assert peak["edge_confirmed"] is not None and peak["repeats"]
    assert all("phases" in t and "issue_lag_p99_ms" in t for t in peak["trials"])
    assert peak["offline_items_per_s"] > 0
    assert peak["peak_qps"] is not None
    assert 0 < peak["peak_fraction_of_offline"] <= 1.0
    # The offline trial runs again after the search; the fraction is of the higher figure.
    assert report.trials[0].scenario == "offline" and report.trials[-1].scenario == "offline"
    after = peak["offline_after_items_per_s"]
    assert after > 0 and peak["offline_drift"] == after / peak["offline_items_per_s"] - 1
    assert peak["peak_fraction_of_offline"] == peak["peak_qps"] / max(
        after, peak["offline_items_per_s"])
    assert report.final.scenario == "server" and report.final.valid


@pytest.mark.exclusive
@needs_two_cores
def test_dynamic_placement_follows_a_load_shift():
    shape = [3, 96, 96]
    models = [{"name": n, "model": "mobilenet_v3_small", "input_shape": shape,
               "replicas": [{"unit": u, "batch": 8}]} for n, u in (("a", "cpu:0"), ("b", "cpu:1"))]
    shift_s = 1.5
    p = plan(models, placement="dynamic", dispatcher={"max_queue_delay_ms": 5},
             load={"scenario": "server", "rate_qps": 700, "min_duration_s": 3.0,
                   "min_queries": 100,
                   "mix": [{"at_s": 0, "shares": {"a": 0.95, "b": 0.05}},
                           {"at_s": shift_s, "shares": {"a": 0.05, "b": 0.95}}]})
    rec = run_plan(p).final
    rows = rec.timeline.rows
    early_b_unit_on_a = sum(r.items for r in rows
                            if r.unit == "cpu:1" and r.model == "a" and r.t_s < shift_s)
    late_a_unit_on_b = sum(r.items for r in rows
                           if r.unit == "cpu:0" and r.model == "b" and r.t_s >= shift_s)
    assert early_b_unit_on_a > 0 and late_a_unit_on_b > 0, rows
    assert any(e["event"] == "serve" for e in rec.events)
    assert rec.failed == 0


def test_cli_run_json_and_stored_run(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({
        "models": [tiny(replicas=[{"unit": "cpu:0", "batch": 4}])],
        "dispatcher": {"cpu_workers": "thread"},
        "load": {"scenario": "offline", "min_duration_s": 0.3, "min_queries": 20}}))
    db = tmp_path / "r.db"
    run = invoke_cli("run", str(path), "--db", str(db), "--scenario", "single-stream",
                     "--duration", "0.3s", "--json")
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["status"] == "complete" and data["result"]["scenario"] == "single-stream"
    assert data["result"]["models"]["tiny"]["completed"] >= 20
    listed = invoke_cli("results", "list", "--db", str(db), "--json")
    assert json.loads(listed.stdout)[0]["kind"] == "run"
    bad = invoke_cli("run", str(path), "--no-store", "--scenario", "server")
    assert bad.returncode == 2 and "load.rate_qps" in bad.stderr


@pytest.mark.exclusive
@needs_two_cores
def test_ctrl_c_ends_the_run_cleanly_with_what_was_measured(tmp_path):
    import psutil

    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({
        "models": [tiny(replicas=[{"unit": "cpu:0", "batch": 4}, {"unit": "cpu:1", "batch": 4}])],
        "dispatcher": {"cpu_workers": "process"},
        "load": {"scenario": "server", "rate_qps": 100, "min_duration_s": 120}}))
    db = tmp_path / "r.db"
    proc = subprocess.Popen([sys.executable, "-m", "infermux", "run", str(path), "--db", str(db)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.time() + 180
    while time.time() < deadline and not any("running the server" in ln for ln in lines):
        time.sleep(0.2)
    children = worker_children(proc.pid)
    assert len(children) == 2
    time.sleep(1.5)  # serve for a while
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=90)
    reader.join(10)
    stderr = "".join(lines)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    con = sqlite3.connect(db)
    status, summary = con.execute("SELECT status, summary_json FROM runs").fetchone()
    assert status == "interrupted"
    completed = con.execute("SELECT completed FROM run_trials").fetchone()[0]
    assert completed > 0
    assert json.loads(summary)["completed"] == completed
    time.sleep(1)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert os.path.exists(db)
