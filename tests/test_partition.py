"""Pipeline partitioning on CPU core sets: cut points, DP against brute force, exact pipelines."""

from __future__ import annotations

import itertools
import json
import os
import random

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from infermux.engines import create_engine
from infermux.errors import UsageError
from infermux.models import LoadedModel, ModelSpec, load_model
from infermux.partition import (
    Profile,
    ProfileCost,
    brute_force,
    capture_graph,
    load_pipeline,
    save_pipeline,
    solve,
    split,
    time_transfer,
)
from infermux.partition.profile import profile_segments
from infermux.runtime.plan import ModelEntry
from infermux.runtime.stages import Pipeline
from infermux.runtime.transfer import HOST
from infermux.store import Store
from infermux.units import discover, select_units

from .conftest import invoke_cli

USABLE = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(USABLE) < 2, reason="needs two usable CPU cores")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


# -- a network with branches and several outputs per block ---------------------------------------


class Inception(nn.Module):
    """Three branches concatenated: no cut may fall between them."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.b1 = nn.Conv2d(c, 4, 1)
        self.b2 = nn.Sequential(nn.Conv2d(c, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.b3 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(c, 4, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.b3(x)], 1)


class TwoOut(nn.Module):
    """A block returning a tuple."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1)
        self.b = nn.Conv2d(c, c, 1)

    def forward(self, x):
        return self.a(x), self.b(x)


class Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(torch.relu(self.conv1(x)))


class BranchNet(nn.Module):
    input_shape = (3, 16, 16)

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.inception = Inception(8)
        self.two = TwoOut(12)
        self.res = Residual(12)
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        x = self.inception(self.stem(x))
        a, b = self.two(x)
        x = self.res(a * torch.sigmoid(b))
        features = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.head(features), features  # several outputs


class ShapeBranch(nn.Module):
    """Python control flow on a shape: torch.fx cannot trace it, torch.export can."""

    input_shape = (3, 8, 8)

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.res = Residual(4)
        self.fc = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x):
        if x.dim() == 4:
            x = torch.relu(self.conv(x))
        return self.fc(torch.flatten(self.res(x), 1))


def branchnet() -> LoadedModel:
    torch.manual_seed(0)
    return LoadedModel.from_module(BranchNet(), name="branchnet", input_shape=(3, 16, 16))


@pytest.fixture(scope="module")
def units():
    found = discover(with_runtimes=False)
    ids = [f"cpu:{c}" for c in USABLE[:2]]
    return {u.id: u for u in select_units(ids, found)}


# -- cut points --------------------------------------------------------------------------------------


def _dominators(graph) -> set[str]:
    """Nodes whose removal disconnects the output from the input (an independent definition)."""
    nodes = graph.nodes
    source, sink = nodes[0], nodes[-1]
    found = set()
    for cand in nodes[1:-1]:
        seen, stack = {source}, [source]
        while stack:
            node = stack.pop()
            for user in node.users:
                if user is not cand and user not in seen:
                    seen.add(user)
                    stack.append(user)
        meta = cand.meta.get("tensor_meta")
        batch_major = meta is not None and hasattr(meta, "shape") and len(meta.shape) > 0
        sole_output = sink.all_input_nodes == [cand]  # the end, not a cut
        if sink not in seen and batch_major and not sole_output:
            found.add(cand.name)
    return found


@pytest.mark.parametrize("name", ["branchnet", "resnet18", "mobilenet_v3_small"])
def test_cuts_are_exactly_the_dominators(name):
    model = branchnet() if name == "branchnet" else load_model(ModelSpec(name, input_shape=(3, 32, 32)))
    graph = capture_graph(model.module, model.input_shape)
    cuts = {c.node for c in graph.cuts}
    assert cuts == _dominators(graph)
    assert graph.method == "fx"


