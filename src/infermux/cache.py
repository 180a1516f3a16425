"""The cache folder's owner: what is in it, what each part weighs, and removing the least used.

Every derived file infermux writes (ONNX exports, their fused, int8 and lower-precision copies,
OpenVINO's compiled blobs, TensorRT engines, torch.compile's artefacts, LiteRT conversions, the
trained digits model, training data sets) goes under one root, `infermux.export.cache_dir()`,
in one top-level folder per *kind*. Nothing else removes them: exports are keyed by content,
so every model with new weights adds a file. This module walks the root into entries (a file,
or for kinds that keep a folder per item, that folder), prunes them least recently used first
(`prune`), empties kinds (`clear`), and keeps an optional bound (`INFERMUX_CACHE_MAX_SIZE`)
after each write (`bound_after_write`). Readers mark what they reuse with `touch`, so "least
recently used" means what it says.

Safe beside other processes: only entries under the root are removed, symbolic links are
removed as links and never followed, a writer's fresh temporary is left alone, and an entry
that vanishes mid-walk (another process pruning) is skipped.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infermux.errors import UsageError

__all__ = [
    "KINDS",
    "MAX_SIZE_ENV",
    "TEMP_GRACE_S",
    "CacheEntry",
    "CacheSummary",
    "KindSummary",
    "PruneResult",
    "bound_after_write",
    "clear",
    "max_size_from_env",
    "prune",
    "scan",
    "select_kinds",
    "touch",
]

#: The kinds infermux writes, and what each holds. `prune` and `clear` act on these by default;
#: any other folder under the root is listed but left alone unless named with `kinds=`.
KINDS: dict[str, str] = {
    "onnx": "ONNX exports of torch models (one per content: code, weights, shape, opset)",
    "onnx-fused": "ONNX files rewritten by ONNX Runtime's transformer optimizer",
    "onnx-int8": "int8 ONNX files (Q/DQ by static quantization, or dynamic int8 weights)",
    "onnx-precision": "ONNX files cast to fp16 or bf16",
    "openvino": "OpenVINO's compiled model blobs",
    "tensorrt": "TensorRT engines, timing caches and calibration caches",
    "ort-trt": "ONNX Runtime's TensorRT provider engines and timing caches",
    "torch-compile": "torch.compile's artefacts (FX graphs, kernels, autotuning)",
    "litert": "LiteRT (.tflite) conversions and Edge TPU compilations",
    "characterize": "the trained digits model",
    "characterize-int8": "int8 ONNX files made by characterize",
    "train-data": "synthetic image data sets written for training runs",
}

#: Kinds whose folder is one entry: their files refer to one another (an FX graph to its
#: kernels, a TensorRT provider's engine to its profile), so removing some of them would leave
#: the rest broken rather than smaller.
_WHOLE_KINDS = frozenset({"torch-compile", "ort-trt"})
#: Folders inside a kind whose children are that kind's entries, as the kind's own are.
_CONTAINERS: dict[str, frozenset[str]] = {"litert": frozenset({"edgetpu"})}

#: How long a writer's temporary is taken to be in flight. The temporaries: `export.atomic_file`
#: and `write_atomic` create `<final name>.<random>.tmp` beside the entry (tempfile.mkstemp),
#: the digits model `<stem><random>.tmp`, the quantizers and the Edge TPU compiler work in
#: `tmp<random>` folders (tempfile.TemporaryDirectory). The file is created when the work
#: starts and written when it ends, so it looks untouched for as long as an export or a
#: calibration runs, which can be many minutes for a large model; one older than an hour is
#: what a killed writer left behind, and is pruned like any other entry.
TEMP_GRACE_S = 3600.0

#: Reuse is marked at most once an hour per entry: pruning works in days, and a file reused
#: over and over by one process keeps its mtime (the digits model's weights file is a model's
#: `--weights`, whose mtime is part of that model's cache key, `LoadedModel.key`).
_TOUCH_AFTER_S = 3600.0

#: The environment variable that bounds the cache's size after each write (unset: no bound).
MAX_SIZE_ENV = "INFERMUX_CACHE_MAX_SIZE"


@dataclass(frozen=True)
class CacheEntry:
    """One removable item of a kind: a file, or a folder counted whole."""

    kind: str
    path: Path
    size_bytes: int
    files: int
    last_used_s: float  # seconds since the epoch (see `_last_used`)
    temporary: bool = False  # a writer's temporary (see TEMP_GRACE_S)

    def to_dict(self) -> dict[str, Any]:
        """The entry as JSON-ready values."""
        return {"kind": self.kind, "path": str(self.path), "size_bytes": self.size_bytes,
                "files": self.files, "last_used_s": round(self.last_used_s, 3),
                "temporary": self.temporary}


@dataclass(frozen=True)
class KindSummary:
    """One top-level folder of the cache: its entries and their totals."""

    kind: str
    known: bool  # a kind infermux writes (in KINDS)
    entries: tuple[CacheEntry, ...]

    @property
    def size_bytes(self) -> int:
        """Bytes of every entry of the kind."""
        return sum(e.size_bytes for e in self.entries)

    @property
    def files(self) -> int:
        """Files in every entry of the kind."""
        return sum(e.files for e in self.entries)

    @property
    def oldest_used_s(self) -> float | None:
        """When the least recently used entry was last used (epoch seconds); None when empty."""
        return min((e.last_used_s for e in self.entries), default=None)

    @property
    def newest_used_s(self) -> float | None:
        """When the most recently used entry was last used (epoch seconds); None when empty."""
        return max((e.last_used_s for e in self.entries), default=None)

    def to_dict(self, *, entries: bool = False) -> dict[str, Any]:
        """Totals as JSON-ready values (with every entry when `entries`)."""
        data: dict[str, Any] = {
            "kind": self.kind, "known": self.known, "description": KINDS.get(self.kind),
            "entries": len(self.entries), "size_bytes": self.size_bytes, "files": self.files,
            "oldest_used_s": self.oldest_used_s, "newest_used_s": self.newest_used_s}
        if entries:
            data["items"] = [e.to_dict() for e in self.entries]
        return data


@dataclass(frozen=True)
class CacheSummary:
    """The cache root and every kind found under it, with the time of the walk."""

    root: Path
    kinds: tuple[KindSummary, ...]
    scanned_at_s: float

    @property
    def size_bytes(self) -> int:
        """Bytes of every entry of every kind."""
        return sum(k.size_bytes for k in self.kinds)

    @property
    def entries(self) -> list[CacheEntry]:
        """Every entry of every kind."""
        return [e for k in self.kinds for e in k.entries]

    def kind(self, name: str) -> KindSummary | None:
        """The kind called `name`, if the root holds it."""
        return next((k for k in self.kinds if k.kind == name), None)

    def to_dict(self, *, entries: bool = False) -> dict[str, Any]:
        """The summary as JSON-ready values (with every entry when `entries`)."""
        return {"root": str(self.root), "exists": self.root.is_dir(),
                "size_bytes": self.size_bytes, "entries": len(self.entries),
                "scanned_at_s": round(self.scanned_at_s, 3),
                "kinds": [k.to_dict(entries=entries) for k in self.kinds]}


@dataclass(frozen=True)
class PruneResult:
    """What a prune or a clear removed (or would remove, in a dry run) and what it left."""

    root: Path
    removed: tuple[CacheEntry, ...]
    kept_bytes: int  # bytes of the kinds acted on, after the removal
    dry_run: bool = False
    max_bytes: int | None = None
    older_than_s: float | None = None
    skipped_temporary: int = 0  # writers' fresh temporaries left alone
    failed: tuple[tuple[str, str], ...] = field(default=())  # (path, why) not removed

    @property
    def freed_bytes(self) -> int:
        """Bytes of the entries removed."""
        return sum(e.size_bytes for e in self.removed)

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready values."""
        return {"root": str(self.root), "dry_run": self.dry_run, "max_bytes": self.max_bytes,
                "older_than_s": self.older_than_s, "removed_entries": len(self.removed),
                "freed_bytes": self.freed_bytes, "kept_bytes": self.kept_bytes,
                "skipped_temporary": self.skipped_temporary,
                "failed": [{"path": p, "error": why} for p, why in self.failed],
                "removed": [e.to_dict() for e in self.removed]}


