"""Pipeline segments on every engine: ONNX export of cut networks, `Runner.compute`, chain checks.

Real networks (mobilenet_v3_small and resnet18, random weights, small inputs) cut at a middle cut
point, built by torch, ONNX Runtime and OpenVINO on the CPU; engines not installed here are
skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from infermux import agreement
from infermux.agreement import ChainStage, check_stages
from infermux.engines import create_engine, engine_status
from infermux.engines.base import Engine, compute_device
from infermux.export import INPUT_NAME, export_onnx
from infermux.models import LoadedModel, load_model
from infermux.models.segments import segment_between, segment_model
from infermux.partition import ModelGraph, capture_graph, split
from infermux.units import Unit, discover

CPU_ENGINES = ("torch", "onnxruntime", "openvino")
#: Small inputs keep every build and run in milliseconds; both networks pool adaptively.
SHAPES = {"mobilenet_v3_small": (3, 64, 64), "resnet18": (3, 64, 64)}
BATCH = 2


@pytest.fixture(scope="module", autouse=True)
def _cache(module_cache_dir: Path) -> None:
    """Exports and engine caches of this module live in a fresh folder."""


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    made: dict[str, Engine] = {}
    yield made
    for engine in made.values():
        getattr(engine, "release", lambda: None)()


def _engine(name: str, engines: dict[str, Engine]) -> Engine:
    ok, why = engine_status()[name]
    if not ok:
        pytest.skip(f"engine {name} not usable here: {why}")
    if name not in engines:
        engines[name] = create_engine(name)
    return engines[name]


_NETWORKS: dict[str, tuple[LoadedModel, ModelGraph]] = {}


def _network(name: str) -> tuple[LoadedModel, ModelGraph]:
    if name not in _NETWORKS:
        torch.manual_seed(0)
        model = load_model(name)
        _NETWORKS[name] = (model, capture_graph(model.module, SHAPES[name]))
    return _NETWORKS[name]


def _middle(graph: ModelGraph) -> str:
    return graph.cuts[len(graph.cuts) // 2].node


def _segment_reference(graph: ModelGraph, start: str, end: str, x: torch.Tensor) -> list[torch.Tensor]:
    from infermux.models.segments import build_segment

    with torch.inference_mode():
        out = build_segment(graph, start, end)(x)
    return list(out) if isinstance(out, (list, tuple)) else [out]


@pytest.mark.parametrize("network", sorted(SHAPES))
@pytest.mark.parametrize("name", CPU_ENGINES)
def test_segments_cut_in_the_middle_run_on_every_engine(name: str, network: str, cpu: Unit,
                                                        engines: dict[str, Engine]) -> None:
    """Both halves build, keep `compute()`'s contract, and agree with the torch segment."""
    engine = _engine(name, engines)
    model, graph = _network(network)
    mid = _middle(graph)
    first, second = split(graph, ["input", mid, "output"])
    assert len(first.input.shape) == 3 and len(second.input.shape) == 3  # a 4-D feature map
    x = torch.from_numpy(np.random.default_rng(0).standard_normal(
        (BATCH, *graph.input.shape)).astype(np.float32))
    for index, segment in enumerate((first, second)):
        seg_model = segment_model(model, segment, index)
        runner = engine.build(seg_model, cpu, BATCH, {"warmup_iters": 1})
        assert runner.input_shape == segment.input.shape
        before = x.clone()
        outs = runner.compute(x)
        assert torch.equal(x, before)  # compute() only reads its input
        assert isinstance(outs, list) and len(outs) == len(segment.outputs)
        for out, info in zip(outs, segment.outputs, strict=True):
            assert isinstance(out, torch.Tensor) and out.device.type == "cpu"
            assert out.dtype == torch.float32 and tuple(out.shape) == (BATCH, *info.shape)
        ref = _segment_reference(graph, segment.start, segment.end, x)
        for out, expected in zip(outs, ref, strict=True):
            scale = float(expected.abs().max()) or 1.0
            assert float((out - expected).abs().max()) / scale < agreement.TOLERANCES["fp32"]
        if name != "torch":
            _check_onnx_signature(runner.options["onnx_file"], segment.input.shape,
                                  [o.shape for o in segment.outputs])
        x = outs[0].clone()  # the runner's buffer is overwritten by its next batch