def test_no_cut_inside_branches_or_residuals():
    graph = capture_graph(BranchNet(), (3, 16, 16))
    cuts = [c.node for c in graph.cuts]
    assert "cat" in cuts  # after the inception block
    assert "mul" in cuts  # after the two outputs are combined
    assert "add" in cuts  # after the residual
    inside = ("inception_b", "two_a", "two_b", "res_conv", "relu_1", "sigmoid")
    assert not [c for c in cuts if c.startswith(inside)], cuts
    assert len(graph.outputs) == 2 and graph.outputs[1].shape == (12,)
    cat = graph.cut("cat")
    assert cat.tensor.shape == (12, 16, 16) and cat.tensor.bytes_per_item == 12 * 16 * 16 * 4
    with pytest.raises(UsageError, match="not a valid cut point"):
        graph.cut("inception_b1")


def test_resnet18_cuts_never_inside_a_block():
    model = load_model(ModelSpec("resnet18", input_shape=(3, 32, 32)))
    graph = capture_graph(model.module, model.input_shape)
    names = [c.node for c in graph.cuts]
    assert "maxpool" in names and "layer2_1_relu_1" in names
    # inside a basic block only the block input and the branch are live: no conv/bn of a layer
    assert not [n for n in names if n.startswith("layer") and ("conv" in n or "bn" in n)]


def test_segments_flops_and_parameters_add_up():
    model = load_model(ModelSpec("resnet18", input_shape=(3, 32, 32)))
    graph = capture_graph(model.module, model.input_shape)
    segments = split(graph)
    assert sum(s.parameters for s in segments) == model.info["parameters"]
    whole = split(graph, ["input", "output"])[0]
    assert sum(s.flops_per_item for s in segments) == whole.flops_per_item > 0


