"""Training data under measurement: image files decoded per item, or a tensor file, at a storage path.

- `write_synthetic`: images written to disk as JPEG or PNG (smooth random fields tinted by class,
  so a network can learn them and the files compress like photographs), so decoding and I/O in
  the loader are real work. Written once per (count, size, classes, format, seed) and reused.
- `stage`: the data set copied to a storage location (a folder on disk, or on a tmpfs such as
  /dev/shm); the file system type is read from /proc/mounts and recorded.
- `evict`: drops a data set's pages from the page cache (`posix_fadvise(DONTNEED)` on each of
  its files; no root needed, other files untouched), so a first epoch reads from the medium. On
  a tmpfs the pages are the files themselves: nothing is evicted, and the record says so.
- `ImageFiles` and `TensorFile` are torch Datasets whose items carry the loader's own timing
  (wall, CPU and read time of each item, in ns, measured where the item is loaded: in a loader
  worker process or in the training process), so a batch tells how long it took to make even
  when workers made it in the background.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infermux.cache import touch
from infermux.errors import RunError, UsageError

__all__ = [
    "IMAGE_FORMATS",
    "DataSpec",
    "ImageFiles",
    "TensorFile",
    "evict",
    "fs_type",
    "open_dataset",
    "resolve_storage",
    "stage",
    "write_synthetic",
]

IMAGE_FORMATS = ("jpeg", "png")
_SUFFIX = {"jpeg": ".jpg", "png": ".png"}
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
_MEAN = np.asarray((0.485, 0.456, 0.406), dtype=np.float32).reshape(3, 1, 1)
_STD = np.asarray((0.229, 0.224, 0.225), dtype=np.float32).reshape(3, 1, 1)
#: Where `--storage tmpfs` puts data sets.
TMPFS_ROOT = Path("/dev/shm")


@dataclass(frozen=True)
class DataSpec:
    """Where the training data comes from.

    `source` is `synthetic` (written here: `count` images of `size`×`size`, `classes` classes,
    `fmt` jpeg or png), an ImageFolder directory (`DIR/CLASS/img.jpg`), or a tensor file
    (`.pt`/`.npz` holding `x` (N, C, H, W) float and `y` (N,) integer labels).
    """

    source: str = "synthetic"
    count: int = 2000
    size: int = 64
    classes: int = 10
    fmt: str = "jpeg"
    seed: int = 0

    def validate(self) -> None:
        """One line naming a bad value and what is allowed."""
        if self.source == "synthetic":
            if self.count < 1:
                raise UsageError(f"--images {self.count}: a data set needs at least 1 image, "
                                 "e.g. --images 2000")
            if not 8 <= self.size <= 1024:
                raise UsageError(f"--image-size {self.size} is out of range: use 8 to 1024 "
                                 "pixels, e.g. --image-size 64")
            if self.classes < 1:
                raise UsageError(f"--classes {self.classes}: use 1 or more, e.g. --classes 10")
            if self.fmt not in IMAGE_FORMATS:
                raise UsageError(f"--image-format {self.fmt!r} is not one of "
                                 f"{', '.join(IMAGE_FORMATS)}: e.g. --image-format jpeg")
            return
        path = Path(self.source)
        if not path.exists():
            raise UsageError(f"--data {self.source!r} does not exist: give an ImageFolder "
                             "directory, a .pt/.npz tensor file, or synthetic")
        if path.is_file() and path.suffix not in (".pt", ".npz"):
            raise UsageError(f"--data {self.source!r} is a {path.suffix or 'suffix-less'} file: "
                             "a tensor file ends in .pt or .npz; or give a directory, or synthetic")

    @property
    def key(self) -> str:
        """A short stable name for the data set's folder."""
        if self.source == "synthetic":
            return f"synthetic-{self.count}x{self.size}-{self.classes}c-{self.fmt}-s{self.seed}"
        path = Path(self.source).resolve()
        return f"{path.stem}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"source": self.source, "count": self.count, "size": self.size,
                "classes": self.classes, "format": self.fmt, "seed": self.seed}