def _check_onnx_signature(path: str, input_shape: tuple[int, ...],
                          output_shapes: list[tuple[int, ...]]) -> None:
    """The exported file takes the segment's crossing tensor, batch axis dynamic."""
    import onnx

    graph = onnx.load(path).graph
    initialisers = {i.name for i in graph.initializer}
    (inp,) = [i for i in graph.input if i.name not in initialisers]
    assert inp.name == INPUT_NAME

    def dims(value: onnx.ValueInfoProto) -> list[object]:
        return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]

    assert dims(inp) == ["batch", *input_shape]
    assert [dims(o)[1:] for o in graph.output] == [list(s) for s in output_shapes]


@pytest.mark.parametrize("name", CPU_ENGINES)
def test_stage_chain_on_one_engine_agrees(name: str, cpu: Unit, engines: dict[str, Engine]) -> None:
    engine = _engine(name, engines)
    model, graph = _network("mobilenet_v3_small")
    mid = _middle(graph)
    result = check_stages(model, graph, [("input", mid, cpu, name, {}), (mid, "output", cpu, name)],
                          batch=BATCH, engines={name: engine})
    assert result.passed, result.message
    assert [s.status for s in result.stages] == ["pass", "pass"]
    for stage in result.stages:
        assert stage.precision == "fp32" and stage.tolerance == agreement.TOLERANCES["fp32"]
        assert stage.max_abs_err is not None and stage.rel_err is not None
        assert stage.rel_err <= stage.tolerance
    assert result.rel_err is not None and result.rel_err <= agreement.TOLERANCES["fp32"]
    assert result.top1 is not None and result.problems == []