def test_export_fallback_when_fx_fails(units):
    torch.manual_seed(0)
    model = LoadedModel.from_module(ShapeBranch(), name="shapebranch", input_shape=(3, 8, 8))
    graph = capture_graph(model.module, model.input_shape)
    assert graph.method == "export" and graph.notes
    assert len(graph.cuts) >= 2
    names = graph.boundaries
    cut = names[len(names) // 2]
    plan = _plan([("input", cut, [next(iter(units))], 2), (cut, "output", [list(units)[-1]], 2)])
    x = np.random.default_rng(1).standard_normal((4, 3, 8, 8)).astype(np.float32)
    with Pipeline(plan, model, graph, units) as pipeline:
        (y,) = pipeline.run(x)
    with torch.inference_mode():
        expected = model.module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


# -- pipelines equal the unsplit model --------------------------------------------------------------


def _plan(stages, replicas=1, buffers=2):
    return ModelEntry.model_validate({"name": "m", "model": "m", "pipeline_replicas": replicas,
                                      "stages": [{"start": a, "end": b, "units": u, "batch": batch,
                                                  "buffers": buffers}
                                                 for a, b, u, batch in stages]})


def _unsplit(model, unit, x):
    runner = create_engine("torch").build(model, unit, len(x))
    outs = runner.infer(x)
    runner.close()
    return outs


@two_cores
@pytest.mark.parametrize("name,cut", [
    ("resnet18", "layer2_1_relu_1"),
    ("mobilenet_v3_small", "add_2"),
    ("branchnet", "cat"),
])
def test_pipeline_is_bitwise_equal_to_the_unsplit_model(units, name, cut):
    model = branchnet() if name == "branchnet" else load_model(ModelSpec(name, input_shape=(3, 64, 64)))
    graph = capture_graph(model.module, model.input_shape)
    u0, u1 = list(units)
    plan = _plan([("input", cut, [u0], 2), (cut, "output", [u1], 2)])
    x = np.random.default_rng(0).standard_normal((6, *model.input_shape)).astype(np.float32)
    with Pipeline(plan, model, graph, units) as pipeline:
        outs = pipeline.run(x)
    expected = np.concatenate([_unsplit(model, units[u0], x[i:i + 2])[0] for i in range(0, 6, 2)])
    # CPU fp32 at the same batch size and thread count runs the same kernels: bitwise equal.
    assert np.array_equal(outs[0], expected)
    if name == "branchnet":
        assert len(outs) == 2 and outs[1].shape == (6, 12)


@two_cores
def test_three_stages_batches_duplication_and_replicas(units):
    model = branchnet()
    graph = capture_graph(model.module, model.input_shape)
    u0, u1 = list(units)
    plan = _plan([("input", "cat", [u0], 4), ("cat", "add", [u0, u1], 2),
                  ("add", "output", [u1], 6)], replicas=2)
    assert plan.chunk == 2
    x = np.random.default_rng(2).standard_normal((26, 3, 16, 16)).astype(np.float32)
    with Pipeline(plan, model, graph, units) as pipeline:
        logits, features = pipeline.run(x)
    with torch.inference_mode():
        ref_logits, ref_features = model.module(torch.from_numpy(x))
    np.testing.assert_allclose(logits, ref_logits.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(features, ref_features.numpy(), rtol=1e-5, atol=1e-6)


class SlowTail(nn.Module):
    """A cheap first half and a much more expensive second half."""

    input_shape = (8, 16, 16)

    def __init__(self) -> None:
        super().__init__()
        self.cheap = nn.Conv2d(8, 8, 1)
        self.costly = nn.Sequential(*[nn.Conv2d(8, 8, 5, padding=2) for _ in range(12)])

    def forward(self, x):
        return self.costly(torch.relu(self.cheap(x)))


@two_cores
@pytest.mark.parametrize("buffers", [1, 3])
def test_buffers_bound_memory_behind_a_slow_stage(units, buffers):
    torch.manual_seed(0)
    model = LoadedModel.from_module(SlowTail(), name="slowtail", input_shape=(8, 16, 16))
    graph = capture_graph(model.module, model.input_shape)
    u0, u1 = list(units)
    plan = _plan([("input", "relu", [u0], 2), ("relu", "output", [u1], 2)], buffers=buffers)
    x = np.random.default_rng(3).standard_normal((40, 8, 16, 16)).astype(np.float32)
    with Pipeline(plan, model, graph, units) as pipeline:
        pipeline.run(x)
        peaks = pipeline.peak_in_flight()
        first = pipeline.copies[0][0]
    # The fast first stage runs ahead only as far as its buffers let it, and it does get there.
    assert peaks[f"0:0:{u0}"] == buffers == len(first.pool.slots)
    assert peaks["feeder"] <= len(pipeline._feed_pool.slots)


@two_cores
def test_measure_reports_throughput_and_balance(units):
    model = branchnet()
    graph = capture_graph(model.module, model.input_shape)
    u0, u1 = list(units)
    plan = _plan([("input", "cat", [u0], 4), ("cat", "output", [u1], 4)])
    with Pipeline(plan, model, graph, units) as pipeline:
        result = pipeline.measure(duration_s=0.4, warmup_s=0.1)
    assert result.items > 0 and result.items_per_s > 0
    assert len(result.stage_busy) == 2 and all(0 < b <= 1 for b in result.stage_busy)
    assert len(result.latencies_ns) * 4 == result.items


def test_plan_yaml_round_trip_and_errors(tmp_path):
    plan = _plan([("input", "cat", ["cpu:0"], 4), ("cat", "output", ["cpu:1", "cpu:0"], 8)])
    path = tmp_path / "plan.yaml"
    save_pipeline(plan, path)
    again = load_pipeline(path)
    assert again == plan and again.chunk == 4
    assert again.stages is not None and again.stages[1].units == ["cpu:1", "cpu:0"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"models": [{"name": "m", "model": "m", "stages": [
        {"end": "cat", "units": ["cpu:0"]}, {"start": "add", "units": ["cpu:0"]}]}]}))
    with pytest.raises(UsageError, match="contiguous"):
        load_pipeline(bad)
    bad.write_text(yaml.safe_dump({"models": [{"name": "m", "model": "m",
                                               "replicas": [{"unit": "cpu:0"}]}]}))
    with pytest.raises(UsageError, match="has no model with stages"):
        load_pipeline(bad)


# -- the DP against brute force ----------------------------------------------------------------------


