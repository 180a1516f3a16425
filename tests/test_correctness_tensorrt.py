"""TensorRT on a second GPU and with several inputs (skipped without TensorRT and the GPUs)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

TINY = str(Path(__file__).parent / "engine_models" / "tinycnn.py")


def _need(gpus: int) -> None:
    if importlib.util.find_spec("tensorrt") is None:
        pytest.skip("TensorRT is not installed here (pip install tensorrt, on an NVIDIA GPU)")
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPU(s); {torch.cuda.device_count()} here")


class TwoInputs(nn.Module):
    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x * 2 + bias


def test_every_input_of_a_two_input_network_is_bound_and_profiled(tmp_path, monkeypatch):
    _need(1)
    from infermux.engines import create_engine
    from infermux.models import ModelSpec, load_model
    from infermux.units import discover

    monkeypatch.setenv("INFERMUX_CACHE_DIR", str(tmp_path))
    path = tmp_path / "two.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(TwoInputs(), (torch.ones(1, 4), torch.ones(1, 4)), str(path),
                          dynamo=False, input_names=["input", "bias"], output_names=["output"],
                          dynamic_axes={n: {0: "batch"} for n in ("input", "bias", "output")})
    model = load_model(ModelSpec(str(path)))
    unit = discover().get("cuda:0/fp32")
    assert unit is not None
    runner = create_engine("tensorrt").build(model, unit, 2, {})
    out = runner.infer(np.ones((2, 4), np.float32))[0]
    np.testing.assert_allclose(out, 2.0)  # the second input is bound, and holds zeros


def test_an_engine_for_the_second_gpu_runs_on_it(tmp_path, monkeypatch):
    _need(2)
    from infermux import agreement
    from infermux.engines import create_engine
    from infermux.models import load_model
    from infermux.units import discover

    monkeypatch.setenv("INFERMUX_CACHE_DIR", str(tmp_path))
    model = load_model(f"{TINY}:build")
    unit = discover().get("cuda:1/fp32")
    assert unit is not None
    runner = create_engine("tensorrt").build(model, unit, 2, {})
    assert runner._x_dev.device == torch.device("cuda", 1)
    assert runner.run().latency_ns > 0
    assert agreement.check(runner, agreement.reference_for(model)).status == "pass"


@pytest.mark.parametrize(("mode", "options", "tolerance"), [
    ("fp16", {}, 2e-2), ("bf16", {}, 8e-2), ("fp16", {"int8": True}, 2e-1)])
def test_each_precision_builds_on_the_installed_release_and_agrees_with_fp32(
        tmp_path, monkeypatch, mode, options, tolerance):
    """The path the installed TensorRT takes (strongly typed on 11, flags on 10) builds and
    agrees with the fp32 engine; the runner says which path and which precision it used."""
    _need(1)
    import tensorrt as trt

    from infermux.engines import create_engine
    from infermux.engines.tensorrt import trt_api
    from infermux.models import load_model
    from infermux.units import discover

    monkeypatch.setenv("INFERMUX_CACHE_DIR", str(tmp_path))
    found = discover()
    unit, fp32 = found.get(f"cuda:0/{mode}"), found.get("cuda:0/fp32")
    if unit is None or not unit.available:
        pytest.skip(f"this GPU has no usable cuda:0/{mode} unit")
    model = load_model(f"{TINY}:build")
    engine = create_engine("tensorrt")
    x = np.random.default_rng(0).standard_normal((4, *model.input_shape)).astype(np.float32)
    want = engine.build(model, fp32, 4, {}).infer(x)[0]
    runner = engine.build(model, unit, 4, options)
    got = runner.infer(x)[0]
    api = trt_api(trt)
    assert runner.options["typing"] == ("weak" if api.precision_flags else "strong")
    if runner.options["typing"] == "strong":
        assert runner.options["model_precision"] == ("int8" if options else mode)
    assert np.abs(got - want).max() <= tolerance * max(1.0, float(np.abs(want).max()))
