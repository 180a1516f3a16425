"""Precision in the model: fp16/bf16 casts and int8 by Q/DQ, on the CPU engines.

Real models, real runtimes: a small network with normalisation and softmax islands is cast and
run by ONNX Runtime; the digits CNN (trained here in seconds) is quantized from its calibration
split and run by ONNX Runtime and OpenVINO on `cpu/int8` units, against its fp32 self and the
labels. The CLI is driven as a user would.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from infermux.errors import UsageError
from infermux.export import export_onnx
from infermux.models import ModelSpec, load_model
from infermux.quantize import (
    LOW_PRECISIONS,
    convert_precision,
    load_calibration,
    quantize_qdq,
    tensor_types,
)
from infermux.units import discover, select_units

from .conftest import invoke_cli

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
FLOAT = 1


class Islands(nn.Module):
    """Convolutions (cast to the low type) around a LayerNorm and a Softmax (kept in fp32)."""

    input_shape = (3, 16, 16)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        y = self.norm(y)
        return torch.softmax(self.head(y.flatten(1)), dim=1)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def _cache_env(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERMUX_CACHE_DIR", str(cache))


@pytest.fixture(scope="module")
def islands(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("islands") / "islands.onnx"
    with torch.inference_mode():
        torch.onnx.export(Islands().eval(), (torch.zeros(1, 3, 16, 16),), str(path),
                          dynamo=False, opset_version=17, input_names=["input"],
                          output_names=["output"],
                          dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    return path


def _types_by_op(model: object) -> dict[str, set[int]]:
    """The element types of each operator's float inputs and outputs, by operator type."""
    types = tensor_types(model)
    seen: dict[str, set[int]] = {}
    for node in model.graph.node:  # type: ignore[attr-defined]
        if node.op_type == "Cast":
            continue
        for name in [*node.input, *node.output]:
            if types.get(name) in (FLOAT, *LOW_PRECISIONS.values()):
                seen.setdefault(node.op_type, set()).add(types[name])
    return seen


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cast_model_has_the_intended_types_with_fp32_islands(islands: Path, cache: Path,
                                                             precision: str) -> None:
    out = convert_precision(islands, precision, root=cache)
    model = onnx.load(str(out.path))
    onnx.checker.check_model(model, full_check=True)
    low = LOW_PRECISIONS[precision]
    by_op = _types_by_op(model)
    assert by_op["Conv"] == {low} and by_op["Relu"] == {low}
    assert by_op["Gemm"] == {low} or by_op.get("MatMul") == {low}
    assert by_op["LayerNormalization"] == {FLOAT} and by_op["Softmax"] == {FLOAT}
    weights = {t.name: t.data_type for t in model.graph.initializer}
    assert Counter(weights.values())[low] >= 3  # conv and linear weights and biases, cast once
    # Inputs and outputs stay float32: the runners' buffers do not change.
    io = [model.graph.input[0], model.graph.output[0]]
    assert all(v.type.tensor_type.elem_type == FLOAT for v in io)
    if precision == "bf16":
        assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 22
    # Cached by content: asked again, the same file, not rewritten.
    stamp = out.path.stat().st_mtime_ns
    again = convert_precision(islands, precision, root=cache)
    assert again.path == out.path and again.path.stat().st_mtime_ns == stamp


def test_fp16_model_runs_in_onnxruntime_within_fp16_tolerance(islands: Path,
                                                              cache: Path) -> None:
    x = np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32)
    ref = ort.InferenceSession(str(islands), providers=["CPUExecutionProvider"]).run(
        None, {"input": x})[0]
    fp16 = convert_precision(islands, "fp16", root=cache)
    got = ort.InferenceSession(str(fp16.path), providers=["CPUExecutionProvider"]).run(
        None, {"input": x})[0]
    assert got.dtype == np.float32
    assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max()
    assert not np.array_equal(got, ref)  # it did compute in fp16
    np.testing.assert_array_equal(got.argmax(1), ref.argmax(1))


