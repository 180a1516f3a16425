"""Images as a model takes them: resized, channel-adapted and normalised (data and digits)."""

from __future__ import annotations

import numpy as np

from infermux.errors import UsageError

__all__ = ["adapt_images", "mean_std"]

_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def mean_std(channels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std, (C, 1, 1): ImageNet's for 3 channels, 0.5 for other counts."""
    mean = _IMAGENET_MEAN if channels == 3 else (0.5,) * channels
    std = _IMAGENET_STD if channels == 3 else (0.5,) * channels
    return (np.asarray(mean, dtype=np.float32).reshape(channels, 1, 1),
            np.asarray(std, dtype=np.float32).reshape(channels, 1, 1))


def adapt_images(images: np.ndarray, input_shape: tuple[int, ...]) -> np.ndarray:
    """Images (N, C, h, w) in [0, 1] → (N, *input_shape) normalised float32.

    Resized bilinearly to the model's height and width; one channel is repeated to three (and
    three averaged to one) when the model asks for another count.
    """
    import torch
    from torch.nn import functional

    if len(input_shape) != 3:
        raise UsageError(f"image data needs a model taking (C, H, W) items, not {input_shape}; "
                         "pass a tensor file (--data x.npz) shaped as the model's input")
    channels, height, width = input_shape
    x = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32))
    if x.shape[1] != channels:
        x = x.mean(dim=1, keepdim=True)
        x = x.expand(-1, channels, -1, -1)
    if tuple(x.shape[2:]) != (height, width):
        x = functional.interpolate(x, size=(height, width), mode="bilinear", align_corners=False)
    mean, std = mean_std(channels)
    return ((x.numpy() - mean) / std).astype(np.float32)
