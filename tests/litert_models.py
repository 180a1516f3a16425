"""A seeded small CNN for the LiteRT tests: the same weights in every process that loads it.

LiteRT's conversion cache is keyed by the network's content, so runtime workers, which load the
model themselves, reuse the conversion a test made instead of converting again.
"""

from __future__ import annotations

import torch
from torch import nn


def seeded_tiny_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )
