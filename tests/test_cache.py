"""The cache's owner: real exports as entries, LRU pruning, temporaries, links, the CLI."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from infermux import cache
from infermux._parse import parse_duration_s
from infermux.errors import UsageError
from infermux.export import export_onnx
from infermux.models import load_model

from .conftest import invoke_cli

TINY = str(Path(__file__).parent / "engine_models" / "tinycnn.py")
DAY_S = 86400.0


def _age(path: Path, days: float) -> None:
    """Set a path's atime and mtime `days` into the past."""
    then = time.time() - days * DAY_S
    os.utime(path, (then, then), follow_symlinks=False)


def _age_tree(folder: Path, days: float) -> None:
    """Age a folder, and everything in it, `days` into the past."""
    for path in [folder, *folder.rglob("*")]:
        _age(path, days)


def _file(path: Path, size: int, days: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    if days:
        _age(path, days)
    return path


def _changed_tiny(delta: float):
    model = load_model(f"{TINY}:build")
    with torch.no_grad():
        model.module.head.bias.add_(delta)  # other weights: another export
    return model


def test_real_exports_are_entries_and_a_reused_one_is_pruned_last(tmp_path: Path) -> None:
    first = export_onnx(load_model(f"{TINY}:build"), root=tmp_path)
    second = export_onnx(_changed_tiny(1.0), root=tmp_path)
    assert first.exported and second.exported and first.path != second.path
    summary = cache.scan(tmp_path)
    onnx = summary.kind("onnx")
    assert onnx is not None and onnx.known and len(onnx.entries) == 2
    assert onnx.size_bytes == first.path.stat().st_size + second.path.stat().st_size
    assert {e.path for e in onnx.entries} == {first.path, second.path}

    # Both a month old, then the first is reused: its cache hit marks it used now.
    _age(first.path, 30)
    _age(second.path, 30)
    again = export_onnx(load_model(f"{TINY}:build"), root=tmp_path)
    assert not again.exported and again.path == first.path
    onnx = cache.scan(tmp_path).kind("onnx")
    assert onnx is not None and onnx.entries[-1].path == first.path  # newest last
    assert onnx.entries[-1].last_used_s > time.time() - 3600
    assert onnx.oldest_used_s is not None and onnx.oldest_used_s < time.time() - 29 * DAY_S

    # A bound that fits one export removes the one not reused.
    dry = cache.prune(tmp_path, max_bytes=first.path.stat().st_size, dry_run=True)
    assert [e.path for e in dry.removed] == [second.path] and second.path.exists()
    result = cache.prune(tmp_path, max_bytes=first.path.stat().st_size)
    assert [e.path for e in result.removed] == [second.path]
    assert first.path.exists() and not second.path.exists()
    assert result.kept_bytes == first.path.stat().st_size and not result.failed


def test_the_size_bound_prunes_after_a_new_export_and_keeps_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old_int8 = _file(tmp_path / "onnx-int8" / "old-int8-k.onnx", 400_000, days=10)
    old_blob = _file(tmp_path / "openvino" / "1234.blob", 400_000, days=5)
    monkeypatch.setenv(cache.MAX_SIZE_ENV, "500kB")
    exported = export_onnx(load_model(f"{TINY}:build"), root=tmp_path)
    assert exported.exported and exported.path.exists()
    # The least recently used goes first, until export + rest fits 500 kB.
    assert not old_int8.exists() and old_blob.exists()

    monkeypatch.setenv(cache.MAX_SIZE_ENV, "1B")  # below the new export alone: it stays
    newer = export_onnx(_changed_tiny(2.0), root=tmp_path)
    assert newer.path.exists() and not exported.path.exists() and not old_blob.exists()

    monkeypatch.setenv(cache.MAX_SIZE_ENV, "huge")
    with pytest.raises(UsageError, match=r"INFERMUX_CACHE_MAX_SIZE 'huge' is not a size.*unset"):
        export_onnx(_changed_tiny(3.0), root=tmp_path)
    monkeypatch.delenv(cache.MAX_SIZE_ENV)
    assert cache.bound_after_write(tmp_path, newer.path) is None  # unset: no pruning


def test_kinds_keep_folders_whole_where_their_items_are_folders(tmp_path: Path) -> None:
    _file(tmp_path / "train-data" / "set-a" / "class0" / "0.jpg", 1000)
    _file(tmp_path / "train-data" / "set-a" / "manifest.json", 10)
    _age_tree(tmp_path / "train-data" / "set-a", 3)
    _file(tmp_path / "train-data" / "set-b" / "class0" / "0.jpg", 2000)
    _age_tree(tmp_path / "train-data" / "set-b", 1)
    _file(tmp_path / "torch-compile" / "fxgraph" / "ab" / "graph", 300)
    _file(tmp_path / "torch-compile" / "triton" / "0" / "kernel.so", 700)
    _age_tree(tmp_path / "torch-compile", 40)
    edgetpu = _file(tmp_path / "litert" / "edgetpu" / "m-k_edgetpu.tflite", 50, days=2)
    _file(tmp_path / "litert" / "m-k-int8.tflite", 60, days=1)

    summary = cache.scan(tmp_path)
    train = summary.kind("train-data")
    assert train is not None and [e.path.name for e in train.entries] == ["set-a", "set-b"]
    assert [(e.size_bytes, e.files) for e in train.entries] == [(1010, 2), (2000, 1)]
    compiled = summary.kind("torch-compile")
    assert compiled is not None and len(compiled.entries) == 1
    assert (compiled.entries[0].size_bytes, compiled.entries[0].files) == (1000, 2)
    litert = summary.kind("litert")
    assert litert is not None and {e.path for e in litert.entries} == {
        edgetpu, tmp_path / "litert" / "m-k-int8.tflite"}

    # Marking a data set used (what write_synthetic does on a hit) moves it last.
    cache.touch(train.entries[0].path)
    assert cache.scan(tmp_path).kind("train-data").entries[-1].path.name == "set-a"

    result = cache.prune(tmp_path, older_than_s=parse_duration_s("30d"))
    assert [e.kind for e in result.removed] == ["torch-compile"]
    assert not (tmp_path / "torch-compile" / "triton").exists()
    result = cache.prune(tmp_path, older_than_s=parse_duration_s("36h"), kinds=["litert"])
    assert [e.path for e in result.removed] == [edgetpu]
    assert (tmp_path / "litert" / "m-k-int8.tflite").exists()


def test_writers_fresh_temporaries_are_left_alone_and_stale_ones_removed(tmp_path: Path) -> None:
    from infermux.export import atomic_file

    target = tmp_path / "onnx" / "m-k-op17.onnx"
    with atomic_file(target) as tmp:  # a writer in flight: its temporary beside the entry
        tmp.write_bytes(b"y" * 100)
        work = tmp_path / "onnx-int8" / "tmpab12cd"  # a quantizer's TemporaryDirectory
        _file(work / "prepared.onnx", 100)
        stale = _file(tmp_path / "onnx" / "gone-k-op17.onnx.x1y2.tmp", 100, days=1)
        entries = {e.path: e for e in cache.scan(tmp_path).entries}
        assert entries[tmp].temporary and entries[work].temporary and entries[stale].temporary

        pruned = cache.prune(tmp_path, max_bytes=1)
        assert [e.path for e in pruned.removed] == [stale]
        assert pruned.skipped_temporary == 2
        cleared = cache.clear(tmp_path)
        assert cleared.removed == () and cleared.skipped_temporary == 2
        assert tmp.exists() and work.exists()
    assert target.read_bytes() == b"y" * 100  # the writer's rename still worked


def test_links_are_removed_as_links_and_never_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "cache", tmp_path / "outside"
    precious = _file(outside / "precious.bin", 5000)
    (root / "onnx").mkdir(parents=True)
    (root / "onnx" / "link.onnx").symlink_to(precious)
    _file(root / "train-data" / "set" / "0.jpg", 10)
    (root / "train-data" / "set" / "elsewhere").symlink_to(outside, target_is_directory=True)
    (root / "openvino").symlink_to(outside, target_is_directory=True)  # a linked kind folder

    summary = cache.scan(root)
    assert summary.kind("openvino") is None  # not walked: it lies outside the root
    assert summary.size_bytes < 5000  # the link's own size, not its target's
    result = cache.clear(root)
    assert len(result.removed) == 2 and not result.failed
    assert precious.read_bytes() == b"x" * 5000 and (root / "openvino").is_symlink()
    assert not (root / "onnx" / "link.onnx").is_symlink() and not (root / "train-data" / "set").exists()


def test_folders_not_infermux_writes_stay_unless_named(tmp_path: Path) -> None:
    mine = _file(tmp_path / "notes" / "todo.txt", 10, days=100)
    _file(tmp_path / "onnx" / "a.onnx", 10, days=100)
    summary = cache.scan(tmp_path)
    assert summary.kind("notes") is not None and not summary.kind("notes").known
    assert [e.kind for e in cache.prune(tmp_path, older_than_s=DAY_S).removed] == ["onnx"]
    assert mine.exists() and (tmp_path / "notes").is_dir()
    assert [e.path for e in cache.clear(tmp_path, kinds=["notes"]).removed] == [mine]
    with pytest.raises(UsageError, match=r"cache kind 'onxx' unknown: use one of .*onnx"):
        cache.clear(tmp_path, kinds=["onxx"])
    with pytest.raises(UsageError, match="needs a bound"):
        cache.prune(tmp_path)


def test_two_processes_pruning_at_once_both_finish(tmp_path: Path) -> None:
    for i in range(300):
        _file(tmp_path / "onnx" / f"m{i}.onnx", 10)
        _file(tmp_path / "train-data" / f"set{i % 20}" / f"{i}.jpg", 10)
    with ThreadPoolExecutor(2) as pool:  # .result() raises whatever a clear raised
        results = [f.result() for f in [pool.submit(cache.clear, tmp_path) for _ in range(2)]]
    assert all(not r.failed for r in results)
    assert sum(len(r.removed) for r in results) == 320  # each entry counted once, by its remover
    assert cache.scan(tmp_path).entries == []
    assert cache.scan(tmp_path / "missing").kinds == ()  # an absent root is an empty cache
    cache.touch(tmp_path / "missing" / "x")  # a mark that cannot be made is no error


def test_a_reuse_is_marked_at_most_hourly(tmp_path: Path) -> None:
    recent, old = _file(tmp_path / "recent", 1, days=0.01), _file(tmp_path / "old", 1, days=0.1)
    stamps = recent.stat().st_mtime_ns, old.stat().st_mtime_ns
    cache.touch(recent)
    cache.touch(old)
    assert recent.stat().st_mtime_ns == stamps[0]  # marked 15 minutes ago: left as it is
    assert old.stat().st_mtime_ns > stamps[1] and old.stat().st_mtime > time.time() - 60


def _one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_cli_info_list_prune_clear(tmp_path: Path) -> None:
    env = {"INFERMUX_CACHE_DIR": str(tmp_path)}
    old = _file(tmp_path / "onnx" / "old.onnx", 3000, days=40)
    new = _file(tmp_path / "onnx" / "new.onnx", 2000)
    blob = _file(tmp_path / "openvino" / "b.blob", 1000, days=2)

    for args in (("cache", "--json"), ("cache", "info", "--json")):
        proc = invoke_cli(*args, env=env)
        assert proc.returncode == 0, proc.stderr
        info = json.loads(proc.stdout)
        assert info["root"] == str(tmp_path) and info["size_bytes"] == 6000
        onnx = next(k for k in info["kinds"] if k["kind"] == "onnx")
        assert onnx["entries"] == 2 and onnx["size_bytes"] == 5000 and onnx["known"]
        assert onnx["oldest_used_s"] < time.time() - 39 * DAY_S
        assert info["bound"] == {"env": "INFERMUX_CACHE_MAX_SIZE", "max_size_bytes": None}
    table = invoke_cli("cache", env={**env, "INFERMUX_CACHE_MAX_SIZE": "5GB"})
    assert table.returncode == 0 and "openvino" in table.stdout and "5.0 GB" in table.stdout

    listed = json.loads(invoke_cli("cache", "list", "--kind", "onnx", "--json", env=env).stdout)
    assert [e["path"] for e in listed["entries"]] == [str(old), str(new)]

    dry = invoke_cli("cache", "prune", "--max-size", "4kB", "--dry-run", "--json", env=env)
    assert dry.returncode == 0, dry.stderr
    assert [e["path"] for e in json.loads(dry.stdout)["removed"]] == [str(old)] and old.exists()
    aged = json.loads(invoke_cli("cache", "prune", "--older-than", "30d", "--json", env=env).stdout)
    assert [e["path"] for e in aged["removed"]] == [str(old)] and not old.exists()
    assert aged["kept_bytes"] == 3000

    refused = invoke_cli("cache", "clear", "--kind", "openvino", env=env)
    assert refused.returncode == 2 and "pass --yes" in _one_error_line(refused) and blob.exists()
    cleared = invoke_cli("cache", "clear", "--kind", "openvino", "--yes", "--json", env=env)
    assert cleared.returncode == 0, cleared.stderr
    assert json.loads(cleared.stdout)["freed_bytes"] == 1000 and not blob.exists() and new.exists()


@pytest.mark.parametrize(("args", "env", "message"), [
    (("prune", "--max-size", "lots"), {}, "--max-size 'lots' is not a size"),
    (("prune", "--older-than", "3w"), {}, "--older-than '3w' is not a duration"),
    (("prune",), {}, "cache prune needs a bound: pass --max-size"),
    (("prune", "--older-than", "1d", "--kind", "onxx"), {}, "cache kind 'onxx' unknown"),
    (("list", "--kind", "onxx"), {}, "cache kind 'onxx' unknown"),
    (("info",), {"INFERMUX_CACHE_MAX_SIZE": "big"}, "INFERMUX_CACHE_MAX_SIZE 'big' is not a size"),
])
def test_cli_bad_input_is_one_line(tmp_path: Path, args, env, message) -> None:
    proc = invoke_cli("cache", *args, env={"INFERMUX_CACHE_DIR": str(tmp_path), **env})
    assert proc.returncode == 2
    assert message in _one_error_line(proc)


def test_days_are_a_duration() -> None:
    assert parse_duration_s("30d") == pytest.approx(30 * DAY_S)
