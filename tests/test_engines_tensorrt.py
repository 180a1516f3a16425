"""TensorRT: configuration translation, version dispatch, cache keys and calibration data.

These need no GPU. The dispatch between TensorRT 11 (strongly typed) and TensorRT 10 (precision
flags, calibrators, DLA) is tested against objects shaped like each module's API: only the
presence of attributes is imitated, never TensorRT's behaviour. Building and running engines
needs TensorRT and an NVIDIA GPU; those tests skip with the reason.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from infermux.engines.base import parse_options
from infermux.engines.tensorrt import (
    TRT10_API,
    TrtOptions,
    build_plan,
    calibration_batches,
    engine_cache_key,
    network_flags,
    timing_cache_name,
    trt_api,
)
from infermux.errors import UsageError
from infermux.units import Unit

TINY = str(Path(__file__).parent / "engine_models" / "tinycnn.py")


def _module(version: str, *, flags: bool, calibrators: bool, strong_flag: bool) -> SimpleNamespace:
    """An object with the attributes one TensorRT release's module has (the API's shape only)."""
    builder_flags = ["TF32", "GPU_FALLBACK", "REFIT"] + (["FP16", "BF16", "INT8"] if flags else [])
    creation = ["EXPLICIT_BATCH"] if version.startswith(("8", "10")) else []
    creation += ["STRONGLY_TYPED"] if strong_flag else []
    shape = SimpleNamespace(
        __version__=version,
        BuilderFlag=SimpleNamespace(**{f: i for i, f in enumerate(builder_flags)}),
        NetworkDefinitionCreationFlag=SimpleNamespace(**{f: i for i, f in enumerate(creation)}),
    )
    if calibrators:
        shape.IInt8EntropyCalibrator2 = object
    return shape


TRT11 = _module("11.4.1", flags=False, calibrators=False, strong_flag=True)
TRT10 = _module("10.3.0", flags=True, calibrators=True, strong_flag=True)
TRT86 = _module("8.6.2", flags=True, calibrators=True, strong_flag=False)


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
    plan = build_plan(_unit(uid), TrtOptions(**options), trt_api(TRT10))
    assert plan.typing == "weak" and plan.model_precision == "fp32"
    assert plan.set_flags == set_flags and plan.clear_flags == clear
    assert plan.device == device and plan.cuda_graph is graph
    assert plan.device_index == int(uid.split(":")[1][0])
    assert plan.calibrate is ("INT8" in set_flags)


def test_api_shapes_are_told_apart_by_what_the_module_has() -> None:
    new, old, oldest = trt_api(TRT11), trt_api(TRT10), trt_api(TRT86)
    assert (new.precision_flags, new.calibrators, new.strongly_typed, new.major) == (
        False, False, True, 11)
    assert (old.precision_flags, old.calibrators, old.strongly_typed, old.major) == (
        True, True, True, 10)
    assert (oldest.precision_flags, oldest.strongly_typed) == (True, False)
    assert old == TRT10_API  # the default shape of build_plan
    # A module without the STRONGLY_TYPED name and without precision flags is strongly typed
    # all the same (every TensorRT 11 network is).
    bare = _module("12.0.0", flags=False, calibrators=False, strong_flag=False)
    assert trt_api(bare).strongly_typed


@pytest.mark.parametrize(("uid", "options", "precision", "clear", "calibrate"), [
    ("cuda:0/fp32", {}, "fp32", ("TF32",), False),
    ("cuda:0/tf32", {}, "fp32", (), False),
    ("cuda:0/fp16", {}, "fp16", (), False),
    ("cuda:0/bf16", {}, "bf16", (), False),
    ("cuda:0/fp16", {"int8": True}, "int8", (), False),
])
def test_tensorrt_11_builds_are_strongly_typed_with_the_precision_in_the_model(
        uid: str, options: dict, precision: str, clear: tuple, calibrate: bool) -> None:
    plan = build_plan(_unit(uid), TrtOptions(**options), trt_api(TRT11))
    assert plan.typing == "strong" and plan.model_precision == precision
    assert plan.set_flags == () and plan.clear_flags == clear  # no precision flag: none exist
    assert plan.calibrate is calibrate  # the Q/DQ model was calibrated, not the builder
    if precision == "int8":
        assert plan.calibration_data == "random"  # no data given: seeded noise, timing only
    # The same units on TensorRT 10 keep the flags, unless strong typing is asked for.
    assert build_plan(_unit(uid), TrtOptions(**options), trt_api(TRT10)).typing == "weak"
    strong10 = build_plan(_unit(uid), TrtOptions(typing="strong", **options), trt_api(TRT10))
    assert strong10.typing == "strong" and strong10.model_precision == precision


def test_network_flags_follow_the_typing_and_the_module() -> None:
    assert network_flags(TRT11, "strong") == 1 << TRT11.NetworkDefinitionCreationFlag.STRONGLY_TYPED
    assert network_flags(TRT10, "weak") == 1 << TRT10.NetworkDefinitionCreationFlag.EXPLICIT_BATCH
    assert network_flags(TRT10, "strong") == 1 << TRT10.NetworkDefinitionCreationFlag.STRONGLY_TYPED
    assert network_flags(TRT11, "weak") == 0  # no EXPLICIT_BATCH left to set


@pytest.mark.parametrize(("module", "uid", "options", "needle"), [
    (TRT11, "dla:0/fp16", {}, "needs TensorRT 10 (JetPack 6)"),
    (TRT11, "dla:0/int8", {}, "needs TensorRT 10 (JetPack 6)"),
    (TRT11, "cuda:0/fp16", {"typing": "weak"}, "no precision flags"),
    (TRT10, "dla:0/fp16", {"typing": "strong"}, "DLA builds are weakly typed"),
    (TRT86, "cuda:0/fp16", {"typing": "strong"}, "no strongly typed networks"),
])
def test_what_a_release_cannot_build_is_one_clear_line(module: SimpleNamespace, uid: str,
                                                       options: dict, needle: str) -> None:
    with pytest.raises(UsageError) as info:
        build_plan(_unit(uid), TrtOptions(**options), trt_api(module))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_timing_cache_is_keyed_by_release_device_and_timing_options() -> None:
    fp16 = build_plan(_unit("cuda:0/fp16"), TrtOptions(), trt_api(TRT10))
    name = timing_cache_name(fp16, "10.3.0", "NVIDIA H200")
    assert name == timing_cache_name(fp16, "10.3.0", "NVIDIA H200")
    strong = build_plan(_unit("cuda:0/fp16"), TrtOptions(), trt_api(TRT11))
    level = build_plan(_unit("cuda:0/fp16"), TrtOptions(builder_optimization_level=5),
                       trt_api(TRT10))
    others = {timing_cache_name(fp16, "10.4.0", "NVIDIA H200"),
              timing_cache_name(fp16, "10.3.0", "NVIDIA H100 80GB HBM3"),
              timing_cache_name(strong, "11.4.1", "NVIDIA H200"),
              timing_cache_name(level, "10.3.0", "NVIDIA H200")}
    assert name not in others and len(others) == 4
    # Not reusing the timing cache is an explicit choice, and a different engine.
    fresh = build_plan(_unit("cuda:0/fp16"), TrtOptions(reuse_timing_cache=False), trt_api(TRT10))
    assert not fresh.reuse_timing_cache
    assert engine_cache_key("abc", fresh, 8, "10.3.0", "H200") != engine_cache_key(
        "abc", fp16, 8, "10.3.0", "H200")


@pytest.mark.parametrize(("uid", "options", "needle"), [
    ("cpu", {}, "cannot run on unit 'cpu'"),
    ("dla:0/int8", {"calibration_data": "/no/such/images"}, "calibration_data"),
    ("dla:0/fp16", {"cuda_graph": True}, "cuda_graph"),
    ("cuda:0/fp16", {"gpu_fallback": True}, "gpu_fallback"),
    ("cuda:0/fp16", {"int8": True, "calibration_data": "/no/such/folder"}, "not a folder"),
    ("cuda:0/fp16", {"typing": "sometimes"}, "typing"),
])
def test_impossible_configurations_are_one_clear_line(uid: str, options: dict,
                                                      needle: str) -> None:
    unit = Unit("cpu", "cpu", "cpu", "fp32", "cpu", "cpu:host") if uid == "cpu" else _unit(uid)
    with pytest.raises(UsageError) as info:
        build_plan(unit, parse_options(TrtOptions, "tensorrt", options))
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
