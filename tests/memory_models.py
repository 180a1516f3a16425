"""A tiny network on a device that holds only so many items (referenced as
tests/memory_models.py:NAME): batches above the limit raise PyTorch's own out-of-memory error,
as a GPU does when a batch's activations do not fit."""

from __future__ import annotations

import torch
from torch import nn


class BoundedCNN(nn.Module):
    """A few convolutions on 3x32x32 inputs that run out of memory above `limit` items."""

    input_shape = (3, 32, 32)
    limit = 16

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(
                f"out of memory: a batch of {x.shape[0]} does not fit (at most {self.limit})")
        return self.body(x)


def bounded_cnn() -> nn.Module:
    return BoundedCNN()
