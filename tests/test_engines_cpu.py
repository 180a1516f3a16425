"""Every engine usable on this machine's CPU: agreement with PyTorch, batch sizes, bad input.

Parametrized over the engine registry, so an engine registered tomorrow is tested today; engines
not installed (or without a CPU path, like TensorRT) are skipped with the reason.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from infermux import agreement
from infermux.engines import create_engine, engine_status, list_engines
from infermux.errors import RunError, UsageError
from infermux.export import export_onnx
from infermux.models import LoadedModel, ModelSpec, load_model
from infermux.units import Unit, discover, select_units

TINY = str(Path(__file__).parent / "engine_models" / "tinycnn.py")
ONNX_ENGINES = ("onnxruntime", "openvino")


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(f"{TINY}:build")


@pytest.fixture(scope="module")
def mobilenet() -> LoadedModel:
    return load_model("mobilenet_v3_small")


def _engine(name: str):
    ok, why = engine_status()[name]
    if not ok:
        pytest.skip(f"engine {name} not usable here: {why}")
    engine = create_engine(name)
    if "cpu" not in engine.unit_kinds:
        pytest.skip(f"engine {name} has no CPU path (it runs {', '.join(engine.unit_kinds)})")
    return engine


@pytest.mark.parametrize("name", list_engines())
def test_every_engine_agrees_with_pytorch_on_a_custom_cnn(name: str, cpu: Unit,
                                                          tiny: LoadedModel) -> None:
    engine = _engine(name)
    reference = agreement.reference_for(tiny)
    for batch in (1, 3, 8):  # the export used batch 1; others must work from the same file
        runner = engine.build(tiny, cpu, batch, {})
        timing = runner.run()
        assert timing.latency_ns > 0
        result = agreement.check(runner, reference)
        assert result.status == "pass", result.message
        assert result.rel_err is not None and result.rel_err < 1e-3
        assert result.top1 == 1.0 and result.precision == "fp32"
        if name != "torch":  # the torch runner computes in its unit's mode (fp32 here)
            assert runner.options["precision"] == "fp32"
    getattr(engine, "release", lambda: None)()


@pytest.mark.parametrize("name", ONNX_ENGINES)
def test_onnx_engines_run_mobilenet_like_pytorch(name: str, cpu: Unit,
                                                 mobilenet: LoadedModel) -> None:
    engine = _engine(name)
    runner = engine.build(mobilenet, cpu, 2, {"warmup_iters": 1})
    result = agreement.check(runner, agreement.reference_for(mobilenet, items=2))
    assert result.status == "pass", result.message
    assert runner.options["onnx_file"].endswith(".onnx")
    engine.release()


def test_a_wrong_engine_result_fails_loudly(cpu: Unit, tiny: LoadedModel) -> None:
    """A runner of other weights stands for an engine that computes the wrong thing."""
    import torch

    engine = _engine("onnxruntime")
    other = load_model(f"{TINY}:build")
    with torch.no_grad():
        other.module.head.weight.mul_(-1.0)
    runner = engine.build(other, cpu, 4, {})
    result = agreement.check(runner, agreement.reference_for(tiny))
    assert result.status == "fail" and not result.passed
    assert "relative error" in result.message


@pytest.mark.parametrize("name", ONNX_ENGINES)
def test_corrupt_onnx_file_is_rejected_with_one_clear_message(name: str, cpu: Unit,
                                                              tmp_path: Path) -> None:
    engine = _engine(name)
    bad = tmp_path / "corrupt.onnx"
    bad.write_bytes(b"\x08\x07garbage that is no protobuf of a model" * 10)
    with pytest.raises(UsageError) as info:
        model = load_model(ModelSpec(str(bad), input_shape=(3, 32, 32)))
        engine.build(model, cpu, 1, {})
    message = str(info.value)
    assert "corrupt.onnx" in message and "\n" not in message


@pytest.mark.parametrize("name", ONNX_ENGINES)
def test_user_onnx_file_with_fixed_batch(name: str, cpu: Unit, tiny: LoadedModel,
                                         tmp_path: Path) -> None:
    import torch

    fixed = tmp_path / "fixed.onnx"
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notice
        warnings.simplefilter("ignore")
        torch.onnx.export(tiny.module, (torch.zeros(1, 3, 32, 32),), str(fixed), dynamo=False,
                          opset_version=17)
    engine = _engine(name)
    model = load_model(str(fixed))
    runner = engine.build(model, cpu, 1, {})
    ref = agreement.reference_for(model, items=1)
    assert ref.source == "onnxruntime-fp32-cpu"
    assert agreement.check(runner, ref).status == "pass"
    if name == "onnxruntime":  # ONNX Runtime cannot change a fixed batch: say so
        with pytest.raises(UsageError, match="fixed batch of 1"):
            engine.build(model, cpu, 4, {})
    else:  # OpenVINO reshapes the graph to the batch asked for
        assert engine.build(model, cpu, 4, {}).infer(np.zeros((4, 3, 32, 32), np.float32))


@pytest.mark.parametrize(("name", "options", "needle"), [
    ("onnxruntime", {"intra_op_threads": 0}, "intra_op_threads"),
    ("onnxruntime", {"graph_optimization": "max"}, "graph_optimization"),
    ("onnxruntime", {"no_such_option": 1}, "no_such_option"),
    ("onnxruntime", {"fp16": True}, "TensorRT"),
    ("openvino", {"hint": "fastest"}, "hint"),
    ("openvino", {"precision": "bf16"}, "openvino:CPU"),
    ("openvino", {"requests": 0}, "requests"),
])
def test_bad_options_are_one_line_naming_the_option(name: str, options: dict, needle: str,
                                                    cpu: Unit, tiny: LoadedModel) -> None:
    engine = _engine(name)
    with pytest.raises(UsageError) as info:
        engine.build(tiny, cpu, 1, options)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_onnxruntime_core_set_threads_and_pinning(tiny: LoadedModel) -> None:
    from infermux.engines.onnxruntime import OrtOptions, _thread_affinities

    found = discover(with_runtimes=False)
    unit = select_units("cpu:0", found)[0]
    opts = OrtOptions().resolve(unit)
    assert opts.intra_op_threads == 1 and opts.pin_threads is True
    assert OrtOptions().resolve(found.get("cpu")).pin_threads is False  # the whole CPU
    assert _thread_affinities((4, 5, 6, 7), 4) == "6;7;8"  # 1-based, the caller's thread unpinned
    runner = _engine("onnxruntime").build(tiny, unit, 2, {})
    assert runner.options["intra_op_threads"] == 1


def test_onnxruntime_gpu_units_need_the_gpu_providers(tiny: LoadedModel) -> None:
    import onnxruntime as ort

    from infermux.engines.onnxruntime import OrtOptions, provider_config

    gpu = Unit("cuda:1/fp16", "cuda", "cuda:1", "fp16", "H200", "cuda:1")
    dla = Unit("dla:1/int8", "dla", "dla:1", "int8", "DLA core 1", "jetson:dram")
    trt_opts = OrtOptions(engine_cache_dir="/c").resolve(gpu)
    names = [p for p, _ in provider_config(gpu, trt_opts, Path("/x"))]
    assert names == ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    trt = provider_config(gpu, trt_opts, Path("/x"))[0][1]
    assert trt["trt_fp16_enable"] == "True" and trt["device_id"] == "1"
    assert trt["trt_engine_cache_enable"] == "True" and trt["trt_engine_cache_path"] == "/c"
    dla_trt = provider_config(dla, OrtOptions().resolve(dla), Path("/x"))[0][1]
    assert dla_trt["trt_dla_enable"] == "True" and dla_trt["trt_dla_core"] == "1"
    assert dla_trt["trt_int8_enable"] == "True"
    fp32 = Unit("cuda:0/fp32", "cuda", "cuda:0", "fp32", "H200", "cuda:0")
    cuda = provider_config(fp32, OrtOptions().resolve(fp32), Path("/x"))
    assert cuda[0][0] == "CUDAExecutionProvider" and cuda[0][1]["use_tf32"] == "0"
    with pytest.raises(UsageError, match="provider=cuda"):
        OrtOptions(provider="cuda").resolve(gpu)
    with pytest.raises(UsageError, match="bf16"):
        OrtOptions().resolve(Unit("cuda:0/bf16", "cuda", "cuda:0", "bf16", "H200", "cuda:0"))
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(UsageError, match="onnxruntime-gpu"):
            create_engine("onnxruntime").build(tiny, fp32, 1, {})


def test_openvino_throughput_runner_keeps_requests_in_flight(cpu: Unit,
                                                             tiny: LoadedModel) -> None:
    engine = _engine("openvino")
    runner = engine.build(tiny, cpu, 4, {"requests": 3})
    assert runner.options["requests"] == 3 and runner.options["hint"] == "throughput"
    timings = [runner.run() for _ in range(20)]  # one finished batch per call
    assert all(t.latency_ns > 0 for t in timings)
    # Correct outputs even straight after pipelined runs: set_input waits for the pool first.
    result = agreement.check(runner, agreement.reference_for(tiny))
    assert result.status == "pass", result.message
    latency = engine.build(tiny, cpu, 4, {"hint": "latency"})
    assert latency.options["requests"] == 1
    engine.release()


def test_openvino_units_report_the_precision_they_compute_in(tiny: LoadedModel) -> None:
    engine = _engine("openvino")
    found = discover()
    unit = found.get("openvino:CPU")
    if unit is None:
        pytest.skip("OpenVINO reports no CPU device here")
    runner = engine.build(tiny, unit, 2, {"precision": "f32"})
    assert runner.options["precision"] == "fp32"
    auto = engine.build(tiny, unit, 2, {})
    assert auto.options["precision"] in ("fp32", "bf16", "fp16")  # the device's choice, read back
    result = agreement.check(auto, agreement.reference_for(tiny))
    assert result.status == "pass", result.message
    # u8 on a float model: the Q/DQ model is made from calibration data (here seeded noise).
    u8 = engine.build(tiny, unit, 2, {"precision": "u8", "calibration_items": 8})
    assert u8.options["precision"] == "int8" and u8.options["model_precision"] == "int8"
    assert u8.options["calibration_data"] == "random"


def test_export_of_unexportable_model_fails_the_build_naming_the_operator(cpu: Unit) -> None:
    engine = _engine("onnxruntime")
    model = load_model(f"{TINY}:build_unexportable")
    with pytest.raises(RunError, match="aten::linalg_eigvals"):
        engine.build(model, cpu, 1, {})


def test_engines_share_one_export(cpu: Unit, tiny: LoadedModel) -> None:
    paths = {_engine(n).build(tiny, cpu, 1, {}).options["onnx_file"] for n in ONNX_ENGINES}
    assert len(paths) == 1 and paths == {str(export_onnx(tiny).path)}


CLASSES = '''
import torch
from torch import nn


class Classes(nn.Module):
    """Scores, the best class (int64) and whether each score is positive (bool)."""

    input_shape = (12,)

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        scores = self.head(x)
        return scores, scores.argmax(1), scores > 0


def build():
    torch.manual_seed(0)
    return Classes()
'''


@pytest.mark.parametrize("name", ["torch", *ONNX_ENGINES])
def test_integer_and_bool_outputs_come_back_as_themselves(name: str, cpu: Unit,
                                                          tmp_path: Path) -> None:
    """A float output is float32 whatever it was computed in; a class id stays int64 and a
    flag bool (they were float32 copies, which rounds ids past 2**24 and makes flags 0.0/1.0)."""
    import torch

    path = tmp_path / "classes.py"
    path.write_text(CLASSES)
    model = load_model(f"{path}:build")
    x = np.random.default_rng(0).standard_normal((4, 12)).astype(np.float32)
    with torch.no_grad():
        want = [t.numpy() for t in model.module(torch.from_numpy(x))]
    runner = _engine(name).build(model, cpu, 4, {})
    runner.infer(x)
    scores, label, positive = runner.outputs()
    assert (scores.dtype, label.dtype, positive.dtype) == (np.float32, np.int64, np.bool_)
    np.testing.assert_allclose(scores, want[0], atol=1e-5)
    np.testing.assert_array_equal(label, want[1])
    np.testing.assert_array_equal(positive, want[2])
