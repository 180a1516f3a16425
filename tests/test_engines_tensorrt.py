"""TensorRT: configuration translation, cache keys and calibration data, which need no GPU.

Building and running engines needs TensorRT and an NVIDIA GPU; those tests skip with the reason.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from infermux.engines.tensorrt import (
    TrtOptions,
    build_plan,
    calibration_batches,
    engine_cache_key,
)
from infermux.errors import UsageError
from infermux.units import Unit

TINY = str(Path(__file__).parent / "engine_models" / "tinycnn.py")


def _unit(uid: str) -> Unit:
    kind, _, rest = uid.partition(":")
    device, _, mode = rest.partition("/")
    return Unit(uid, kind, f"{kind}:{device}", mode, uid, f"{kind}:{device}")


@pytest.mark.parametrize(("uid", "options", "set_flags", "clear", "device", "graph"), [
    ("cuda:0/fp32", {}, (), ("TF32",), "gpu", True),
    ("cuda:0/tf32", {}, (), (), "gpu", True),
    ("cuda:1/fp16", {}, ("FP16",), (), "gpu", True),
    ("cuda:0/bf16", {}, ("BF16",), (), "gpu", True),
    ("cuda:0/fp16", {"int8": True, "calibration_data": "random"}, ("FP16", "INT8"), (), "gpu", True),
    ("dla:0/fp16", {}, ("FP16", "GPU_FALLBACK"), (), "dla", False),
    ("dla:1/fp16", {"gpu_fallback": False}, ("FP16",), (), "dla", False),
    ("dla:1/int8", {"calibration_data": "random"}, ("FP16", "INT8", "GPU_FALLBACK"), (), "dla",
     False),
])
def test_units_and_options_translate_to_builder_flags(uid: str, options: dict, set_flags: tuple,
                                                      clear: tuple, device: str,
                                                      graph: bool) -> None:
    plan = build_plan(_unit(uid), TrtOptions(**options))
    assert plan.set_flags == set_flags and plan.clear_flags == clear
    assert plan.device == device and plan.cuda_graph is graph
    assert plan.device_index == int(uid.split(":")[1][0])
    assert plan.calibrate is ("INT8" in set_flags)


@pytest.mark.parametrize(("uid", "options", "needle"), [
    ("cpu", {}, "cannot run on unit 'cpu'"),
    ("dla:0/int8", {}, "calibration_data"),
    ("dla:0/fp16", {"cuda_graph": True}, "cuda_graph"),
    ("cuda:0/fp16", {"gpu_fallback": True}, "gpu_fallback"),
    ("cuda:0/fp16", {"int8": True, "calibration_data": "/no/such/folder"}, "not a folder"),
])
def test_impossible_configurations_are_one_clear_line(uid: str, options: dict,
                                                      needle: str) -> None:
    unit = Unit("cpu", "cpu", "cpu", "fp32", "cpu", "cpu:host") if uid == "cpu" else _unit(uid)
    with pytest.raises(UsageError) as info:
        build_plan(unit, TrtOptions(**options))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_engine_cache_key_changes_with_everything_that_shapes_an_engine(tmp_path: Path) -> None:
    fp16 = build_plan(_unit("cuda:0/fp16"), TrtOptions())
    base = engine_cache_key("abc", fp16, 8, "10.3.0", "NVIDIA H200")
    assert base == engine_cache_key("abc", fp16, 8, "10.3.0", "NVIDIA H200")  # stable
    graphless = build_plan(_unit("cuda:0/fp16"), TrtOptions(cuda_graph=False))
    assert engine_cache_key("abc", graphless, 8, "10.3.0", "NVIDIA H200") == base  # run-time only
    others = {
        engine_cache_key("abd", fp16, 8, "10.3.0", "NVIDIA H200"),
        engine_cache_key("abc", fp16, 16, "10.3.0", "NVIDIA H200"),
        engine_cache_key("abc", fp16, 8, "10.4.0", "NVIDIA H200"),
        engine_cache_key("abc", fp16, 8, "10.3.0", "Orin"),
        engine_cache_key("abc", build_plan(_unit("cuda:0/fp32"), TrtOptions()), 8, "10.3.0",
                         "NVIDIA H200"),
        engine_cache_key("abc", build_plan(_unit("dla:0/fp16"), TrtOptions()), 8, "10.3.0",
                         "NVIDIA H200"),
        engine_cache_key("abc", build_plan(_unit("dla:1/fp16"), TrtOptions()), 8, "10.3.0",
                         "NVIDIA H200"),
    }
    assert base not in others and len(others) == 7
    # Calibration data is part of the key: new images, new engine.
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"x")
    int8 = build_plan(_unit("dla:0/int8"), TrtOptions(calibration_data=str(folder)))
    before = engine_cache_key("abc", int8, 8, "10.3.0", "Orin")
    (folder / "b.png").write_bytes(b"y")
    assert engine_cache_key("abc", int8, 8, "10.3.0", "Orin") != before


def test_calibration_batches_from_an_image_folder(tmp_path: Path) -> None:
    from PIL import Image

    for i in range(3):  # images of another size than the model's input
        Image.new("RGB", (50, 40), (60 * i, 60 * i, 60 * i)).save(tmp_path / f"{i}.png")
    (tmp_path / "notes.txt").write_text("not an image")
    batches = list(calibration_batches(str(tmp_path), (3, 32, 32), batch=2, items=5))
    assert len(batches) == 3 and all(b.shape == (2, 3, 32, 32) for b in batches)
    assert all(b.dtype == np.float32 for b in batches)
    # Image 0 is black: normalised, its red channel is -mean/std.
    assert np.allclose(batches[0][0, 0], -0.485 / 0.229, atol=1e-5)
    assert not np.allclose(batches[0][0], batches[0][1])  # the next image, not a copy
    assert np.allclose(batches[1][1], batches[0][0])  # three images cycle over six items


def test_calibration_batches_generated_and_empty_folder(tmp_path: Path) -> None:
    random = list(calibration_batches("random", (3, 8, 8), batch=4, items=8))
    assert len(random) == 2 and random[0].shape == (4, 3, 8, 8)
    with pytest.raises(UsageError, match=r"no \.jpg/\.png images"):
        list(calibration_batches(str(tmp_path), (3, 8, 8), batch=4, items=8))


def test_engine_says_how_to_install_tensorrt_when_absent() -> None:
    from infermux.engines import engine_status

    ok, why = engine_status()["tensorrt"]
    assert ok == (importlib.util.find_spec("tensorrt") is not None)
    if not ok:
        assert "pip install tensorrt" in why


def test_build_and_run_on_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("tensorrt") is None:
        pytest.skip("TensorRT is not installed here (pip install tensorrt, on an NVIDIA GPU)")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("TensorRT needs a CUDA GPU; none here")
    from infermux import agreement
    from infermux.engines import create_engine
    from infermux.models import load_model
    from infermux.units import discover

    monkeypatch.setenv("INFERMUX_CACHE_DIR", str(tmp_path))
    model = load_model(f"{TINY}:build")
    unit = discover().get("cuda:0/fp32")
    assert unit is not None
    engine = create_engine("tensorrt")
    runner = engine.build(model, unit, 4, {})
    assert runner.run().latency_ns > 0
    assert agreement.check(runner, agreement.reference_for(model)).status == "pass"
    assert list((tmp_path / "tensorrt").glob("*.engine")) and list(
        (tmp_path / "tensorrt").glob("timing-*.cache"))
    engine.release()
    again = create_engine("tensorrt").build(model, unit, 4, {})  # from the engine cache
    assert again.build_s < runner.build_s
