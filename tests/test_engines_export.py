"""ONNX export: content-hash cache, cache folder override, operator named on failure, bad files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infermux.errors import RunError, UsageError
from infermux.export import cache_dir, export_onnx
from infermux.models import load_model

TINY = str(Path(__file__).parent / "engine_models" / "tinycnn.py")


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("INFERMUX_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("INFERMUX_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "infermux"


def test_export_is_cached_by_content(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("INFERMUX_CACHE_DIR", str(tmp_path))
    model = load_model(f"{TINY}:build")
    first = export_onnx(model)
    assert first.exported and first.path.is_file() and first.path.parent == tmp_path / "onnx"
    again = export_onnx(load_model(f"{TINY}:build"))  # a fresh load of the same content
    assert not again.exported and again.path == first.path and again.digest == first.digest

    changed = load_model(f"{TINY}:build")
    with torch.no_grad():
        changed.module.head.bias.add_(1.0)  # other weights: another export
    other = export_onnx(changed)
    assert other.exported and other.path != first.path

    newer = export_onnx(model, opset=13)  # the opset is part of the key
    assert newer.exported and newer.opset == 13 and newer.path != first.path
    assert sorted(p.suffix for p in (tmp_path / "onnx").iterdir()) == [".onnx"] * 3


def test_exported_graph_has_a_dynamic_batch_axis(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    import onnx

    monkeypatch.setenv("INFERMUX_CACHE_DIR", str(tmp_path))
    exported = export_onnx(load_model(f"{TINY}:build"))
    graph = onnx.load(str(exported.path)).graph
    for value in (graph.input[0], graph.output[0]):
        batch = value.type.tensor_type.shape.dim[0]
        assert batch.dim_param and not batch.dim_value


def test_export_failure_names_the_operator(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("INFERMUX_CACHE_DIR", str(tmp_path))
    model = load_model(f"{TINY}:build_unexportable")
    with pytest.raises(RunError, match=r"operator aten::linalg_eigvals is not exportable") as info:
        export_onnx(model)
    assert "\n" not in str(info.value)
    assert not list((tmp_path / "onnx").glob("*.tmp"))  # no half-written file left behind


def test_user_onnx_file_is_used_as_is(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("INFERMUX_CACHE_DIR", str(tmp_path / "cache"))
    exported = export_onnx(load_model(f"{TINY}:build"))
    mine = tmp_path / "mine.onnx"
    mine.write_bytes(exported.path.read_bytes())
    given = export_onnx(load_model(str(mine)))
    assert given.path == mine and not given.exported and given.opset is None
    assert given.digest == exported.digest


@pytest.mark.parametrize("content", [b"", b"not an onnx file at all \x00\x01\x02", None])
def test_corrupt_onnx_file_is_one_clear_usage_error(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "broken.onnx"
    if content is None:  # a real model cut in half
        exported = export_onnx(load_model(f"{TINY}:build"), root=tmp_path)
        data = exported.path.read_bytes()
        content = data[: len(data) // 2]
    path.write_bytes(content)
    with pytest.raises(UsageError) as info:  # from reading the file, or from checking it
        export_onnx(_onnx_model(path))
    assert "broken.onnx" in str(info.value) and "\n" not in str(info.value)


def _onnx_model(path: Path):  # an empty file has no shape to read: give one
    from infermux.models import ModelSpec

    return load_model(ModelSpec(str(path), input_shape=(3, 32, 32)))
