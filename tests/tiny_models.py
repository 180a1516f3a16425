"""Small real networks for runtime tests (referenced as tests/tiny_models.py:NAME)."""

from __future__ import annotations

import os

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