def _random_profile(rng: random.Random, n: int, units: list[str]) -> Profile:
    profile = Profile(batch=4, boundaries=[f"b{i}" for i in range(n + 1)], units=units)
    profile.compute_s = {u: [rng.uniform(0.1, 2.0) for _ in range(n)] for u in units}
    for u in units:
        profile.transfer_s[(HOST, u)] = {0: rng.uniform(0, 0.3)}
        profile.transfer_s[(u, HOST)] = {n: rng.uniform(0, 0.3)}
        for v in units:
            profile.transfer_s[(u, v)] = {b: rng.uniform(0, 0.5) for b in range(1, n)}
    return profile


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 5)
    units = [f"u{i}" for i in range(rng.randint(1, 3))]
    cost = ProfileCost(_random_profile(rng, n, units))
    for max_dup, top_k, max_stages in itertools.product((1, 2), (1, 4), (None, 2)):
        kwargs = {"max_dup": max_dup, "top_k": top_k, "max_stages": max_stages}
        dp = solve(n, units, cost, **kwargs)
        brute = brute_force(n, units, cost, **kwargs)
        assert [c.key for c in dp] == [c.key for c in brute]
        assert [c.bottleneck_s for c in dp] == pytest.approx([c.bottleneck_s for c in brute])


def test_dp_balances_and_duplicates():
    profile = Profile(batch=1, boundaries=["input", "a", "b", "output"], units=["x", "y"])
    profile.compute_s = {"x": [1.0, 1.0, 1.0], "y": [1.0, 1.0, 1.0]}
    for u in ("x", "y"):
        profile.transfer_s[(HOST, u)] = {0: 0.0}
        profile.transfer_s[(u, HOST)] = {3: 0.0}
        for v in ("x", "y"):
            profile.transfer_s[(u, v)] = {1: 0.0, 2: 0.0}
    cost = ProfileCost(profile)
    (best,) = solve(3, ["x", "y"], cost)
    assert best.bottleneck_s == pytest.approx(2.0) and len(best.stages) == 2
    (dup,) = solve(3, ["x", "y"], cost, max_dup=2)  # one stage on both: data-parallel, 3 s / 2
    assert dup.bottleneck_s == pytest.approx(1.5) and dup.stages[0].units == ("x", "y")
    with pytest.raises(UsageError, match="repeat a unit"):
        solve(3, ["x", "x"], cost)


# -- profiles ----------------------------------------------------------------------------------------


@two_cores
def test_profile_times_every_piece_and_link(units):
    model = branchnet()
    graph = capture_graph(model.module, model.input_shape)
    segments = split(graph, ["input", "cat", "add", "output"])
    unit_list = list(units.values())
    profile = profile_segments(model, segments, unit_list, 2, min_time_s=0.01)
    assert set(profile.compute_s) == set(units) and all(len(v) == 3 for v in profile.compute_s.values())
    assert all(t > 0 for v in profile.compute_s.values() for t in v)
    u0, u1 = list(units)
    assert set(profile.transfer_s[(u0, u1)]) == {1, 2}
    assert profile.transfer_s[(HOST, u0)][0] > 0 and profile.transfer_s[(u1, HOST)][3] > 0
    big = time_transfer(units[u0], units[u1], [(64, 256, 32, 32)])
    small = time_transfer(units[u0], units[u1], [(1, 4, 4, 4)])
    assert big > small > 0