def test_stage_chain_across_three_engines(cpu: Unit, engines: dict[str, Engine]) -> None:
    """torch → ONNX Runtime → OpenVINO: each hand-off goes through torch tensors on the host."""
    for name in CPU_ENGINES:
        _engine(name, engines)
    model, graph = _network("resnet18")
    cuts = [c.node for c in graph.cuts]
    a, b = cuts[len(cuts) // 3], cuts[2 * len(cuts) // 3]
    stages = [ChainStage("input", a, cpu, "torch"), ChainStage(a, b, cpu, "onnxruntime"),
              ChainStage(b, "output", "cpu", "openvino", {"hint": "latency"})]
    result = check_stages(model, graph, stages, batch=BATCH, engines=engines)
    assert result.passed, result.message
    assert [s.engine for s in result.stages] == ["torch", "onnxruntime", "openvino"]
    assert result.to_dict()["stages"][2]["unit"] == cpu.id


def test_stage_chain_out_of_order_is_caught(cpu: Unit, engines: dict[str, Engine]) -> None:
    _engine("onnxruntime", engines)
    model, graph = _network("mobilenet_v3_small")
    mid = _middle(graph)
    result = check_stages(model, graph, [(mid, "output", cpu, "onnxruntime"),
                                         ("input", mid, cpu, "onnxruntime")],
                          batch=BATCH, engines=engines)
    assert not result.passed
    assert any("not at the network's input" in p for p in result.problems)
    assert result.stages[0].status == "fail" and "takes" in result.stages[0].message
    assert result.stages[1].status == "not-run"
    assert result.rel_err is None and "produced no output" in result.message


def _skippable_block(graph: ModelGraph) -> tuple[str, str]:
    """Consecutive cuts `a`, `b` with equal tensor shapes and a convolution between them."""
    from infermux.models.segments import build_segment

    for before, after in zip(graph.cuts, graph.cuts[1:], strict=False):
        if before.tensor.shape == after.tensor.shape:
            module = build_segment(graph, before.node, after.node)
            if any(isinstance(m, torch.nn.Conv2d) for m in module.modules()):
                return before.node, after.node
    raise AssertionError("no block to skip")  # pragma: no cover - resnet18 has eight


def test_stage_chain_that_skips_a_block_fails_on_its_output(cpu: Unit,
                                                            engines: dict[str, Engine]) -> None:
    """Every stage computes its own segment right, but the chain is not the network."""
    for name in ("torch", "openvino"):
        _engine(name, engines)
    model, graph = _network("resnet18")
    a, b = _skippable_block(graph)
    result = check_stages(model, graph, [("input", a, cpu, "torch"),
                                         (b, "output", cpu, "openvino")],
                          batch=BATCH, engines=engines)
    assert [s.status for s in result.stages] == ["pass", "pass"]
    assert not result.passed
    assert result.problems == [f"stage 1 starts at {b!r} but stage 0 ends at {a!r}"]
    assert "final output against the whole model" in result.message
    assert result.rel_err is not None and result.rel_err > agreement.TOLERANCES["fp32"]


def test_a_stage_on_a_unit_its_engine_cannot_run_fails_that_stage(
        cpu: Unit, engines: dict[str, Engine]) -> None:
    _engine("torch", engines)
    model, graph = _network("mobilenet_v3_small")
    mid = _middle(graph)
    result = check_stages(model, graph, [("input", mid, cpu, "torch"),
                                         (mid, "output", cpu, "torch", {"cuda_graph": True})],
                          batch=BATCH, engines=engines)
    assert [s.status for s in result.stages] == ["pass", "fail"]
    assert "cuda_graph" in result.stages[1].message and not result.passed


def test_segments_with_the_same_weights_export_to_different_files(cpu: Unit) -> None:
    """The export cache key holds a traced segment's code, not only its classes and weights."""
    model, graph = _network("mobilenet_v3_small")
    for before, after in zip(graph.cuts, graph.cuts[1:], strict=False):
        a = segment_between(model, graph, "input", before.node)
        b = segment_between(model, graph, "input", after.node)
        same_weights = a.module.state_dict().keys() == b.module.state_dict().keys()
        if same_weights and a.input_shape == b.input_shape:
            break
    else:  # pragma: no cover - mobilenet has parameter-free activations between cuts
        pytest.fail("no two segments with the same weights")
    first, second = export_onnx(a), export_onnx(b)
    assert first.path != second.path and first.digest != second.digest
    assert export_onnx(a).path == first.path  # and the cache still hits


@pytest.mark.parametrize("name", CPU_ENGINES)
@pytest.mark.parametrize("batch", [1, 3])
def test_compute_matches_infer_for_whole_models(name: str, batch: int, cpu: Unit,
                                                engines: dict[str, Engine]) -> None:
    """The hand-off path gives what the numpy path gives, at a batch that splits and one that
    does not (OpenVINO splits batches over its requests)."""
    engine = _engine(name, engines)
    model = load_model("tests/tiny_models.py:tiny_cnn")
    runner = engine.build(model, cpu, batch, {})
    x = np.random.default_rng(1).standard_normal((batch, *model.input_shape)).astype(np.float32)
    expected = runner.infer(x)
    outs = runner.compute(torch.from_numpy(x).to(compute_device(cpu)))
    assert len(outs) == len(expected)
    for out, want in zip(outs, expected, strict=True):
        assert out.device.type == "cpu"
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="shape"):
        runner.compute(torch.zeros((batch + 1, *model.input_shape)))


@pytest.mark.parametrize("name", ["torch", "onnxruntime", "tensorrt"])
def test_segments_on_a_gpu_keep_compute_on_the_device(name: str,
                                                      engines: dict[str, Engine]) -> None:
    """On a `cuda` unit `compute()` takes and returns device tensors (TensorRT: its bindings)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    engine = _engine(name, engines)
    unit = discover().get("cuda:0/fp32")
    if unit is None or not engine.supports(unit):
        pytest.skip(f"engine {name} cannot run cuda:0/fp32 here")
    model, graph = _network("mobilenet_v3_small")
    mid = _middle(graph)
    runner = engine.build(segment_between(model, graph, mid, "output", 1), unit, BATCH, {})
    x = torch.randn((BATCH, *graph.cut(mid).tensor.shape), device=compute_device(unit))
    outs = runner.compute(x)
    assert all(o.device == compute_device(unit) for o in outs)
    result = check_stages(model, graph, [("input", mid, unit, name), (mid, "output", unit, name)],
                          batch=BATCH, engines={name: engine})
    assert result.passed, result.message