def test_bf16_values_round_to_nearest_even(islands: Path, cache: Path) -> None:
    """The bf16 weights are the fp32 weights rounded (not truncated) to 8 bits of mantissa."""
    from onnx import numpy_helper

    source = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(islands)).graph.initializer}
    model = onnx.load(str(convert_precision(islands, "bf16", root=cache).path))
    checked = 0
    for tensor in model.graph.initializer:
        name = tensor.name.removesuffix("__bf16")
        if tensor.data_type != LOW_PRECISIONS["bf16"] or name not in source:
            continue
        bits = np.frombuffer(tensor.raw_data, dtype=np.uint16).astype(np.uint32) << 16
        values = bits.view(np.float32).reshape(source[name].shape)
        want = torch.from_numpy(source[name]).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(values, want)
        checked += 1
    assert checked >= 3


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, SimpleNamespace]:
    """A small CNN fitted to scikit-learn's 8x8 digits (~99% top-1), as an ONNX file, and data.

    Random convolution features and a ridge-regression head solved in closed form: a real
    classifier in a second, where gradient training takes a minute on two busy cores.
    """
    from infermux.characterize.digits import digits_splits, load_digits_images

    torch.manual_seed(0)
    images, labels = load_digits_images()
    splits = digits_splits()
    x = torch.from_numpy(((images - 0.5) / 0.5)[:, None].astype(np.float32))
    features = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
                             nn.Flatten())
    with torch.no_grad():
        f = features(x[splits["train"]])
        f1 = torch.cat([f, torch.ones(len(f), 1)], 1)
        target = nn.functional.one_hot(torch.from_numpy(labels[splits["train"]]), 10).float()
        w = torch.linalg.solve(f1.T @ f1 + torch.eye(f1.shape[1]), f1.T @ target)
        head = nn.Linear(f.shape[1], 10)
        head.weight.copy_(w[:-1].T)
        head.bias.copy_(w[-1])
    net = nn.Sequential(features, head).eval()
    path = tmp_path_factory.mktemp("digits") / "digits8.onnx"
    with torch.inference_mode():
        torch.onnx.export(net, (x[:1],), str(path), dynamo=False, opset_version=17,
                          input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    test = splits["test"][:200]
    data = SimpleNamespace(x=x[test].numpy(), y=labels[test],
                           calibration=x[splits["calibration"]].numpy())
    return load_model(ModelSpec(str(path))), data


@pytest.mark.parametrize("engine_name", ["onnxruntime", "openvino"])
def test_qdq_model_on_cpu_int8_agrees_with_fp32_and_the_labels(digits: tuple, cache: Path,
                                                               tmp_path: Path,
                                                               engine_name: str) -> None:
    if engine_name == "openvino":
        pytest.importorskip("openvino")
    from infermux.engines import create_engine

    model, data = digits
    calibration = tmp_path / "calibration.npy"
    np.save(calibration, data.calibration)
    found = discover(with_runtimes=False)
    int8_unit, fp32_unit = select_units("cpu:0/int8,cpu:0", found)
    assert (int8_unit.id, int8_unit.mode) == ("cpu:0/int8", "int8")
    engine = create_engine(engine_name)
    batch = 40
    runner = engine.build(model, int8_unit, batch, {"calibration_data": str(calibration),
                                                    "calibration_items": 64})
    reference = engine.build(model, fp32_unit, batch)
    assert runner.options["model_precision"] == "int8"
    assert runner.options["precision"] == "int8"
    qdq = onnx.load(runner.options["onnx_file"])
    assert sum(n.op_type == "QuantizeLinear" for n in qdq.graph.node) >= 3
    x = data.x[:200]
    got = np.concatenate([runner.infer(x[i:i + batch])[0] for i in range(0, len(x), batch)])
    want = np.concatenate([reference.infer(x[i:i + batch])[0] for i in range(0, len(x), batch)])
    agree = float(np.mean(got.argmax(1) == want.argmax(1)))
    accuracy = (float(np.mean(got.argmax(1) == data.y[:200])),
                float(np.mean(want.argmax(1) == data.y[:200])))
    assert agree >= 0.97, f"int8 top-1 agrees with fp32 on {agree:.1%} of 200 items"
    assert accuracy[0] >= accuracy[1] - 0.03, f"int8 {accuracy[0]:.1%} vs fp32 {accuracy[1]:.1%}"
    assert np.abs(got - want).max() <= 0.15 * np.abs(want).max()  # the int8 tolerance
    engine.release()


def test_qdq_models_are_cached_by_model_data_and_method(digits: tuple, cache: Path) -> None:
    model, data = digits
    exported = export_onnx(model, root=cache)
    first = quantize_qdq(exported, data.calibration[:32], root=cache)
    stamp = first.path.stat().st_mtime_ns
    assert quantize_qdq(exported, data.calibration[:32], root=cache).path.stat().st_mtime_ns == stamp
    others = {quantize_qdq(exported, data.calibration[:16], root=cache).path,
              quantize_qdq(exported, data.calibration[:32], method="percentile", root=cache).path}
    assert first.path not in others and len(others) == 2
    with pytest.raises(UsageError, match="method 'kl'"):
        quantize_qdq(exported, data.calibration[:8], method="kl", root=cache)


def test_calibration_from_an_npy_file_and_its_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.npy"
    np.save(good, np.ones((3, 1, 4, 4), np.float32))
    items = load_calibration(str(good), (1, 4, 4), 5)
    assert items.shape == (5, 1, 4, 4)  # three items cycled over five
    random = load_calibration("random", (1, 4, 4), 4)
    assert random.shape == (4, 1, 4, 4) and random.std() > 0.5
    with pytest.raises(UsageError) as info:
        load_calibration(str(good), (3, 8, 8), 2)
    assert "(3, 1, 4, 4)" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UsageError, match="not a folder or a .npy file"):
        load_calibration(str(tmp_path / "missing"), (1, 4, 4), 2)


def test_cpu_int8_units_are_served_only_by_engines_that_run_them(tiny_factory: str) -> None:
    from infermux.engines import create_engine
    from infermux.engines.select import engines_for
    from infermux.runtime.plan import _check_unit

    model = load_model(ModelSpec(f"{tiny_factory}:build"))
    found = discover(with_runtimes=False)
    units = select_units("cpu/int8", found)
    served = {name for _, name in engines_for("auto", units, model)}
    assert "torch" not in served and served & {"onnxruntime", "openvino"}
    with pytest.raises(UsageError, match="torch engine has no int8 path"):
        engines_for("torch", units, model)
    with pytest.raises(UsageError, match="fp32 or int8"):
        select_units("cpu:0/fp16", found)
    assert _check_unit("cpu:0-1/int8") == "cpu:0-1/int8"
    with pytest.raises(UsageError, match="cpu/int8"):
        create_engine("onnxruntime").build(model, select_units("cpu:0", found)[0], 1,
                                           {"int8": True})


def test_tensorrt_provider_follows_the_typing_of_the_installed_release() -> None:
    from infermux.engines.onnxruntime import OrtOptions, model_precision, provider_config
    from infermux.engines.onnxruntime import trt_typing as typing
    from infermux.units import Unit

    assert typing("auto", 11) == "strong" and typing("auto", 10) == "weak"
    assert typing("auto", None) == "weak" and typing("strong", 10) == "strong"
    unit = Unit("cuda:0/fp16", "cuda", "cuda:0", "fp16", "GPU", "cuda:0")
    strong = OrtOptions(provider="tensorrt", fp16=True, trt_typing="strong")
    weak = OrtOptions(provider="tensorrt", fp16=True, trt_typing="weak",
                      reuse_timing_cache=False)
    assert model_precision(unit, strong) == "fp16" and model_precision(unit, weak) == "fp32"
    strong_trt = provider_config(unit, strong, Path("/c"))[0][1]
    weak_trt = provider_config(unit, weak, Path("/c"))[0][1]
    assert strong_trt["trt_fp16_enable"] == "False"  # the model is fp16; no flag exists in 11
    assert weak_trt["trt_fp16_enable"] == "True"
    assert weak_trt["trt_timing_cache_enable"] == "False"


def test_bench_cli_runs_cpu_int8_and_refuses_torch(tiny_factory: str, db: Path,
                                                   cache: Path) -> None:
    env = {"INFERMUX_CACHE_DIR": str(cache)}
    proc = invoke_cli("bench", "--model", f"{tiny_factory}:build", "--units", "cpu:0/int8",
                      "--engine", "onnxruntime", "--batch", "4", "--min-duration", "0.3s",
                      "--min-queries", "16", "--warmup", "0.1s", "--telemetry", "off",
                      "--option", "calibration_items=16", "--db", str(db), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    row = rows["results"][0] if isinstance(rows, dict) else rows[0]
    text = json.dumps(row)
    assert "cpu:0/int8" in text and '"model_precision": "int8"' in text
    bad = invoke_cli("bench", "--model", f"{tiny_factory}:build", "--units", "cpu:0/int8",
                     "--engine", "torch", "--batch", "4", "--no-store", env=env)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "onnxruntime or openvino" in bad.stderr.strip().splitlines()[-1]


def test_quantize_cli_writes_the_model_and_records_the_run(tiny_factory: str, db: Path,
                                                           cache: Path, tmp_path: Path) -> None:
    import sqlite3

    env = {"INFERMUX_CACHE_DIR": str(cache)}
    target = tmp_path / "tiny-fp16.onnx"
    proc = invoke_cli("quantize", "--model", f"{tiny_factory}:build", "--precision", "fp16",
                      "--output", str(target), "--db", str(db), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["model_precision"] == "fp16" and result["tensor_types"].get("float16", 0) > 0
    assert target.is_file() and onnx.load(str(target)).graph.input[0].type.tensor_type.elem_type == 1
    with sqlite3.connect(db) as conn:
        kind, status = conn.execute("SELECT kind, status FROM runs WHERE id = ?",
                                    (result["run_id"],)).fetchone()
    assert (kind, status) == ("quantize", "complete")
    bad = invoke_cli("quantize", "--model", f"{tiny_factory}:build", "--precision", "fp8",
                     "--no-store", env=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "fp16, bf16 or int8" in bad.stderr.strip().splitlines()[-1]