def _synthetic_image(rng: np.random.Generator, size: int, label: int, classes: int) -> np.ndarray:
    """A smooth random field tinted by class: HxWx3 uint8."""
    coarse = rng.random((max(2, size // 8), max(2, size // 8), 3)).astype(np.float32)
    reps = -(-size // coarse.shape[0])
    field = np.kron(coarse, np.ones((reps, reps, 1), dtype=np.float32))[:size, :size]
    hue = np.asarray([np.cos(2 * np.pi * (label / classes + k / 3)) for k in range(3)],
                     dtype=np.float32)
    noise = rng.normal(0.0, 0.08, (size, size, 3)).astype(np.float32)
    image = 0.55 * field + 0.3 * (0.5 + 0.5 * hue) + noise
    return (np.clip(image, 0.0, 1.0) * 255).astype(np.uint8)


def _write_images(folder: str, spec: DataSpec, start: int, stop: int) -> int:
    """Write images `start`..`stop` of `spec` into `folder`; their bytes in all.

    Each image has its own generator (seeded by the set's seed and its number), so the set is
    the same however many processes write it.
    """
    from PIL import Image

    digits = len(str(spec.classes - 1))
    sizes = 0
    for i in range(start, stop):
        label = i % spec.classes
        array = _synthetic_image(np.random.default_rng([spec.seed, i]), spec.size, label,
                                 spec.classes)
        path = Path(folder) / f"class{label:0{digits}d}" / f"{i:07d}{_SUFFIX[spec.fmt]}"
        buffer = io.BytesIO()
        if spec.fmt == "jpeg":
            Image.fromarray(array).save(buffer, format="JPEG", quality=90)
        else:
            Image.fromarray(array).save(buffer, format="PNG")
        path.write_bytes(buffer.getvalue())
        sizes += buffer.tell()
    return sizes


def write_synthetic(spec: DataSpec, root: Path) -> Path:
    """Write `spec`'s images as `root/<key>/<class>/<n>.jpg` once; returns that folder.

    Large sets are written by a process per usable core. A manifest written last marks a
    complete set; a set interrupted half-way is rewritten.
    """
    spec.validate()
    folder = root / spec.key
    manifest = folder / "manifest.json"
    if manifest.is_file():
        touch(folder)  # marked used: the cache prunes the least recently used sets first
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    digits = len(str(spec.classes - 1))
    for c in range(spec.classes):
        (folder / f"class{c:0{digits}d}").mkdir(parents=True, exist_ok=True)
    procs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if spec.count < 2000 or procs < 2:
        sizes = _write_images(str(folder), spec, 0, spec.count)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        chunk = -(-spec.count // (procs * 4))
        bounds = [(i, min(spec.count, i + chunk)) for i in range(0, spec.count, chunk)]
        with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            sizes = sum(pool.map(_write_images, *zip(*[(str(folder), spec, a, b)
                                                        for a, b in bounds], strict=True)))
    manifest.write_text(json.dumps({**spec.to_dict(), "bytes": sizes, "generator": 2}))
    return folder


def fs_type(path: Path) -> str:
    """The file system type holding `path` (`tmpfs`, `ext4`, `overlay`, ...), from /proc/mounts."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "unknown"
    target = str(path.resolve())
    best, kind = "", "unknown"
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, parts[2]
    return kind


def resolve_storage(storage: str, disk_root: Path) -> Path:
    """`disk` → `disk_root`, `tmpfs` → /dev/shm/infermux-train, anything else → that folder."""
    if storage == "disk":
        path = disk_root
    elif storage == "tmpfs":
        if not TMPFS_ROOT.is_dir() or fs_type(TMPFS_ROOT) != "tmpfs":
            raise UsageError(f"--storage tmpfs: {TMPFS_ROOT} is not a tmpfs on this machine: "
                             "give a folder on a tmpfs instead, e.g. --storage /run/user/0")
        path = TMPFS_ROOT / "infermux-train"
    else:
        path = Path(storage).expanduser()
        if path.exists() and not path.is_dir():
            raise UsageError(f"--storage {storage!r} is a file: give disk, tmpfs or a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--storage {storage!r}: cannot create {str(path)!r} ({exc.strerror}); "
                         "give a writable folder, disk or tmpfs") from exc
    return path


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")


def stage(source: Path, storage_dir: Path) -> Path:
    """Copy a data set (folder or file) into `storage_dir` once; returns the copy's path."""
    target = storage_dir / source.name
    done = storage_dir / f".{source.name}.staged"
    if done.is_file() and target.exists():
        return target
    if source.resolve() == target.resolve():
        return target
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    try:
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
    except OSError as exc:
        raise RunError(f"cannot copy the data set to {str(storage_dir)!r}: {exc}; free space "
                       "there or pick another --storage") from exc
    done.write_text("")
    return target


def evict(path: Path) -> dict[str, Any]:
    """Drop `path`'s files (a folder or a file) from the page cache; says what was done.

    On a tmpfs nothing can be evicted (the page cache is where its files live).
    """
    kind = fs_type(path)
    files = _files(path) if path.is_dir() else [path]
    if kind in ("tmpfs", "ramfs"):
        return {"evicted": False, "fs": kind, "files": len(files),
                "note": f"{kind}: files live in memory, nothing to evict"}
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:  # pragma: no cover - non-Linux
        return {"evicted": False, "fs": kind, "files": len(files),
                "note": "posix_fadvise is not available: the page cache was not dropped"}
    t0 = time.perf_counter()
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return {"evicted": True, "fs": kind, "files": len(files),
            "seconds": time.perf_counter() - t0}


def _scan_folder(folder: Path) -> tuple[list[tuple[str, int]], list[str]]:
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if not classes:
        raise UsageError(f"--data {str(folder)!r} has no class folders: lay it out as "
                         "DIR/CLASS/image.jpg (ImageFolder)")
    items = [(str(p), i) for i, c in enumerate(classes) for p in sorted((folder / c).iterdir())
             if p.suffix.lower() in _IMAGE_SUFFIXES]
    if not items:
        raise UsageError(f"--data {str(folder)!r} holds no images ({', '.join(_IMAGE_SUFFIXES)})")
    return items, classes


class ImageFiles:
    """An ImageFolder-style data set read and decoded per item (PIL), with per-item timing.

    Items are `(x, y, timing)`: `x` float32 (3, H, W) resized to `size` and normalised with
    ImageNet's mean and std, `y` the class index, `timing` int64 [wall_ns, cpu_ns, read_ns] of
    loading this item (read_ns: reading the file's bytes; the rest is decoding and transforms).
    """

    def __init__(self, folder: Path, size: tuple[int, int]) -> None:
        self.folder = folder
        self.size = size
        self.items, self.classes = _scan_folder(folder)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[Any, int, Any]:
        import torch
        from PIL import Image

        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        path, label = self.items[index]
        with open(path, "rb") as handle:
            raw = handle.read()
        t_read = time.perf_counter_ns() - t0
        with Image.open(io.BytesIO(raw)) as image:
            rgb = image.convert("RGB")
            if rgb.size != (self.size[1], self.size[0]):
                rgb = rgb.resize((self.size[1], self.size[0]), Image.Resampling.BILINEAR)
            array = np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / 255.0
        x = torch.from_numpy((array - _MEAN) / _STD)
        timing = torch.tensor([time.perf_counter_ns() - t0, time.thread_time_ns() - c0, t_read])
        return x, label, timing

    def files(self) -> list[Path]:
        """The image files, in item order."""
        return [Path(p) for p, _ in self.items]


class TensorFile:
    """A preprocessed tensor file (`x`, `y`), memory-mapped where it can be, with per-item timing."""

    def __init__(self, path: Path) -> None:
        import torch

        if path.suffix == ".npz":
            data = np.load(path, mmap_mode="r")
            self.x, self.y = data["x"], data.get("y")
        else:
            try:
                data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:
                raise UsageError(f"--data {str(path)!r} cannot be read as a tensor file ({exc}); "
                                 "save a dict {'x': tensor, 'y': tensor} with torch.save") from exc
            if not isinstance(data, dict) or "x" not in data:
                raise UsageError(f"--data {str(path)!r} holds no 'x': save a dict "
                                 "{'x': (N, C, H, W) float tensor, 'y': (N,) labels}")
            self.x, self.y = data["x"], data.get("y")
        if self.y is None:
            raise UsageError(f"--data {str(path)!r} has no labels 'y': training needs them")
        if len(self.x) != len(self.y):
            raise UsageError(f"--data {str(path)!r}: x has {len(self.x)} items and y {len(self.y)}")
        self.path = path
        self.classes = [str(c) for c in range(int(np.asarray(self.y).max()) + 1)]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[Any, int, Any]:
        import torch

        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        x = torch.as_tensor(np.array(self.x[index], dtype=np.float32))
        label = int(self.y[index])
        wall = time.perf_counter_ns() - t0
        return x, label, torch.tensor([wall, time.thread_time_ns() - c0, wall])

    def files(self) -> list[Path]:
        """The one file."""
        return [self.path]


def open_dataset(path: Path, input_shape: tuple[int, ...]) -> ImageFiles | TensorFile:
    """The data set at `path` (a staged folder or tensor file), shaped for `input_shape`."""
    if path.is_file():
        return TensorFile(path)
    if len(input_shape) != 3 or input_shape[0] != 3:
        raise UsageError(f"image data needs a model taking 3×H×W items, not "
                         f"{'×'.join(map(str, input_shape))}: pass --input-shape 3xHxW or a "
                         "tensor file shaped as the model's input")
    return ImageFiles(path, (input_shape[1], input_shape[2]))