# --- walking -------------------------------------------------------------------------------------

def scan(root: Path) -> CacheSummary:
    """Walk `root` into its kinds and entries; an absent root is an empty cache.

    Kinds are the root's sub-folders (symbolic links among them are not followed); files at
    the root itself belong to no kind and are left out, as nothing of infermux writes there.
    """
    root = Path(root)
    now = time.time()
    kinds: list[KindSummary] = []
    for item in _children(root):
        if not item.is_dir(follow_symlinks=False):
            continue
        entries = tuple(sorted(_entries(item.name, Path(item.path)),
                               key=lambda e: e.last_used_s))
        kinds.append(KindSummary(item.name, item.name in KINDS, entries))
    kinds.sort(key=lambda k: k.kind)
    return CacheSummary(root, tuple(kinds), now)


def _children(folder: Path) -> list[os.DirEntry[str]]:
    """A folder's children; none when it is missing, gone, unreadable, or not a folder."""
    try:
        with os.scandir(folder) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def _entries(kind: str, folder: Path) -> list[CacheEntry]:
    """A kind's entries under `folder` (its own folder, or a container inside it)."""
    if kind in _WHOLE_KINDS:
        measured = _measure(folder)
        return [CacheEntry(kind, folder, *measured)] if measured and measured[1] else []
    out: list[CacheEntry] = []
    for item in _children(folder):
        path = Path(item.path)
        if item.name in _CONTAINERS.get(kind, ()) and item.is_dir(follow_symlinks=False):
            out.extend(_entries(kind, path))
            continue
        measured = _measure(path)
        if measured is None:  # gone since the listing: another process removed it
            continue
        size, files, used = measured
        out.append(CacheEntry(kind, path, size, files, used, _is_temporary(item)))
    return out