@needs_cuda
def test_gpu_pipeline_and_transfers(units):
    found = discover(with_runtimes=False)
    gpu = select_units("cuda:0/fp32", found)[0]
    all_units = {**units, gpu.id: gpu}
    model = branchnet()
    graph = capture_graph(model.module, model.input_shape)
    cpu = next(iter(units))
    plan = _plan([("input", "cat", [cpu], 2), ("cat", "add", [gpu.id], 2), ("add", "output", [cpu], 2)])
    x = np.random.default_rng(4).standard_normal((8, 3, 16, 16)).astype(np.float32)
    with Pipeline(plan, model, graph, all_units) as pipeline:
        logits, _ = pipeline.run(x)
    with torch.inference_mode():
        expected = model.module(torch.from_numpy(x))[0].numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)
    # Across precisions: an fp16 middle stage stays within fp16's tolerance of the fp32 model.
    half = select_units("cuda:0/fp16", found)[0]
    plan16 = _plan([("input", "cat", [cpu], 2), ("cat", "output", [half.id], 2)])
    with Pipeline(plan16, model, graph, {**all_units, half.id: half}) as pipeline:
        logits16, _ = pipeline.run(x)
    np.testing.assert_allclose(logits16, expected, rtol=2e-2, atol=2e-2)
    assert time_transfer(units[cpu], gpu, [(8, 64, 56, 56)]) > 0
    assert time_transfer(gpu, None, [(8, 64, 56, 56)]) > 0
    if torch.cuda.device_count() > 1:
        other = select_units("cuda:1/fp32", found)[0]
        assert time_transfer(gpu, other, [(8, 64, 56, 56)]) > 0


# -- the command line --------------------------------------------------------------------------------


def test_cli_show(tiny_factory):
    result = invoke_cli("partition", "--model", f"{tiny_factory}:build", "--show", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["capture"] == "fx"
    assert [c["node"] for c in data["cuts"]][:2] == ["body_0", "body_1"]
    assert data["cuts"][0]["shape"] == [8, 32, 32] and data["cuts"][0]["bytes_per_item"] == 8 * 32 * 32 * 4
    assert sum(s["parameters"] for s in data["segments"]) > 0
    from rich.console import Console

    from infermux.cli.render import partition_tables as _show_tables

    console = Console(record=True, width=120)
    for table in _show_tables(data, "tiny"):
        console.print(table)
    text = console.export_text()
    assert "crossing tensor" in text and "body_0" in text


@two_cores
def test_cli_partition_writes_a_plan_that_check_and_run_accept(tiny_factory, tmp_path, db):
    out = tmp_path / "plan.yaml"
    units = ",".join(f"cpu:{c}" for c in USABLE[:2])
    result = invoke_cli("partition", "--model", f"{tiny_factory}:build", "--units", units, "--batch", "4",
                        "--measure-top", "2", "--duration", "0.3s", "--warmup", "0.1s", "--max-pieces", "4",
                        "--out", str(out), "--db", str(db), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert len(data["candidates"]) == 2
    assert sum(c["chosen"] for c in data["candidates"]) == 1
    assert all(c["measured_items_per_s"] > 0 for c in data["candidates"])
    plan = load_pipeline(out)
    assert plan.measured_items_per_s and plan.stages and plan.stages[0].batch == 4
    with Store(db) as store:
        run = store.run(data["run_id"])
        assert run["kind"] == "partition" and run["status"] == "complete"
        assert len(run["results"]) == 2
        rows = store.connection.execute(
            "SELECT COUNT(*), SUM(chosen) FROM partition_candidates WHERE run_id = ?",
            (data["run_id"],)).fetchone()
        assert tuple(rows) == (2, 1)
        kinds = {r[0] for r in store.connection.execute("SELECT kind FROM partition_profiles")}
        assert kinds == {"compute", "transfer"}
    # The plan it wrote is one `plan --check` and `run` accept, offline and under server load.
    written = yaml.safe_load(out.read_text())
    assert written["models"][0]["stages"] and written["load"]["scenario"] == "offline"
    check = invoke_cli("plan", "--check", str(out))
    assert check.returncode == 0 and "1 pipeline(s)" in check.stdout, check.stdout + check.stderr
    for extra in ([], ["--scenario", "server", "--qps", "50", "--p99", "5000"]):
        ran = invoke_cli("run", str(out), "--duration", "0.5s", "--min-queries", "32",
                         "--db", str(db), "--json", *extra)
        assert ran.returncode == 0, ran.stderr
        result = json.loads(ran.stdout)["result"]
        assert result["failed"] == 0 and result["completed"] > 0
        assert len(result["pipelines"]) == 1
    bad = invoke_cli("partition", "--model", f"{tiny_factory}:build", "--units", units, "--batch", "0",
                     "--no-store")
    assert bad.returncode == 2 and "--batch 0" in bad.stderr
