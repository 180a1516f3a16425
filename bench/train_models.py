"""Small CNNs for the training figures (`bench/train_models.py:small_cnn` as a model reference)."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Four 3×3 convolutions with batch norm on 3×64×64 images, 10 classes (about 0.1 M weights)."""

    input_shape = (3, 64, 64)

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for i, out in enumerate((width, width * 2, width * 4, width * 4)):
            layers += [nn.Conv2d(channels, out, 3, stride=1 if i == 0 else 2, padding=1),
                       nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of a batch."""
        return self.head(self.features(x))


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN(16)


def wide_cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN(32)
