"""The LiteRT engine on the CPU, and Edge TPU discovery and compilation from captured files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from infermux.engines import create_engine
from infermux.engines.litert import (
    LiteRtOptions,
    TfliteFile,
    _litert_key,
    compile_for_edgetpu,
    convert_tflite,
    parse_edgetpu_compiler,
)
from infermux.engines.select import engines_for
from infermux.errors import UsageError
from infermux.models import LoadedModel, ModelSpec, load_model
from infermux.units import discover, select_units
from infermux.units.edgetpu import edgetpu_units, find_edgetpus

from .conftest import FIXTURES
from .tiny_models import TinyCNN

HAS_INTERPRETER = importlib.util.find_spec("ai_edge_litert") is not None
HAS_CONVERTER = HAS_INTERPRETER and importlib.util.find_spec("litert_torch") is not None
needs_converter = pytest.mark.skipif(
    not HAS_CONVERTER, reason="litert-torch is not installed: pip install 'infermux[litert]'")


# --- Edge TPU discovery --------------------------------------------------------------------------

def test_pcie_edgetpu_is_found_through_its_apex_node():
    notes: list[str] = []
    units = edgetpu_units(notes, FIXTURES / "edgetpu_pcie", runtime=(True, ""))
    assert [u.id for u in units] == ["edgetpu:0"]
    tpu = units[0]
    assert tpu.kind == "edgetpu" and tpu.mode == "int8" and tpu.available
    assert tpu.details["delegate_device"] == "pci:0"
    assert tpu.details["pci"] == "0000:03:00.0"
    assert tpu.details["temp_millic"] == "41800"
    assert tpu.contention_domain == "pci:0000:03:00.0"
    assert notes == []


def test_usb_accelerators_before_and_after_firmware_load():
    notes: list[str] = []
    units = edgetpu_units(notes, FIXTURES / "edgetpu_usb", runtime=(True, ""))
    # The keyboard and the root hubs are not Edge TPUs; both Accelerators are, whatever their id.
    assert [(u.id, u.details["usb_id"], u.details["delegate_device"]) for u in units] == [
        ("edgetpu:0", "1a6e:089a", "usb:0"), ("edgetpu:1", "18d1:9302", "usb:1")]
    assert [u.contention_domain for u in units] == ["usb:usb1", "usb:usb2"]
    assert units[1].details["manufacturer"] == "Google Inc."
    assert units[1].details["speed_mbps"] == 5000
    assert any("edgetpu:0" in n and "USB 2" in n for n in notes)


def test_pcie_function_without_driver_is_listed_with_the_fix():
    units = edgetpu_units([], FIXTURES / "edgetpu_pcie_nodriver", runtime=(True, ""))
    assert len(units) == 1 and not units[0].available
    assert "apex driver" in units[0].reason


def test_missing_runtime_makes_found_tpus_unusable_with_the_reason():
    notes: list[str] = []
    why = "the Edge TPU runtime (libedgetpu.so.1) is not installed"
    units = edgetpu_units(notes, FIXTURES / "edgetpu_usb", runtime=(False, why))
    assert units and all(not u.available and u.reason == why for u in units)
    assert any(n.startswith("edgetpu: 2 Edge TPU(s) found but unusable") for n in notes)


def test_no_edgetpu_says_why_and_select_units_repeats_it(tmp_path: Path):
    notes: list[str] = []
    assert edgetpu_units(notes, tmp_path) == []
    assert notes and "no Edge TPU found" in notes[0] and "18d1:9302" in notes[0]
    assert find_edgetpus(tmp_path) == []
    found = discover(tmp_path, with_runtimes=False)
    assert any(n.startswith("edgetpu: no Edge TPU found") for n in found.notes)
    with pytest.raises(UsageError, match=r"edgetpu:0.*no Edge TPU found"):
        select_units("edgetpu:0", found)


def test_discover_lists_edgetpu_units_from_a_tree():
    found = discover(FIXTURES / "edgetpu_pcie", with_runtimes=False)
    tpus = [u for u in found.units if u.kind == "edgetpu"]
    assert [u.id for u in tpus] == ["edgetpu:0"]


# --- the Edge TPU compiler -----------------------------------------------------------------------

def test_compiler_summary_of_a_fully_mapped_model():
    result = parse_edgetpu_compiler((FIXTURES / "edgetpu_compiler_full.txt").read_text())
    assert (result.ops_tpu, result.ops_cpu, result.subgraphs) == (72, 0, 1)
    assert result.tpu_fraction == 1.0 and result.unmapped() == []
    assert result.version == "16.0.384591198"
    assert result.off_chip_bytes == 0.0
    assert result.on_chip_bytes == pytest.approx(3.72 * 2**20)


def test_compiler_summary_of_a_partly_mapped_model_says_what_stays_on_the_cpu():
    result = parse_edgetpu_compiler((FIXTURES / "edgetpu_compiler_partial.txt").read_text())
    assert (result.ops_tpu, result.ops_cpu, result.total) == (112, 6, 118)
    assert [op for op, _, _ in result.unmapped()] == ["TRANSPOSE", "HARD_SWISH", "QUANTIZE"]
    text = result.summary()
    assert text.startswith("112 of 118 operations run on the Edge TPU (95%)")
    assert "4×HARD_SWISH (Operation not supported)" in text
    assert result.to_dict()["ops_cpu"] == 6


def test_missing_compiler_is_one_clear_line(tmp_path: Path):
    source = tmp_path / "m-int8.tflite"
    source.write_bytes(b"TFL3")
    with pytest.raises(UsageError, match=r"edgetpu_compiler.*apt-get install edgetpu-compiler"):
        compile_for_edgetpu(TfliteFile(source, "abc", "int8", False), compiler=str(tmp_path / "none"))


def test_cpu_int8_unit_runs_the_int8_file(cpu):
    import dataclasses

    int8_unit = dataclasses.replace(cpu, id="cpu/int8", mode="int8")
    assert LiteRtOptions().resolve(int8_unit).precision == "int8"
    assert LiteRtOptions().resolve(cpu).precision == "fp32"
    with pytest.raises(UsageError, match="precision=fp32 on unit 'cpu/int8'"):
        LiteRtOptions(precision="fp32").resolve(int8_unit)


def test_edgetpu_unit_runs_int8_only():
    unit = edgetpu_units([], FIXTURES / "edgetpu_pcie", runtime=(True, ""))[0]
    assert LiteRtOptions().resolve(unit).precision == "int8"
    with pytest.raises(UsageError, match="precision=fp16.*int8 models only"):
        LiteRtOptions(precision="fp16").resolve(unit)


def test_edgetpu_delegate_on_this_machine():
    found = discover(with_runtimes=False)
    tpus = [u for u in found.units if u.kind == "edgetpu" and u.available]
    if not tpus:
        why = "; ".join(n for n in found.notes if n.startswith("edgetpu")) or "no usable Edge TPU"
        pytest.skip(f"no Edge TPU here: {why}")
    if not HAS_CONVERTER:
        pytest.skip("litert-torch is not installed: pip install 'infermux[litert]'")
    model = LoadedModel.from_module(TinyCNN(8), name="tiny-tpu", input_shape=(3, 32, 32))
    runner = create_engine("litert").build(model, tpus[0], 2)
    assert runner.options["edgetpu"]["ops_tpu"] > 0
    assert runner.infer(np.zeros((2, 3, 32, 32), np.float32))[0].shape == (2, 10)


# --- the engine on the CPU -----------------------------------------------------------------------

SEEDED = "tests/litert_models.py:seeded_tiny_cnn"


@pytest.fixture(scope="module")
def tiny(module_cache_dir) -> LoadedModel:
    return load_model(ModelSpec(SEEDED, input_shape=(3, 32, 32)))


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("calib") / "calib.npy"
    np.save(path, np.random.default_rng(1).standard_normal((32, 3, 32, 32)).astype(np.float32))
    return str(path)


@needs_converter
def test_fp32_and_fp16_agree_with_torch(tiny, cpu):
    engine = create_engine("litert")
    x = np.random.default_rng(2).standard_normal((4, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        ref = tiny.module(torch.from_numpy(x)).numpy()
    runner = engine.build(tiny, cpu, 4)
    assert runner.options["precision"] == "fp32"
    assert runner.options["threads"] == len(cpu.cores)
    np.testing.assert_allclose(runner.infer(x)[0], ref, rtol=1e-4, atol=1e-5)
    fp16 = engine.build(tiny, cpu, 4, {"precision": "fp16"}).infer(x)[0]
    np.testing.assert_allclose(fp16, ref, rtol=1e-2, atol=2e-3)
    timing = runner.run()
    assert timing.latency_ns > 0 and timing.compute_ns == timing.latency_ns
    engine.release()


@needs_converter
def test_int8_with_calibration_stays_within_tolerance(tiny, cpu, calib_file):
    engine = create_engine("litert")
    x = np.random.default_rng(3).standard_normal((8, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        ref = tiny.module(torch.from_numpy(x)).numpy()
    runner = engine.build(tiny, cpu, 8, {"precision": "int8", "calibration_data": calib_file})
    y = runner.infer(x)[0]
    assert y.dtype == np.float32 and y.shape == ref.shape
    spread = float(ref.max() - ref.min())
    assert float(np.abs(y - ref).max()) < 0.08 * spread
    assert np.corrcoef(y.ravel(), ref.ravel())[0, 1] > 0.98
    # The file is int8 inside and at its edges: the runner quantizes inputs and dequantizes outputs.
    assert runner._in_dtype == np.int8
    engine.release()


@needs_converter
def test_conversion_is_cached_by_content(tiny, module_cache_dir):
    first = convert_tflite(tiny, "fp32")
    again = convert_tflite(tiny, "fp32")
    assert again.path == first.path and not again.converted and again.digest == first.digest
    assert first.path.parent == module_cache_dir / "litert"
    # The converter (and the JAX it imports) ran in a child: this process may still fork.
    assert "litert_torch" not in sys.modules and "jax" not in sys.modules
    other = LoadedModel.from_module(TinyCNN(8), name="tiny-litert", input_shape=(3, 32, 32))
    assert _litert_key(other, "fp32", "") != _litert_key(tiny, "fp32", "")  # other weights
    assert _litert_key(tiny, "int8", "random") != _litert_key(tiny, "int8", "calib.npy")


@needs_converter
def test_prebuilt_tflite_runs_through_model_file(tiny, cpu, tmp_path):
    made = convert_tflite(tiny, "fp32")
    copy = tmp_path / "given.tflite"
    copy.write_bytes(made.path.read_bytes())
    engine = create_engine("litert")
    runner = engine.build(tiny, cpu, 2, {"model_file": str(copy), "xnnpack": False, "threads": 1})
    x = np.ones((2, 3, 32, 32), np.float32)
    with torch.no_grad():
        ref = tiny.module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(runner.infer(x)[0], ref, rtol=1e-4, atol=1e-5)
    assert runner.options["tflite_file"] == str(copy)
    with pytest.raises(UsageError, match="model_file='nope.tflite': no such file"):
        engine.build(tiny, cpu, 2, {"model_file": "nope.tflite"})
    engine.release()


@pytest.mark.skipif(not HAS_INTERPRETER, reason="ai-edge-litert is not installed")
def test_auto_picks_litert_for_cpu_units_and_bad_options_are_one_line(tiny, cpu):
    assert (cpu, "litert") in engines_for("auto", [cpu], tiny)
    with pytest.raises(UsageError, match=r"litert engine option precision='int4'.*options:"):
        create_engine("litert").build(tiny, cpu, 1, {"precision": "int4"})
    onnx_like = LoadedModel.from_module(TinyCNN(8), name="x", input_shape=(3, 32, 32))
    onnx_like.module = None
    assert not create_engine("litert").accepts(onnx_like)


# --- the runtime and pipelines -------------------------------------------------------------------

@needs_converter
def test_runtime_runs_litert_replicas_in_worker_processes(tiny, cpu, tmp_path):
    from infermux.runtime import parse_plan, run_plan
    from infermux.store import Store

    create_engine("litert").build(tiny, cpu, 4).close()  # converted here; the worker's is cached
    plan = parse_plan({
        "name": "litert", "dispatcher": {"cpu_workers": "process", "max_queue_delay_ms": 2},
        "load": {"min_duration_s": 0.5, "min_queries": 20, "sample_pool": 16},
        "models": [{"name": "tiny", "model": SEEDED, "input_shape": [3, 32, 32], "replicas": [
            {"unit": "cpu", "engine": "litert", "batch": 4, "batch_buckets": "none"}]}]})
    with Store(tmp_path / "r.db") as store:
        report = run_plan(plan, store=store, command="test")
    assert report.status == "complete", report.error
    assert report.final.failed == 0 and report.final.completed >= 20
    assert [w["hosting"] for w in report.build["workers"]] == ["process"]


@needs_converter
def test_pipeline_stage_on_litert_agrees_with_the_whole_model(module_cache_dir, cpu):
    from infermux.agreement import check_stages
    from infermux.partition import capture_graph

    torch.manual_seed(0)
    model = LoadedModel.from_module(TinyCNN(16), name="tiny-stages", input_shape=(3, 32, 32))
    graph = capture_graph(model.module, model.input_shape)
    result = check_stages(model, graph, [("input", "body_1", cpu, "torch"),
                                         ("body_1", "output", cpu, "litert")])
    assert result.passed, result.message
    assert [s.status for s in result.stages] == ["pass", "pass"]
