"""Plan validation: every malformed field gets a message naming it, the value and what is allowed."""

import itertools

import pytest
import yaml

from infermux.errors import UsageError
from infermux.runtime import EXAMPLE_PLAN, load_plan, parse_plan
from infermux.runtime.layout import layout_workers
from infermux.units import discover

from .conftest import invoke_cli


def base(**changes):
    plan = {"models": [{"name": "a", "model": "resnet18",
                        "replicas": [{"unit": "cpu:0", "batch": 4}]}]}
    plan.update(changes)
    return plan


def replica(**fields):
    return base(models=[{"name": "a", "model": "resnet18",
                         "replicas": [{"unit": "cpu:0", **fields}]}])


BAD = [
    ({"models": []}, ["models", "at least 1"]),
    ({}, ["models", "required"]),
    (replica(unit="gpu"), ["models[0].replicas[0].unit", "'gpu'", "cuda:0/fp16"]),
    (replica(unit="cuda:0/fp8"), ["models[0].replicas[0].unit", "fp16"]),
    (replica(unit="cpu:3-1"), ["core set", "cpu:0-3"]),
    (replica(instances=0), ["models[0].replicas[0].instances", "0", "greater than or equal to 1"]),
    (replica(instances=2), ["models[0].replicas[0]", "oversubscribe", "at most 1"]),
    (replica(batch=0), ["models[0].replicas[0].batch", "greater than or equal to 1"]),
    (replica(batch="big"), ["models[0].replicas[0].batch", '"big"', "integer"]),
    (replica(batch_buckets="odd"), ["batch_buckets", "'pow2'", "'fine'", "'none'"]),
    (replica(batch=4, batch_buckets=[1, 8]), ["batch_buckets", "past batch 4"]),
    (replica(batchsize=4), ["models[0].replicas[0].batchsize", "not a plan field",
                            "unit, engine, instances, batch"]),
    (base(models=[{"name": "a b", "model": "x", "replicas": [{"unit": "cpu:0"}]}]),
     ["models[0].name", "pattern"]),
    (base(models=[{"name": "a", "model": "x", "replicas": []}]),
     ["models[0]", "neither replicas nor stages"]),
    (base(models=[{"name": "a", "model": "x", "replicas": [{"unit": "cpu:0"}]},
                  {"name": "a", "model": "y", "replicas": [{"unit": "cpu:1"}]}]),
     ["['a']", "appear twice"]),
    (base(models=[{"name": "a", "model": "x",
                   "replicas": [{"unit": "cpu:0"}, {"unit": "cpu:0-1"}]}]),
     ["models[0].replicas[1].unit", "shares core 0", "disjoint"]),
    (base(models=[{"name": "a", "model": "x", "replicas": [{"unit": "cpu"}, {"unit": "cpu:1"}]}]),
     ["'cpu' takes every core"]),
    (base(models=[{"name": "a", "model": "x", "latency_bound_ms": -5,
                   "replicas": [{"unit": "cpu:0"}]}]),
     ["models[0].latency_bound_ms", "-5", "greater than 0"]),
    (base(models=[{"name": "a", "model": "x", "input_shape": [3, 0],
                   "replicas": [{"unit": "cpu:0"}]}]), ["input_shape", "positive"]),
    (base(dispatcher={"policy": "random"}), ["dispatcher.policy", "'pull'", "'round_robin'"]),
    (base(dispatcher={"max_queue_delay_ms": -1}), ["dispatcher.max_queue_delay_ms", "-1"]),
    (base(dispatcher={"cpu_workers": "fork"}), ["dispatcher.cpu_workers", "'process'", "'thread'"]),
    (base(dispatcher={"estimate_alpha": 0}), ["dispatcher.estimate_alpha", "greater than 0"]),
    (base(dispatcher={"max_retries": 99}), ["dispatcher.max_retries", "99"]),
    (base(placement="anywhere"), ["placement", "'static'", "'dynamic'"]),
    (base(load={"scenario": "burst"}), ["load.scenario", "'offline'", "'multi-stream'"]),
    (base(load={"rate_qps": 0}), ["load.rate_qps", "greater than 0"]),
    (base(load={"min_queries": 0}), ["load.min_queries"]),
    (base(load={"min_duration_s": 10, "max_duration_s": 5}), ["max_duration_s", "shorter"]),
    (base(load={"data": "disk"}), ["load.data", "'host'", "'device'"]),
    (base(load={"mix": [{"at_s": 0, "shares": {"zzz": 1}}]}), ["load.mix[0].shares", "zzz",
                                                                 "models: a"]),
    (base(load={"mix": [{"at_s": 1, "shares": {"a": 1}}]}), ["begin at 0"]),
    (base(load={"mix": [{"at_s": 0, "shares": {"a": -1}}]}), ["load.mix[0].shares", "non-negative"]),
    (base(extra=1), ["field extra", "not a plan field", "models, dispatcher"]),
    ([1, 2], ["a plan is a mapping"]),
]


@pytest.mark.parametrize(("data", "needles"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_every_malformed_field_is_named(data, needles):
    with pytest.raises(UsageError) as info:
        parse_plan(data)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_example_plan_is_valid_and_annotated():
    plan = parse_plan(yaml.safe_load(EXAMPLE_PLAN))
    assert [m.name for m in plan.models] == ["cnn", "resnet"]
    assert plan.models[0].replicas[0].buckets() == [1, 2, 4, 8]
    assert "#" in EXAMPLE_PLAN  # annotated


@pytest.mark.parametrize(("batch", "buckets", "expected"), [
    (8, "pow2", [1, 2, 4, 8]), (6, "pow2", [1, 2, 4, 6]), (1, "pow2", [1]),
    (8, "none", [8]), (8, [2, 4], [2, 4, 8]),
])
def test_buckets(batch, buckets, expected):
    rep = parse_plan(replica(unit="cpu:0", batch=batch, batch_buckets=buckets)).models[0].replicas[0]
    assert rep.buckets() == expected


def test_load_plan_reports_yaml_errors_with_a_line(tmp_path):
    bad = tmp_path / "plan.yaml"
    bad.write_text("models:\n  - name: a\n    replicas: [\n")
    with pytest.raises(UsageError, match="not valid YAML at line"):
        load_plan(bad)
    with pytest.raises(UsageError, match="does not exist"):
        load_plan(tmp_path / "missing.yaml")
    good = tmp_path / "good.yaml"
    good.write_text(EXAMPLE_PLAN)
    assert load_plan(good).name == "two-models"


def test_layout_splits_a_core_set_between_instances():
    found = discover(with_runtimes=False)
    cores = found.cpu["usable_cores"]
    if len(cores) < 2:
        pytest.skip("needs two usable cores")
    plan = parse_plan({"models": [{"name": "a", "model": "x", "replicas": [
        {"unit": f"cpu:{cores[0]}-{cores[1]}", "instances": 2}]}]})
    workers = layout_workers(plan, found)
    assert [w.cores for w in workers] == [(cores[0],), (cores[1],)]
    assert [w.unit.id for w in workers] == [f"cpu:{cores[0]}", f"cpu:{cores[1]}"]
    assert {w.hosting for w in workers} == {"process"}


def test_layout_names_the_field_of_a_unit_missing_here():
    found = discover(with_runtimes=False)
    plan = parse_plan({"models": [{"name": "a", "model": "x", "replicas": [
        {"unit": "cpu:0"}, {"unit": "cpu:4000"}]}]})
    with pytest.raises(UsageError, match=r"plan field models\[0\]\.replicas\[1\]\.unit: .*4000"):
        layout_workers(plan, found)
    plan = parse_plan({"models": [{"name": "a", "model": "x", "replicas": [
        {"unit": "cpu:0", "engine": "nosuch"}]}]})
    with pytest.raises(UsageError, match=r"models\[0\]\.replicas\[0\]\.engine: unknown engine"):
        layout_workers(plan, found)


def _cli(*args):
    return invoke_cli(*args)


def test_cli_plan_example_and_check(tmp_path):
    ex = _cli("plan", "--example")
    assert ex.returncode == 0
    path = tmp_path / "plan.yaml"
    path.write_text(ex.stdout)
    ok = _cli("plan", "--check", str(path))
    assert ok.returncode == 0 and "valid" in ok.stdout
    path.write_text(ex.stdout.replace("policy: pull", "policy: lottery"))
    bad = _cli("plan", "--check", str(path))
    assert bad.returncode == 2
    assert "dispatcher.policy" in bad.stderr and "lottery" in bad.stderr
    neither = _cli("plan")
    assert neither.returncode == 2 and "--example" in neither.stderr


def test_every_plan_infermux_writes_waits_the_one_queue_delay_default():
    """The queue delay's default lives in one place (`QUEUE_DELAY_MS`), not one per writer.

    A plan without a dispatcher section, the annotated example and a pipeline plan the
    partitioner writes all wait it; before, the plan's default was 1 ms while the tuner, the
    studies and the example wrote 2 ms.
    """
    from infermux.partition.pipeline_file import plan_yaml
    from infermux.runtime.plan import QUEUE_DELAY_MS, ModelEntry

    bare = parse_plan({"models": [{"name": "m", "model": "resnet18",
                                   "replicas": [{"unit": "cpu:0", "batch": 4}]}]})
    example = parse_plan(yaml.safe_load(EXAMPLE_PLAN))
    entry = ModelEntry.model_validate({"name": "m", "model": "resnet18", "stages": [
        {"start": "input", "end": "layer1", "units": ["cpu:0"], "batch": 4},
        {"start": "layer1", "end": "output", "units": ["cpu:0"], "batch": 4}]})
    written = parse_plan(yaml.safe_load(plan_yaml(entry)))
    assert {p.dispatcher.max_queue_delay_ms for p in (bare, example, written)} == {QUEUE_DELAY_MS}


@pytest.mark.parametrize("batch, expected", [
    (64, [1, 2, 4, 8, 16, 32, 40, 48, 56, 64]),
    (128, [1, 2, 4, 8, 16, 32, 64, 80, 96, 112, 128]),
    (8, [1, 2, 4, 5, 6, 7, 8]),
    (3, [1, 2, 3]),
    (1, [1]),
])
def test_fine_buckets_step_by_an_eighth_above_half_the_batch(batch, expected):
    from infermux.runtime.plan import fine_buckets

    assert fine_buckets(batch) == expected
    # Padding above half the batch is at most an eighth of it (rounded down, at least one).
    upper = [b for b in expected if 2 * b >= batch]
    assert max((b - a for a, b in itertools.pairwise(upper)), default=0) <= max(1, batch // 8)

