"""A tiny network for fault tests: `poisonable` raises mid-run on a marked input, `slow`
takes a while per batch (so a test can kill its worker's process while a batch runs),
`breakable` is broken for good by a marked input (every later batch raises, as on a device
whose context was lost).

The failure is real: the engine's forward raises in the worker, as a model bug or a bad
input would make it, and every other input runs normally (until `breakable` is broken).
"""

import time

import torch
from torch import nn

#: An input holding a value above this makes `poisonable` raise.
POISON = 1e6


class Net(nn.Module):
    input_shape = (3, 16, 16)

    def __init__(self, delay_s: float = 0.0, poisonable: bool = False,
                 breakable: bool = False) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.poisonable = poisonable
        self.breakable = breakable
        self.broken = False
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.breakable and bool((x > POISON).any()):
            self.broken = True
        if self.broken:
            raise RuntimeError("device lost")
        if self.poisonable and bool((x > POISON).any()):
            raise RuntimeError("poisoned input")
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.body(x)


def build() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def slow() -> nn.Module:
    torch.manual_seed(0)
    return Net(delay_s=0.4)


def poisonable() -> nn.Module:
    torch.manual_seed(0)
    return Net(poisonable=True)


def breakable() -> nn.Module:
    torch.manual_seed(0)
    return Net(breakable=True)
