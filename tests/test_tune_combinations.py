"""Plans of several units for real on this machine's CPU: two units serve side by side through
the runtime, a worker whose build runs out of memory leaves the others serving, the tuner
measures and reports a combination, and a tune releases what each trial built."""

import gc

import pytest

from infermux.engines import Engine, Runner
from infermux.models import ModelSpec
from infermux.runtime import parse_plan, run_plan
from infermux.tune import (
    Candidate,
    Config,
    LiveEvaluator,
    TrialSettings,
    TuneRequest,
    run_tune,
)
from infermux.units import discover, select_units

from .conftest import TINY, needs_two_cores

MODEL = f"{TINY}:tiny_cnn"
BOUNDED = "tests/memory_models.py:bounded_cnn"  # runs out of memory above 16 items a batch
SHORT = TrialSettings(min_duration_s=0.2, min_queries=16, warmup_s=0.1)


def plan(replicas, model=MODEL, **dispatcher):
    return parse_plan({
        "name": "two-units", "models": [{"name": "m", "model": model, "replicas": replicas}],
        "dispatcher": {"max_queue_delay_ms": 2.0, **dispatcher},
        "load": {"scenario": "offline", "min_duration_s": 0.5, "min_queries": 32,
                 "sample_pool": 32}})


@needs_two_cores
def test_two_units_of_two_engines_serve_in_one_plan():
    report = run_plan(plan([
        {"unit": "cpu:0", "engine": "torch", "batch": 4},
        {"unit": "cpu:1", "engine": "openvino", "batch": 4}]))
    assert report.status == "complete", report.error
    rec = report.final
    assert rec.valid, rec.validity_notes
    assert rec.failed == 0
    workers = {w.unit: w for w in rec.workers.values()}
    assert set(workers) == {"cpu:0", "cpu:1"}
    for unit, w in workers.items():
        assert w.status == "ok" and not w.error, (unit, w.error)
        assert w.items > 0 and w.items_per_s > 0, unit


@needs_two_cores
def test_a_worker_out_of_memory_at_build_leaves_the_other_serving():
    # Thread-hosted workers share one engine per process, as GPU workers do. The second
    # worker's build runs out of memory; the engine must not close the runner it built for the
    # first (on a GPU its next batch found no graph and no output buffers and crashed).
    report = run_plan(plan([
        {"unit": "cpu:0", "engine": "torch", "batch": 4, "batch_buckets": "none"},
        {"unit": "cpu:1", "engine": "torch", "batch": 32, "batch_buckets": "none"}],
        model=BOUNDED, cpu_workers="thread"))
    assert report.status == "complete", report.error
    workers = {w.unit: w for w in report.final.workers.values()}
    assert workers["cpu:0"].status == "ok", workers["cpu:0"].error
    assert workers["cpu:0"].items > 0
    assert workers["cpu:1"].status == "oom"  # by the error's type, not its words
    assert "ran out of memory" in workers["cpu:1"].error
    assert report.final.failed == 0  # its queries went to the worker that was built


@needs_two_cores
def test_a_failed_combination_is_a_failed_trial_with_its_error():
    units = select_units("cpu:0,cpu:1", discover(with_runtimes=False))
    evaluator = LiveEvaluator({"m": ModelSpec(BOUNDED)}, units, SHORT, telemetry=False)
    try:
        both = Candidate.of(Config.make("m", "cpu:0", "torch", 4),
                            Config.make("m", "cpu:1", "torch", 32))
        trial = evaluator.evaluate(both, "runtime")
    finally:
        evaluator.close()
    assert trial.status == "oom" and not trial.ok
    assert "ran out of memory" in trial.error
    assert trial.items_per_s is None and trial.per_unit == {}  # no figure to take a factor of


