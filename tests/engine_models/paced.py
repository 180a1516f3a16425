"""A tiny network whose every batch takes at least `DELAY_S` (a sleep in its forward).

The pace makes the worker's relay tests independent of how fast this machine's cores are:
a batch lasts long enough for the worker thread to send the next one while it runs, even on a
loaded machine, and short enough to run a few dozen in a test.
"""

import time

import torch
from torch import nn

#: Seconds every forward call sleeps, whatever the batch size.
DELAY_S = 0.02


class Paced(nn.Module):
    input_shape = (3, 16, 16)

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(DELAY_S)
        return self.body(x)


def build() -> nn.Module:
    torch.manual_seed(0)
    return Paced()
