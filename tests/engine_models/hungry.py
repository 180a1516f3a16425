"""A tiny network that asks the host allocator for 16 TiB when it runs a batch of 4 or more.

The runtime's out-of-memory path on a machine without a GPU: the allocation is real and fails
(the error comes from PyTorch's CPU allocator), smaller batches run normally.
"""

import torch
from torch import nn


class Hungry(nn.Module):
    input_shape = (3, 8, 8)

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= 4:
            scratch = torch.empty(2**44, dtype=torch.uint8)
            x = x + scratch[:1].float()
        return self.head(torch.flatten(x, 1))


def build() -> nn.Module:
    torch.manual_seed(0)
    return Hungry()
