"""Pipelines as runtime models: stages in a plan, run under every scenario (partition → plan → run
is tests/test_partition.py's command-line test)."""


import numpy as np
import pytest
import torch

from infermux.errors import UsageError
from infermux.models import ModelSpec, load_model
from infermux.models.graph import capture_graph
from infermux.runtime import parse_plan, run_plan
from infermux.runtime.plan import ModelEntry
from infermux.runtime.stages import Pipeline
from infermux.store import Store
from infermux.units import discover, select_units

from .conftest import TINY, needs_two_cores

TWO_STAGES = [{"start": "input", "end": "body_1", "units": ["cpu:0"], "batch": 8},
              {"start": "body_1", "end": "output", "units": ["cpu:1"], "batch": 8}]


def pipeline_plan(stages=None, *, load=None, replicas=None, name="tiny"):
    entry = {"name": name, "model": f"{TINY}:tiny_cnn", "stages": stages or TWO_STAGES}
    if replicas:
        entry["replicas"] = replicas
    return parse_plan({"name": "pipe", "models": [entry],
                       "dispatcher": {"cpu_workers": "thread", "max_queue_delay_ms": 2},
                       "load": {"min_duration_s": 0.6, "min_queries": 40, "sample_pool": 32,
                                **(load or {})}})


def test_plan_validates_stages():
    plan = pipeline_plan()
    assert plan.models[0].chunk == 8 and plan.models[0].replicas == []
    with pytest.raises(UsageError, match="contiguous"):
        pipeline_plan([{"end": "body_1", "units": ["cpu:0"]}, {"start": "body_3", "units": ["cpu:1"]}])
    with pytest.raises(UsageError, match="neither replicas nor stages"):
        parse_plan({"models": [{"name": "a", "model": "resnet18"}]})
    with pytest.raises(UsageError, match="not a unit id"):
        pipeline_plan([{"units": ["gpu0"]}])
    # The stages of one pipeline may share a core; another model may not take it.
    shared = [{"end": "body_1", "units": ["cpu:0"]}, {"start": "body_1", "units": ["cpu:0"]}]
    assert pipeline_plan(shared).models[0].stages
    with pytest.raises(UsageError, match="shares core 0"):
        pipeline_plan(shared, replicas=[{"unit": "cpu:0"}])


def test_unknown_cut_point_is_one_line_naming_the_field():
    plan = pipeline_plan([{"end": "no_such_node", "units": ["cpu:0"]},
                          {"start": "no_such_node", "units": ["cpu:0"]}])
    with pytest.raises(UsageError, match=r"models\[0\]\.stages\[0\].*'no_such_node' is not a cut point"):
        run_plan(plan)


@needs_two_cores
@pytest.mark.parametrize("scenario", ["offline", "server", "single-stream"])
def test_pipeline_runs_under_each_scenario(scenario, tmp_path):
    load = {"scenario": scenario, "rate_qps": 80, "p99_bound_ms": 2000} if scenario == "server" else \
        {"scenario": scenario}
    with Store(tmp_path / "r.db") as store:
        report = run_plan(pipeline_plan(load=load), store=store)
        stored = store.run(report.run_id)
    record = report.final
    assert report.status == "complete" and record is not None
    model = record.models["tiny"]
    assert model.completed == model.issued > 0 and model.failed == 0
    stages = record.pipelines["tiny"]
    assert [s["segment"] for s in stages] == ["input→body_1", "body_1→output"]
    assert all(s["items"] > 0 and 0 < s["busy"] <= 1 for s in stages)
    # Every item went through both stages (whole batches in offline, what was waiting otherwise).
    assert stages[0]["items"] == stages[1]["items"]
    if scenario == "single-stream":
        assert stages[0]["mean_batch"] == 1.0  # one query at a time: no padding to the batch
    worker = record.workers["tiny/pipeline"]
    assert worker.unit == "cpu:0|cpu:1" and 0 < worker.utilisation <= 1
    assert stored["status"] == "complete"


@needs_two_cores
def test_pipeline_replicas_beside_data_parallel_replicas():
    plan = pipeline_plan([{"end": "body_1", "units": ["cpu:0"], "batch": 4},
                          {"start": "body_1", "units": ["cpu:0"], "batch": 4}],
                         replicas=[{"unit": "cpu:1", "batch": 4}])
    report = run_plan(plan)
    workers = report.final.workers
    assert workers["tiny/pipeline"].items > 0
    assert workers["tiny/cpu:1#0"].items > 0
    assert report.final.models["tiny"].failed == 0


