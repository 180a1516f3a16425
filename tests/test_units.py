import os

import pytest
import torch

from infermux.errors import UsageError
from infermux.units import discover, parse_core_set, select_units
from infermux.units.cpu import read_cpu_info
from infermux.units.jetson import read_jetson

from .conftest import FIXTURES

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


@pytest.fixture(scope="module")
def found():
    return discover()


def test_discovery_finds_the_cpu_with_its_facts(found):
    cpu = found.get("cpu")
    assert cpu is not None and cpu.available
    assert cpu.cores == tuple(sorted(os.sched_getaffinity(0)))
    assert cpu.contention_domain == "cpu:host"
    assert found.cpu["logical_cores"] >= len(cpu.cores)
    data = found.to_dict()
    assert {"units", "runtimes", "notes", "cpu"} <= set(data)


def test_discovery_explains_what_is_missing(found):
    if not torch.cuda.is_available():
        assert any(n.startswith("cuda:") for n in found.notes)
    assert any(n.startswith("dla:") for n in found.notes)  # not a Jetson here
    for name in ("onnxruntime", "openvino", "tensorrt"):
        info = found.runtimes[name]
        assert info["available"] or info["reason"]


def test_x86_cpuinfo_flags_are_read():
    info = read_cpu_info()
    if os.uname().machine == "x86_64":
        assert "sse4_2" in info["isa"]
    assert info["model"]


def test_core_sets_and_globs(found):
    assert parse_core_set("0-3") == (0, 1, 2, 3)
    assert parse_core_set("0-1+4-5") == (0, 1, 4, 5)
    assert parse_core_set("2") == (2,)
    first = min(found.cpu["usable_cores"])
    unit = select_units(f"cpu:{first}", found)[0]
    assert unit.cores == (first,) and unit.id == f"cpu:{first}"
    assert next(u.id for u in select_units("c*", found)) == "cpu"
    assert select_units("auto", found)[0].id == "cpu"


@pytest.mark.parametrize(("spec", "message"), [
    ("gpu:0", "is not on this machine"),
    ("cpu:9999", "cannot use"),
    ("cpu:3-1", "empty or negative"),
    ("cpu:a-b", "not a range"),
    ("", "no unit given"),
])
def test_bad_unit_names_say_what_exists(found, spec, message):
    with pytest.raises(UsageError, match=message) as info:
        select_units(spec, found)
    if "not on this machine" in message:
        assert "units here: cpu" in str(info.value)


def test_orin_tree_gives_two_dlas_and_shared_dram():
    # The tree is assembled from L4T's documented files, not captured from a board.
    board = read_jetson(FIXTURES / "units_orin")
    assert board is not None
    assert board["model"] == "NVIDIA Jetson AGX Orin Developer Kit"
    assert board["l4t"] == "35.4.1"
    assert board["dla_cores"] == [0, 1]
    assert board["power_mode"] == {"id": 0, "name": "MAXN"}
    found = discover(FIXTURES / "units_orin")
    dla = [u for u in found.units if u.kind == "dla"]
    assert sorted(u.id for u in dla) == ["dla:0/fp16", "dla:0/int8", "dla:1/fp16", "dla:1/int8"]
    assert {u.contention_domain for u in found.units if u.kind in ("cpu", "dla")} == {"jetson:dram"}
    if not found.runtimes["tensorrt"]["available"]:
        assert all(not u.available and "TensorRT" in u.reason for u in dla)
        with pytest.raises(UsageError, match="cannot be used: DLA needs TensorRT"):
            select_units("dla:*/fp16", found)
    assert found.cpu["isa"] == ["asimd", "asimddp", "asimdhp"]
    assert found.cpu["model"] == "ARMv8 Processor rev 1 (v8l)"


def test_nano_tree_has_no_dla():
    board = read_jetson(FIXTURES / "units_nano")
    assert board is not None and board["dla_cores"] == [] and board["l4t"] == "32.7.1"
    found = discover(FIXTURES / "units_nano", with_runtimes=False)
    assert not [u for u in found.units if u.kind == "dla"]
    assert any("shows no DLA cores" in n for n in found.notes)


def test_not_a_jetson(tmp_path):
    assert read_jetson(tmp_path) is None


@needs_cuda
def test_cuda_units_per_mode(found):
    units = [u for u in found.units if u.kind == "cuda"]
    assert {u.mode for u in units} == {"fp32", "tf32", "fp16", "bf16"}
    props = torch.cuda.get_device_properties(0)
    bf16 = found.get("cuda:0/bf16")
    assert bf16 is not None and bf16.available == (props.major >= 8)
    assert found.get("cuda:0/fp32").details["sm_count"] == props.multi_processor_count
    assert len({u.contention_domain for u in units if u.device == "cuda:0"}) == 1
