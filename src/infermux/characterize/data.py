"""Labelled data for characterization: an ImageFolder directory, a tensor file, or the digits.

Every source ends as a `Dataset`: preprocessed float32 items shaped as the model takes them,
labels (or none), and a calibration split disjoint from the evaluated items (int8 engines are
calibrated on it, never on what they are scored on).

- A directory in ImageFolder layout (`DIR/CLASS/image.jpg`; classes in sorted order, as
  torchvision numbers them — ImageNet's synset folders give ImageNet's class indices): resized to
  `size / 0.875`, centre-cropped to the model's input size, scaled to [0, 1] and normalised with
  ImageNet's mean and std for 3 channels (0.5 and 0.5 for other channel counts); 1-channel
  models get greyscale images.
- A tensor file: `.npz` or `.pt` holding `x` (N, *input_shape), already preprocessed, and
  optionally `y` (N,) integer labels. `.pt` files are read with `weights_only=True`.
- `digits` (the default): scikit-learn's handwritten digits, upsampled and normalised to the
  model's input shape, with the splits `digits-cnn` was trained around.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infermux.characterize.images import adapt_images, mean_std
from infermux.errors import UsageError

__all__ = ["DIGITS", "Dataset", "adapt_images", "load_data"]

#: The name of the built-in data set (`--data digits`).
DIGITS = "digits"
#: Items evaluated from an image folder when no count is given (each costs a decode).
DEFAULT_FOLDER_ITEMS = 1000


@dataclass
class Dataset:
    """Evaluated items, their labels, and a held-out calibration split."""

    name: str
    x: np.ndarray  # (N, *input_shape) float32, preprocessed
    y: np.ndarray | None  # (N,) int64, or None when unlabelled
    calibration: np.ndarray  # (M, *input_shape) float32, disjoint from x
    classes: list[str] | None
    note: str

    def describe(self) -> dict[str, Any]:
        """The data's part of a report."""
        return {"name": self.name, "items": len(self.x), "labelled": self.y is not None,
                "calibration_items": len(self.calibration),
                "classes": len(self.classes) if self.classes else None, "note": self.note}