def test_served_pipeline_returns_partial_chunks_in_order_and_correct():
    """Chunks of any size up to the link's go through; outputs equal the whole model's."""
    model = load_model(ModelSpec(f"{TINY}:tiny_cnn"))
    graph = capture_graph(model.module, model.input_shape)
    units = {u.id: u for u in select_units(["cpu:0"], discover(with_runtimes=False))}
    plan = ModelEntry.model_validate({"name": "m", "model": "m", "stages": [
        {"start": "input", "end": "body_1", "units": ["cpu:0"], "batch": 4},
        {"start": "body_1", "end": "output", "units": ["cpu:0"], "batch": 8}]})
    got: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []
    rng = np.random.default_rng(0)
    data = rng.standard_normal((13, 3, 32, 32)).astype(np.float32)
    sizes = [1, 3, 4, 2, 1, 2]  # 13 rows in chunks up to the chunk of 4
    with Pipeline(plan, model, graph, units, buckets=True) as pipe:
        pipe.serve(lambda cid, _ns, outs: got.__setitem__(cid, outs[0].numpy().copy()), errors.append)
        at = 0
        for cid, n in enumerate(sizes):
            pipe.feed(cid, data[at:at + n])
            at += n
        with pytest.raises(UsageError, match="at most 4 rows"):
            pipe.feed(99, data[:5])
        pipe.end_serving()
    assert not errors and sorted(got) == list(range(len(sizes)))
    out = np.concatenate([got[c] for c in range(len(sizes))])
    with torch.no_grad():
        ref = model.module(torch.from_numpy(data)).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_compiled_replica_compiles_only_its_largest_buckets():
    from infermux.runtime.layout import bucket_options

    plan = parse_plan({"models": [{"name": "r", "model": "resnet50", "replicas": [
        {"unit": "cuda:0/fp16", "batch": 64, "options": {"compile": "default"}}]}]})
    rep = plan.models[0].replicas[0]
    compiled = [b for b in rep.buckets() if bucket_options(rep, b).get("compile")]
    assert compiled == [32, 64]
    assert bucket_options(rep, 1) == {}
    assert rep.options == {"compile": "default"}  # the plan itself is untouched
    # A process-hosted worker's child builds from the same rule (its spec's buckets, a tuple).
    from infermux.runtime.layout import layout_workers
    from infermux.runtime.local import _Runtime
    from infermux.runtime.plan import options_for_bucket
    from infermux.units import discover

    cpu = parse_plan({"models": [{"name": "r", "model": "resnet50", "replicas": [
        {"unit": "cpu:0", "batch": 8, "options": {"compile": "default"}}]}],
        "dispatcher": {"cpu_workers": "process"}})
    (wp,) = layout_workers(cpu, discover(with_runtimes=False))
    (spec,) = _Runtime(cpu, None)._specs(wp)
    assert [b for b in spec.buckets
            if options_for_bucket(spec.options, spec.buckets, b).get("compile")] == [4, 8]


def test_fine_buckets_compile_every_bucket_above_half_the_batch():
    """`fine` compiles where server batches land (above half), and nothing smaller."""
    from infermux.runtime.layout import bucket_options

    plan = parse_plan({"models": [{"name": "r", "model": "resnet50", "replicas": [
        {"unit": "cuda:0/fp16", "batch": 64, "batch_buckets": "fine",
         "options": {"compile": "default"}}]}]})
    rep = plan.models[0].replicas[0]
    assert rep.buckets() == [1, 2, 4, 8, 16, 32, 40, 48, 56, 64]
    assert [b for b in rep.buckets() if bucket_options(rep, b).get("compile")] == [40, 48, 56, 64]


@pytest.mark.parametrize("threaded", [False, True], ids=["one-thread", "split-gather"])
def test_fed_indices_gather_the_right_rows(threaded, monkeypatch):
    """The runtime feeds rows of its sample pool by index, split over threads when large."""
    import infermux.runtime.stages as pipeline_module

    if threaded:  # every gather counts as large: the threaded path runs on a tiny model
        monkeypatch.setattr(pipeline_module, "_GATHER_BYTES_PER_THREAD", 1)
    model = load_model(ModelSpec(f"{TINY}:tiny_cnn"))
    graph = capture_graph(model.module, model.input_shape)
    units = {u.id: u for u in select_units(["cpu:0"], discover(with_runtimes=False))}
    plan = ModelEntry.model_validate({"name": "m", "model": "m", "stages": [
        {"start": "input", "end": "body_1", "units": ["cpu:0"], "batch": 4},
        {"start": "body_1", "end": "output", "units": ["cpu:0"], "batch": 4}]})
    rng = np.random.default_rng(1)
    pool = torch.from_numpy(rng.standard_normal((16, 3, 32, 32)).astype(np.float32))
    picks = [[3, 1, 4, 1], [5, 9], [2, 6, 5]]
    got: dict[int, np.ndarray] = {}
    with Pipeline(plan, model, graph, units, buckets=True) as pipe:
        assert pipe.feed_dtype == torch.float32
        pipe.serve(lambda cid, _ns, outs: got.__setitem__(cid, outs[0].numpy().copy()), print)
        for cid, rows in enumerate(picks):
            pipe.feed_indices(cid, pool, rows)
        pipe.end_serving()
    with torch.no_grad():
        for cid, rows in enumerate(picks):
            np.testing.assert_allclose(got[cid], model.module(pool[rows]).numpy(), rtol=1e-4,
                                       atol=1e-5)
