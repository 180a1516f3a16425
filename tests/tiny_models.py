"""Small real networks for runtime tests (referenced as tests/tiny_models.py:NAME)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
from torch import nn


class TinyCNN(nn.Module):
    """A few convolutions on 3x32x32 inputs: milliseconds per batch on one core."""

    input_shape = (3, 32, 32)

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class FlakyCNN(TinyCNN):
    """Raises an engine-side error once it has run `fail_after` batches pinned to core 1."""

    fail_after = 20

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.sched_getaffinity(0) == {1}:
            self.calls += 1
            if self.calls > self.fail_after:
                raise RuntimeError("injected kernel failure on core 1")
        return super().forward(x)


def tiny_cnn() -> nn.Module:
    return TinyCNN(16)


def wide_cnn() -> nn.Module:
    return TinyCNN(64)


def flaky_cnn() -> nn.Module:
    return FlakyCNN()


class FailingCNN(TinyCNN):
    """Builds and warms up fine, then raises on every batch a runtime worker thread runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name.startswith("infermux-"):
            raise RuntimeError("injected failure in a worker")
        return super().forward(x)


class SwitchedCNN(TinyCNN):
    """Hangs or raises once the file named by $INFERMUX_TEST_SWITCH says `hang` or `fail`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = os.environ.get("INFERMUX_TEST_SWITCH")
        what = Path(path).read_text() if path and os.path.exists(path) else ""
        if what == "hang":
            time.sleep(3600)
        if what == "fail":
            raise RuntimeError("injected failure in the child")
        return super().forward(x)


def failing_cnn() -> nn.Module:
    return FailingCNN()


def switched_cnn() -> nn.Module:
    return SwitchedCNN()


class PacedCNN(TinyCNN):
    """Sleeps `pace_s` per batch, whatever its size (the interpreter lock released), then runs:
    a device whose batch costs the same at batch 1 and batch 8."""

    pace_s = 0.004

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.pace_s)
        return super().forward(x)


def paced_cnn() -> nn.Module:
    return PacedCNN()