@needs_two_cores
def test_the_tuner_measures_and_reports_a_combination():
    report = run_tune(TuneRequest(
        models=[ModelSpec(MODEL)], units="cpu:0,cpu:1", engines="torch", budget_s=90.0,
        batches=[2, 8], max_instances=1, trial=SHORT, fine_tune=False, pipelines=False))
    result = report.result
    combos = [t for t in result.trials if len(t.candidate.configs) == 2]
    assert combos and all(t.method == "runtime" for t in combos)
    assert all(t.ok for t in combos), [(t.status, t.error) for t in combos]
    assert set(combos[0].per_unit) == {"cpu:0", "cpu:1"}
    assert all(v > 0 for v in combos[0].per_unit.values())
    whole = [c for c in result.contention if c["unit"] == "all"]
    assert whole and whole[0]["status"] == "ok"
    assert whole[0]["measured_items_per_s"] > 0 and whole[0]["factor"] > 0
    per_unit = [c for c in result.contention if c["unit"] != "all"]
    assert {c["unit"] for c in per_unit} == {"cpu:0", "cpu:1"}
    assert all(c["factor"] > 0 for c in per_unit)
    assert result.to_dict()["failed"] == []
    # The written plan serves any load: partial batches run in power-of-two buckets.
    assert {r["batch_buckets"] for m in report.plan["models"] for r in m["replicas"]} == {"pow2"}


def _alive() -> tuple[int, int]:
    gc.collect()
    objects = gc.get_objects()
    return (sum(isinstance(o, Runner) for o in objects),
            sum(isinstance(o, Engine) for o in objects))


def test_each_trial_releases_its_runners_and_engines():
    found = discover()
    units = select_units("cpu,openvino:CPU", found)
    evaluator = LiveEvaluator({"m": ModelSpec(MODEL)}, units, SHORT, telemetry=False)
    before = _alive()
    # Every engine, and two batch sizes of one (a runner per bucket, one engine for both).
    cfgs = [Config.make("m", "cpu", "torch", b) for b in (1, 16)]
    cfgs += [Config.make("m", "cpu", "onnxruntime", 8)]
    cfgs += [Config.make("m", "openvino:CPU", "openvino", 2)]
    try:
        for method in ("engine", "runtime"):
            for cfg in cfgs:
                trial = evaluator.evaluate(Candidate.of(cfg), method)
                assert trial.ok, (cfg.label(), method, trial.error)
                assert trial.build_s is not None and trial.build_s > 0
                # Nothing a trial built outlives it: not the runners, not their engines.
                assert _alive() == before, (cfg.label(), method)
    finally:
        evaluator.close()


def test_a_trial_below_the_unit_s_precision_is_checked_against_the_network():
    """Trials skip the agreement check, except those whose options compute below the unit's
    precision (LiteRT's int8 here; torch's fp8 on a GPU): a fast wrong plan must not win."""
    pytest.importorskip("ai_edge_litert", reason="LiteRT is not installed")
    units = select_units("cpu", discover())
    evaluator = LiveEvaluator({"m": ModelSpec(MODEL)}, units, SHORT, telemetry=False)
    int8_config = Config.make("m", "cpu", "litert", 4, options={"precision": "int8"})
    try:
        plain = evaluator.evaluate(Candidate.of(Config.make("m", "cpu", "litert", 4)), "engine")
        int8 = evaluator.evaluate(Candidate.of(int8_config), "engine")
        # The in-process trial's verdict is kept for the runtime trials of the same config
        # (which run no agreement check of their own), so they do not build it again.
        checked = dict(evaluator._verdicts)
        through_runtime = evaluator.evaluate(Candidate.of(int8_config), "runtime")
    finally:
        evaluator.close()
    assert plain.ok and plain.record.get("agreement") is None
    assert int8.record["agreement"]["precision"] == "int8"
    assert int8.record["agreement"]["status"] in ("pass", "fail")
    # A failed check makes the trial invalid, never a plan's figure.
    passed = int8.record["agreement"]["status"] == "pass"
    assert int8.ok == passed
    assert int8_config.key() in checked
    assert (checked[int8_config.key()] is None) == passed
    assert through_runtime.ok == passed, through_runtime.error
    if not passed:
        assert through_runtime.status == "invalid"
        assert "WRONG RESULTS" in (through_runtime.error or "")
    # A runtime trial of a config no in-process trial checked builds and checks it first.
    fresh = LiveEvaluator({"m": ModelSpec(MODEL)}, units, SHORT, telemetry=False)
    try:
        alone = fresh.evaluate(Candidate.of(int8_config), "runtime")
    finally:
        fresh.close()
    assert (fresh._verdicts[int8_config.key()] is None) == passed
    assert alone.ok == passed, alone.error
