"""Models of the training figures that torchvision does not name: small CNNs, ViTs for small images.

Given as model references, e.g. `bench/train_models.py:small_cnn` or `bench/train_models.py:vit_64`.
"""

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


def _vit(size: int, patch: int, layers: int, heads: int, dim: int) -> nn.Module:
    """A Vision Transformer (torchvision's, random weights) for `size`×`size` images."""
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(image_size=size, patch_size=patch, num_layers=layers,
                             num_heads=heads, hidden_dim=dim, mlp_dim=4 * dim, num_classes=100)


def vit_32() -> nn.Module:
    """ViT-Tiny-like (6 layers, width 192) on 32×32 images in 4×4 patches: 64 tokens."""
    return _vit(32, 4, 6, 3, 192)


def vit_64() -> nn.Module:
    """ViT-Small-like (8 layers, width 384) on 64×64 images in 8×8 patches: 64 tokens."""
    return _vit(64, 8, 8, 6, 384)


def vit_96() -> nn.Module:
    """ViT-B/16's shape (12 layers, width 768) on 96×96 images in 16×16 patches: 36 tokens."""
    return _vit(96, 16, 12, 12, 768)


def vit_128() -> nn.Module:
    """ViT-B/16's shape (12 layers, width 768) on 128×128 images in 16×16 patches: 64 tokens."""
    return _vit(128, 16, 12, 12, 768)