def _is_temporary(item: os.DirEntry[str]) -> bool:
    if item.is_dir(follow_symlinks=False):
        return item.name.startswith("tmp")
    return item.name.endswith(".tmp")


def _last_used(st: os.stat_result) -> float:
    # A file's later of mtime and atime. infermux's own readers set the mtime when they reuse
    # an entry (`touch`), which works on every mount; atime is read as well because OpenVINO,
    # torch.compile and ONNX Runtime read their caches without telling us, and the kernel still
    # moves atime under the default `relatime` (at least once a day). Under `noatime` only the
    # mtime speaks, which is what infermux's touches are for. A folder's atime is left out:
    # listing it moves it, and this module's own walk lists every folder.
    if stat.S_ISDIR(st.st_mode):
        return st.st_mtime
    return max(st.st_mtime, st.st_atime)


def _measure(path: Path) -> tuple[int, int, float] | None:
    """(bytes, files, last used) of a file, a link (itself) or a folder; None if it is gone.

    Sizes are apparent sizes (`st_size`), as `ls` shows them. Symbolic links count as the
    link itself: what they point to may lie outside the root and is not the cache's.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size, 1, _last_used(st)
    size, files, used = 0, 0, _last_used(st)
    # os.walk never follows links unless asked; a folder vanishing mid-walk is skipped.
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        for name in (*filenames, *dirnames):
            try:
                child = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            used = max(used, _last_used(child))
            if not stat.S_ISDIR(child.st_mode):
                size += child.st_size
                files += 1
    return size, files, used


# --- removing ------------------------------------------------------------------------------------

def select_kinds(summary: CacheSummary, kinds: Iterable[str] | None) -> list[KindSummary]:
    """The kinds to act on: the ones named (checked), else every kind infermux writes."""
    if kinds is None:
        return [k for k in summary.kinds if k.known]
    names = list(dict.fromkeys(kinds))
    present = {k.kind for k in summary.kinds}
    allowed = sorted(set(KINDS) | present)
    for name in names:
        if name not in allowed:
            raise UsageError(f"cache kind {name!r} unknown: use one of {', '.join(allowed)} "
                             "(e.g. --kind onnx)")
    return [k for k in summary.kinds if k.kind in names]


def prune(root: Path, max_bytes: int | None = None, older_than_s: float | None = None,
          kinds: Iterable[str] | None = None, dry_run: bool = False,
          keep: Iterable[Path] = ()) -> PruneResult:
    """Remove entries least recently used first, to an age and/or a total size.

    Every entry unused for `older_than_s` goes, then more until the kinds acted on hold at
    most `max_bytes`. `kinds` limits the removal (and the size counted against `max_bytes`)
    to those kinds; by default every kind infermux writes. Entries in `keep` (a writer's new file) and
    writers' fresh temporaries are never removed, though they count towards the size.
    """
    if max_bytes is None and older_than_s is None:
        raise UsageError("a prune needs a bound: give a maximum size, an age, or both "
                         "(e.g. --max-size 5GB or --older-than 30d)")
    if max_bytes is not None and max_bytes < 0:
        raise UsageError(f"maximum cache size {max_bytes} is negative: give bytes, e.g. 5GB")
    if older_than_s is not None and older_than_s < 0:
        raise UsageError(f"age {older_than_s} s is negative: give a duration, e.g. 30d")
    root = Path(root)
    summary = scan(root)
    chosen = select_kinds(summary, kinds)
    kept_paths = {Path(os.path.abspath(p)) for p in keep}
    entries = [e for k in chosen for e in k.entries]
    total = sum(e.size_bytes for e in entries)
    removable, skipped = _removable(entries, kept_paths, summary.scanned_at_s)
    doomed: list[CacheEntry] = []
    if older_than_s is not None:
        cutoff = summary.scanned_at_s - older_than_s
        doomed = [e for e in removable if e.last_used_s < cutoff]
    if max_bytes is not None:
        left = total - sum(e.size_bytes for e in doomed)
        taken = {id(e) for e in doomed}
        for entry in removable:  # least recently used first (entries are sorted so)
            if left <= max_bytes:
                break
            if id(entry) not in taken:
                doomed.append(entry)
                left -= entry.size_bytes
    removed, failed = _remove(root, doomed, dry_run)
    return PruneResult(root, tuple(removed), total - sum(e.size_bytes for e in removed),
                       dry_run, max_bytes, older_than_s, skipped, tuple(failed))


def clear(root: Path, kinds: Iterable[str] | None = None, dry_run: bool = False) -> PruneResult:
    """Remove every entry of `kinds` (by default every kind infermux writes).

    Writers' fresh temporaries stay: removing one would fail its writer's rename.
    """
    root = Path(root)
    summary = scan(root)
    entries = [e for k in select_kinds(summary, kinds) for e in k.entries]
    removable, skipped = _removable(entries, set(), summary.scanned_at_s)
    removed, failed = _remove(root, removable, dry_run)
    total = sum(e.size_bytes for e in entries)
    return PruneResult(root, tuple(removed), total - sum(e.size_bytes for e in removed),
                       dry_run, skipped_temporary=skipped, failed=tuple(failed))


def _removable(entries: list[CacheEntry], keep: set[Path],
               now: float) -> tuple[list[CacheEntry], int]:
    """Entries that may go, least recently used first, and how many fresh temporaries stay."""
    fresh = [e for e in entries if e.temporary and e.last_used_s > now - TEMP_GRACE_S]
    fresh_ids = {id(e) for e in fresh}
    out = [e for e in entries if id(e) not in fresh_ids and not _kept(e.path, keep)]
    out.sort(key=lambda e: e.last_used_s)
    return out, len(fresh)


def _kept(path: Path, keep: set[Path]) -> bool:
    """Whether the entry at `path` is, or holds, one of the paths to keep."""
    path = Path(os.path.abspath(path))
    return any(k == path or path in k.parents for k in keep)


def _inside(root: Path, path: Path) -> bool:
    """Whether `path` lies strictly under `root`, by its written form (no link is resolved)."""
    base = os.path.abspath(root)
    target = os.path.abspath(path)
    return target != base and os.path.commonpath([base, target]) == base


def _remove(root: Path, entries: list[CacheEntry],
            dry_run: bool) -> tuple[list[CacheEntry], list[tuple[str, str]]]:
    removed: list[CacheEntry] = []
    failed: list[tuple[str, str]] = []
    for entry in entries:
        if not _inside(root, entry.path):  # entries come from walking root; never otherwise
            failed.append((str(entry.path), "outside the cache root"))
            continue
        if dry_run:
            removed.append(entry)
            continue
        try:
            gone = _delete(entry.path)
        except OSError as exc:  # read-only cache, permissions: said, and the rest goes on
            failed.append((str(entry.path), exc.strerror or type(exc).__name__))
            continue
        if gone:  # else another process removed it first: not ours to count
            removed.append(entry)
    return removed, failed


def _delete(path: Path) -> bool:
    """Remove a file, a link (never its target) or a folder; False if it was already gone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return _unless_gone(os.unlink, path)
    # Bottom-up, without following links: a link inside is unlinked, its target untouched.
    for dirpath, dirnames, filenames in os.walk(path, topdown=False, followlinks=False):
        for name in filenames:
            _unless_gone(os.unlink, os.path.join(dirpath, name))
        for name in dirnames:
            child = os.path.join(dirpath, name)
            _unless_gone(os.unlink if os.path.islink(child) else os.rmdir, child)
    return _unless_gone(os.rmdir, path)


def _unless_gone(fn: Callable[[str | Path], None], path: str | Path) -> bool:
    """Call `fn(path)`; False when the path was gone (another process removed it first)."""
    try:
        fn(path)
    except FileNotFoundError:
        return False
    return True


# --- readers and writers -------------------------------------------------------------------------

def touch(path: Path) -> None:
    """Mark a reused entry as used now (its mtime), so pruning removes it last.

    An entry marked within the last `_TOUCH_AFTER_S` is left as it is. A read-only cache (a
    shared, mounted one) or an entry removed meanwhile is not an error: the entry is simply
    not marked.
    """
    try:
        if time.time() - os.stat(path).st_mtime < _TOUCH_AFTER_S:
            return
        os.utime(path)
    except OSError:  # EROFS, EACCES, EPERM, ENOENT: a mark we cannot make is no failure
        return


def max_size_from_env() -> int | None:
    """The bound `INFERMUX_CACHE_MAX_SIZE` sets (bytes), or None when it is unset or empty."""
    from infermux._parse import parse_bytes

    text = os.environ.get(MAX_SIZE_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_bytes(text, name=MAX_SIZE_ENV)
    except UsageError as exc:
        raise UsageError(f"{exc}, or unset it for no bound") from None


def bound_after_write(root: Path, *written: Path) -> PruneResult | None:
    """After a writer added `written` under `root`: prune to `INFERMUX_CACHE_MAX_SIZE`, if set.

    The new entries themselves are never removed, even when they alone are over the bound.
    Unset, this does nothing (the cache grows until pruned by hand).
    """
    limit = max_size_from_env()
    if limit is None:
        return None
    return prune(root, max_bytes=limit, keep=written)