def _split(n: int, calibration_items: int, items: int | None, seed: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """(evaluated, calibration) indices from one seeded permutation, disjoint."""
    order = np.random.default_rng(seed).permutation(n)
    n_cal = min(calibration_items, n // 5) if n > 1 else 0
    calibration, rest = order[:n_cal], order[n_cal:]
    if items is not None:
        rest = rest[:items]
    return np.sort(rest), calibration


def _digits(input_shape: tuple[int, ...], items: int | None, calibration_items: int) -> Dataset:
    from infermux.characterize.digits import digits_splits, load_digits_images

    images, labels = load_digits_images()
    splits = digits_splits()
    test = splits["test"][:items] if items is not None else splits["test"]
    calibration = splits["calibration"][:calibration_items]
    x = adapt_images(images[test][:, None], input_shape)
    cal = adapt_images(images[calibration][:, None], input_shape)
    return Dataset(DIGITS, x, labels[test], cal, [str(d) for d in range(10)],
                   "scikit-learn's 8×8 handwritten digits (test split), upsampled to "
                   f"{'×'.join(map(str, input_shape))}; calibration on its held-out split")


def _tensor_file(path: Path, input_shape: tuple[int, ...], items: int | None,
                 calibration_items: int, seed: int) -> Dataset:
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as found:
                arrays = {k: found[k] for k in found.files}
        except (OSError, ValueError) as exc:
            raise UsageError(f"--data {str(path)!r} is not a readable .npz file ({exc}); "
                             "save it with numpy.savez(path, x=..., y=...)") from exc
    else:
        import torch

        try:
            loaded = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise UsageError(f"--data {str(path)!r} is not a readable .pt file ({exc}); "
                             "save it with torch.save({'x': x, 'y': y}, path)") from exc
        if not isinstance(loaded, dict):
            raise UsageError(f"--data {str(path)!r} holds a {type(loaded).__name__}, not a dict "
                             "with 'x' and 'y': save it with torch.save({'x': x, 'y': y}, path)")
        arrays = {k: v.numpy() if hasattr(v, "numpy") else np.asarray(v) for k, v in loaded.items()}
    if "x" not in arrays:
        raise UsageError(f"--data {str(path)!r} has no 'x' (it has: {', '.join(arrays) or 'nothing'});"
                         " store the inputs as x and the labels as y")
    x = np.asarray(arrays["x"], dtype=np.float32)
    if x.ndim < 2 or tuple(x.shape[1:]) != tuple(input_shape) or len(x) == 0:
        raise UsageError(f"--data {str(path)!r}: x has shape {x.shape}, the model takes "
                         f"(N, {', '.join(map(str, input_shape))}); store preprocessed items of "
                         "that shape")
    y = None
    if "y" in arrays:
        y = np.asarray(arrays["y"]).astype(np.int64).reshape(-1)
        if len(y) != len(x):
            raise UsageError(f"--data {str(path)!r}: {len(x)} items in x but {len(y)} labels in y; "
                             "give one label per item")
    evaluated, calibration = _split(len(x), calibration_items, items, seed)
    return Dataset(path.name, x[evaluated], None if y is None else y[evaluated], x[calibration],
                   None, f"tensor file {path.name}" + ("" if y is not None else " (no labels)"))


def _image_folder(path: Path, input_shape: tuple[int, ...], items: int | None,
                  calibration_items: int, seed: int) -> Dataset:
    from torchvision import datasets, transforms

    if len(input_shape) != 3:
        raise UsageError(f"--data {str(path)!r} is an image folder; the model takes {input_shape}"
                         " items, not (C, H, W) images: pass a tensor file instead")
    channels, height, width = input_shape
    try:
        folder = datasets.ImageFolder(str(path))
    except (FileNotFoundError, RuntimeError) as exc:
        raise UsageError(f"--data {str(path)!r} holds no images in class folders ({exc}); lay it "
                         "out as DIR/CLASS/image.jpg, or pass a .npz/.pt tensor file") from None
    mean, std = mean_std(channels)
    steps: list[Any] = []
    if channels == 1:
        steps.append(transforms.Grayscale(1))
    size = min(height, width)
    steps += [transforms.Resize(round(size / 0.875)), transforms.CenterCrop((height, width)),
              transforms.ToTensor(),
              transforms.Normalize(mean.reshape(-1).tolist(), std.reshape(-1).tolist())]
    transform = transforms.Compose(steps)
    wanted = items if items is not None else DEFAULT_FOLDER_ITEMS
    evaluated, calibration = _split(len(folder.samples), calibration_items, wanted, seed)

    def read(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        xs = np.empty((len(indices), *input_shape), dtype=np.float32)
        ys = np.empty(len(indices), dtype=np.int64)
        for row, i in enumerate(indices):
            file, label = folder.samples[int(i)]
            try:
                image = folder.loader(file)
            except OSError as exc:
                raise UsageError(f"--data: {file!r} is not a readable image ({exc}); remove it "
                                 "or replace it") from None
            xs[row] = transform(image).numpy()
            ys[row] = label
        return xs, ys

    x, y = read(evaluated)
    cal, _ = read(calibration)
    return Dataset(path.name, x, y, cal, list(folder.classes),
                   f"image folder {path.name}: {len(x)} of {len(folder.samples)} images "
                   f"(seeded choice), {len(folder.classes)} classes; resize {round(size / 0.875)}"
                   f", centre crop {height}×{width}, normalised")


def load_data(source: str | None, input_shape: tuple[int, ...], *, items: int | None = None,
              calibration_items: int = 128, seed: int = 0) -> Dataset:
    """Load `source` (a folder, a `.npz`/`.pt` file, `digits` or None for digits) for a model."""
    if items is not None and items < 1:
        raise UsageError(f"--items {items} must be at least 1 (or left out for the default)")
    if calibration_items < 0:
        raise UsageError(f"--calibration-items {calibration_items} must be 0 or more")
    if source in (None, "", DIGITS):
        return _digits(tuple(input_shape), items, calibration_items)
    path = Path(str(source))
    if path.is_dir():
        return _image_folder(path, tuple(input_shape), items, calibration_items, seed)
    if path.is_file() and path.suffix in (".npz", ".pt", ".pth"):
        return _tensor_file(path, tuple(input_shape), items, calibration_items, seed)
    if path.is_file():
        raise UsageError(f"--data {source!r} is a {path.suffix or 'suffix-less'} file: give an image "
                         "folder, a .npz/.pt file with x and y, or digits")
    raise UsageError(f"--data {source!r} does not exist: give an image folder (DIR/CLASS/img.jpg), "
                     "a .npz/.pt file with x and y, or digits (built in)")
