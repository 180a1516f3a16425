"""The shared engine interface, the `oom` status by type, and the CUDA → NVML index mapping."""

from __future__ import annotations

from pathlib import Path

import pytest

from infermux.engines import create_engine, engine_status
from infermux.errors import DeviceOutOfMemoryError, UsageError
from infermux.models import ModelSpec, load_model
from infermux.nvidia import NvmlDevice, cuda_to_nvml
from infermux.units import Unit, discover, select_units

TINY = str(Path(__file__).parent / "engine_models" / "tinycnn.py") + ":build"
HUGE = 2**34  # items of 3×32×32 float32: 200 TB of input buffer


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelSpec(TINY))


@pytest.fixture(scope="module")
def cpu_unit() -> Unit:
    return select_units("cpu", discover())[0]


def _usable(*names: str) -> list[str]:
    status = engine_status()
    return [n for n in names if status.get(n, (False, ""))[0]]


@pytest.mark.parametrize("name", _usable("torch", "onnxruntime", "openvino"))
def test_every_engine_checks_caches_and_releases_the_same_way(name, tiny, cpu_unit) -> None:
    engine = create_engine(name)
    other = Unit("tpu:0", "tpu", "tpu:0", "int8", "an accelerator no engine here drives", "tpu:0")
    with pytest.raises(UsageError, match=f"the {name} engine cannot run on unit 'tpu:0'"):
        engine.build(tiny, other, 2)
    assert not engine.supports(other) and engine.supports(cpu_unit)
    with pytest.raises(UsageError, match="batch size 0"):
        engine.build(tiny, cpu_unit, 0)
    with pytest.raises(UsageError, match="data placement 'nowhere'"):
        engine.build(tiny, cpu_unit, 2, data="nowhere")
    with pytest.raises(UsageError, match=f"{name} engine option no_such_option"):
        engine.build(tiny, cpu_unit, 2, {"no_such_option": 1})
    first = engine.build(tiny, cpu_unit, 2)
    assert engine.build(tiny, cpu_unit, 2) is first  # one runner per key
    assert engine.build(tiny, cpu_unit, 2, instance=1) is not first
    engine.release()
    again = engine.build(tiny, cpu_unit, 2)
    assert again is not first  # released runners are never handed out again
    assert again.infer(__import__("numpy").zeros((2, 3, 32, 32), "float32"))[0].shape == (2, 10)
    engine.release()


@pytest.mark.parametrize("name", _usable("torch", "onnxruntime"))
def test_an_impossible_buffer_is_an_out_of_memory_error_by_type(name, tiny, cpu_unit) -> None:
    engine = create_engine(name)
    with pytest.raises(DeviceOutOfMemoryError, match=f"batch {HUGE} ran out of memory"):
        engine.build(tiny, cpu_unit, HUGE)
    # The engine is still usable after it.
    assert engine.build(tiny, cpu_unit, 2).batch == 2
    engine.release()


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs two CPU cores")
def test_a_worker_that_runs_out_of_memory_has_the_oom_status() -> None:
    from infermux.runtime import run_plan
    from infermux.runtime.plan import parse_plan

    hungry = str(Path(__file__).parent / "engine_models" / "hungry.py") + ":build"
    plan = parse_plan({
        "name": "oom",
        "models": [{"name": "hungry", "model": hungry, "replicas": [
            {"unit": "cpu:0", "engine": "torch", "batch": 4, "batch_buckets": "none"},
            {"unit": "cpu:1", "engine": "torch", "batch": 2, "batch_buckets": "none"}]}],
        "load": {"scenario": "offline", "min_duration_s": 0.3, "min_queries": 16},
    }, source="test")
    report = run_plan(plan)
    workers = report.final.workers
    assert {w.unit: w.status for w in workers.values()} == {"cpu:0": "oom", "cpu:1": "ok"}
    assert "ran out of memory" in next(w.error for w in workers.values() if w.unit == "cpu:0")
    assert report.final.completed > 0  # the other worker served the load


def test_a_run_whose_model_has_no_worker_fails_with_the_reason() -> None:
    from infermux.errors import RunError
    from infermux.runtime import run_plan
    from infermux.runtime.plan import parse_plan

    hungry = str(Path(__file__).parent / "engine_models" / "hungry.py") + ":build"
    plan = parse_plan({"name": "oom", "models": [{"name": "hungry", "model": hungry, "replicas": [
        {"unit": "cpu:0", "engine": "torch", "batch": 4, "batch_buckets": "none"}]}],
        "load": {"scenario": "offline", "min_duration_s": 0.3, "min_queries": 16}}, source="test")
    with pytest.raises(RunError, match="no worker of model 'hungry' could be built.*ran out of memory"):
        run_plan(plan)


def _devices() -> list[NvmlDevice]:
    # NVML lists GPUs in PCI bus order; here deliberately out of order to check the sort.
    return [NvmlDevice(0, "GPU-aaaa-0000", "00000000:1B:00.0"),
            NvmlDevice(1, "GPU-bbbb-1111", "00000000:43:00.0"),
            NvmlDevice(2, "GPU-cccc-2222", "00000000:52:00.0"),
            NvmlDevice(3, "GPU-dddd-3333", "00000000:9D:00.0")]


@pytest.mark.parametrize(("visible", "uuids", "expected"), [
    (None, [], {0: 0, 1: 1, 2: 2, 3: 3}),
    ("2,0", [], {0: 2, 1: 0}),                      # CUDA 0 is the third GPU on the bus
    ("3", [], {0: 3}),
    ("GPU-cccc", [], {0: 2}),                        # a UUID prefix
    ("1,GPU-dddd-3333", [], {0: 1, 1: 3}),
    ("1,7,2", [], {0: 1}),                           # CUDA stops at the first invalid entry
    ("MIG-1234", [], {}),                            # not a whole GPU: not guessed
    ("", [], {0: 0, 1: 1, 2: 2, 3: 3}),
    # PyTorch's UUIDs decide wherever it reports them (e.g. under CUDA_DEVICE_ORDER=FASTEST_FIRST)
    ("0,1", ["GPU-bbbb-1111", "GPU-aaaa-0000"], {0: 1, 1: 0}),
])
def test_cuda_indices_map_to_the_nvml_device_they_are(visible, uuids, expected) -> None:
    assert cuda_to_nvml(_devices(), visible=visible, uuids=uuids) == expected


def test_the_mapping_follows_pci_order_not_nvml_listing_order() -> None:
    shuffled = [NvmlDevice(0, "GPU-x", "00000000:9D:00.0"), NvmlDevice(1, "GPU-y", "00000000:1B:00.0")]
    assert cuda_to_nvml(shuffled, visible="0") == {0: 1}
    assert cuda_to_nvml(shuffled, cuda_count=1) == {0: 1}
