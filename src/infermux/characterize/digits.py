"""`digits-cnn`: a small CNN trained on scikit-learn's 8×8 handwritten digits, needing no download.

The 1,797 digit images ship inside scikit-learn (`sklearn.datasets.load_digits`), so the model,
its labelled test split and an int8 calibration split exist on any machine: the whole
characterization study runs in CI. The images are upsampled to 1×32×32 (bilinear) and
normalised to mean 0.5, std 0.5.

Splits (one seeded permutation, fixed for good): 360 test items, 180 calibration items (held out
from training and from the test), the remaining 1,257 for training. Training takes a few
seconds on two CPU cores; the weights are cached under the infermux cache folder
(`$INFERMUX_CACHE_DIR/characterize/`), keyed by this file's network and recipe.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from infermux.errors import UsageError

__all__ = [
    "INPUT_SHAPE",
    "DigitsCNN",
    "build",
    "digits_splits",
    "load_digits_images",
    "train",
    "trained_weights",
]

#: One item as the network takes it.
INPUT_SHAPE = (1, 32, 32)
TEST_ITEMS = 360
CALIBRATION_ITEMS = 180
_SPLIT_SEED = 0
#: The training recipe; part of the cache key with the network's source. One thread: the
#: weights then do not depend on the machine's core count, and on a busy 2-core machine two
#: threads trained this small network in 137 s against 20 s for one.
_RECIPE = {"epochs": 10, "batch": 64, "lr": 3e-3, "weight_decay": 1e-4, "seed": 0,
           "threads": 1}


class DigitsCNN(nn.Module):
    """Three convolutions and a linear head: ~25k parameters, 10 classes."""

    input_shape = INPUT_SHAPE

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (N, 10) of images (N, 1, 32, 32)."""
        return self.head(self.features(x))


def build() -> DigitsCNN:
    """The network, randomly initialised (seeded); `trained_weights()` gives its weights."""
    torch.manual_seed(0)
    return DigitsCNN().eval()


def load_digits_images() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits as (N, 8, 8) floats in [0, 1] and their labels (N,) int64."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UsageError(
            "the built-in digits data set needs scikit-learn: pip install 'infermux[characterize]'"
        ) from None
    bunch = load_digits()
    images = np.asarray(bunch.images, dtype=np.float32) / 16.0
    return images, np.asarray(bunch.target, dtype=np.int64)


def digits_splits() -> dict[str, np.ndarray]:
    """Item indices of the `train`, `calibration` and `test` splits (disjoint, fixed)."""
    images, _ = load_digits_images()
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(images))
    return {
        "test": order[:TEST_ITEMS],
        "calibration": order[TEST_ITEMS:TEST_ITEMS + CALIBRATION_ITEMS],
        "train": order[TEST_ITEMS + CALIBRATION_ITEMS:],
    }


def _to_input(images: np.ndarray) -> np.ndarray:
    """(N, 8, 8) in [0, 1] → (N, 1, 32, 32) normalised, as the network takes them."""
    from infermux.characterize.images import adapt_images

    return adapt_images(images[:, None], INPUT_SHAPE)


def _cache_key() -> str:
    text = inspect.getsource(DigitsCNN) + json.dumps(_RECIPE, sort_keys=True)
    text += f"|{TEST_ITEMS}|{CALIBRATION_ITEMS}|{_SPLIT_SEED}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def train(epochs: int | None = None) -> tuple[dict[str, Any], float, float]:
    """Train the network on the train split: (state dict, test top-1, seconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(_RECIPE["threads"]))
    try:
        return _train(epochs)
    finally:
        torch.set_num_threads(threads)


def _train(epochs: int | None) -> tuple[dict[str, Any], float, float]:
    started = time.perf_counter()
    images, labels = load_digits_images()
    splits = digits_splits()
    x = torch.from_numpy(_to_input(images[splits["train"]]))
    y = torch.from_numpy(labels[splits["train"]])
    generator = torch.Generator().manual_seed(int(_RECIPE["seed"]))
    model = build().train()
    optimiser = torch.optim.AdamW(model.parameters(), lr=_RECIPE["lr"],
                                  weight_decay=_RECIPE["weight_decay"])
    n_epochs = epochs or int(_RECIPE["epochs"])
    steps = n_epochs * -(-len(x) // int(_RECIPE["batch"]))
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=_RECIPE["lr"],
                                                   total_steps=steps)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(n_epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), int(_RECIPE["batch"])):
            idx = order[start:start + int(_RECIPE["batch"])]
            optimiser.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimiser.step()
            schedule.step()
    model.eval()
    test_x = torch.from_numpy(_to_input(images[splits["test"]]))
    with torch.inference_mode():
        predicted = model(test_x).argmax(dim=1).numpy()
    accuracy = float(np.mean(predicted == labels[splits["test"]]))
    return model.state_dict(), accuracy, time.perf_counter() - started


def trained_weights(root: Path | None = None) -> str:
    """Path of the trained weights (a state dict), training them first if the cache lacks them.

    The file is written beside its final name and renamed into place, so two processes training
    at once both end with a complete file.
    """
    from infermux.cache import bound_after_write, touch
    from infermux.export import cache_dir

    base = root or cache_dir()
    folder = base / "characterize"
    path = folder / f"digits-cnn-{_cache_key()}.pt"
    if path.is_file() and path.stat().st_size > 0:
        touch(path)
        touch(path.with_suffix(".json"))
        return str(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the cache folder {str(folder)!r} ({exc}); "
                         "set INFERMUX_CACHE_DIR to a writable folder") from exc
    state, accuracy, seconds = train()
    fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    path.with_suffix(".json").write_text(json.dumps(
        {"test_top1": accuracy, "train_s": round(seconds, 2), "recipe": _RECIPE}))
    bound_after_write(base, path, path.with_suffix(".json"))
    return str(path)
