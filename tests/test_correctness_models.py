"""Model identity, weights errors and atomic cache writes.

Two factories (or ONNX files) with one file name in two folders are two networks: engines and
the ONNX export cache must never serve one for the other.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from infermux.engines import create_engine, engine_status
from infermux.errors import UsageError
from infermux.export import export_onnx
from infermux.models import ModelSpec, load_model

FACTORY = '''
import torch
from torch import nn


class Net(nn.Module):
    input_shape = (4,)

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, {outputs})

    def forward(self, x):
        return self.fc(x) * {scale}


def build():
    torch.manual_seed(0)
    return Net()
'''


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("INFERMUX_CACHE_DIR", str(tmp_path / "cache"))
    yield


def _factory(folder: Path, outputs: int, scale: float) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "m.py").write_text(FACTORY.format(outputs=outputs, scale=scale))
    return f"{folder / 'm.py'}:build"


def _out(runner, x: np.ndarray) -> np.ndarray:
    return runner.infer(x)[0]


def test_two_factories_with_one_file_name_stay_distinct_in_the_torch_engine(tmp_path, cpu):
    a = load_model(_factory(tmp_path / "a", outputs=3, scale=1.0))
    b = load_model(_factory(tmp_path / "b", outputs=5, scale=1.0))
    assert a.name == b.name == "m:build"  # the display name drops the folder ...
    assert a.key != b.key  # ... the identity does not
    engine = create_engine("torch")
    x = np.ones((1, 4), np.float32)
    assert _out(engine.build(a, cpu, 1, {}), x).shape == (1, 3)
    assert _out(engine.build(b, cpu, 1, {}), x).shape == (1, 5)


def test_a_factory_edited_in_place_is_a_new_model(tmp_path):
    ref = _factory(tmp_path / "a", outputs=3, scale=1.0)
    before = load_model(ref).key
    _factory(tmp_path / "a", outputs=3, scale=2.0)
    assert load_model(ref).key != before


def test_two_factories_differing_only_in_code_never_share_an_onnx_export(tmp_path):
    # Same class name, layers and seeded weights; only forward differs (× 2).
    a = load_model(_factory(tmp_path / "a", outputs=3, scale=1.0))
    b = load_model(_factory(tmp_path / "b", outputs=3, scale=2.0))
    root = tmp_path / "exports"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ea, eb = export_onnx(a, root=root), export_onnx(b, root=root)
    assert ea.path != eb.path and ea.digest != eb.digest


def _onnx_engine():
    ok, why = engine_status()["onnxruntime"]
    if not ok:
        pytest.skip(f"onnxruntime not usable here: {why}")
    return create_engine("onnxruntime")


def test_two_onnx_files_with_one_name_stay_distinct(tmp_path, cpu):
    engine = _onnx_engine()
    paths = []
    for folder, outputs in (("x", 3), ("y", 5)):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "model.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(torch.nn.Linear(4, outputs), (torch.randn(1, 4),), str(path),
                              dynamo=False, input_names=["input"], output_names=["output"],
                              dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
        paths.append(path)
    x, y = (load_model(ModelSpec(str(p))) for p in paths)
    assert x.name == y.name == "model" and x.key != y.key
    batch = np.ones((1, 4), np.float32)
    assert _out(engine.build(x, cpu, 1, {}), batch).shape == (1, 3)
    assert _out(engine.build(y, cpu, 1, {}), batch).shape == (1, 5)


def test_safetensors_weights_without_the_package_say_what_to_do(tmp_path, tiny_factory, monkeypatch):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"\0" * 16)
    # The package is absent for this import (a None entry makes `import` raise ImportError).
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(UsageError) as info:
        load_model(ModelSpec(f"{tiny_factory}:build", weights=str(path)))
    message = str(info.value)
    assert "\n" not in message and "w.safetensors" in message
    assert "pip install safetensors" in message and "not a" not in message


def test_cache_files_are_replaced_atomically(tmp_path):
    import pytest

    from infermux.export import atomic_file, write_atomic

    target = tmp_path / "timing.cache"
    write_atomic(target, b"first")
    write_atomic(target, b"second")
    assert target.read_bytes() == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timing.cache"]  # no temporary left
    # A write that fails half-way leaves the old file whole and no temporary behind.
    with pytest.raises(RuntimeError), atomic_file(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("the writer failed")
    assert target.read_bytes() == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timing.cache"]
