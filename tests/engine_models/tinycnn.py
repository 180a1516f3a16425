"""A small custom CNN for the engine tests: conv, batch norm, residual add, pooling, linear."""

import torch
from torch import nn


class TinyCNN(nn.Module):
    input_shape = (3, 32, 32)

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                   nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16))
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def build() -> nn.Module:
    torch.manual_seed(0)
    model = TinyCNN()
    # Non-trivial batch-norm statistics, so folding them into convolutions is exercised.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model


def build_unexportable() -> nn.Module:
    """A model whose forward uses an operator the ONNX exporter cannot translate."""

    class Eig(nn.Module):
        input_shape = (3, 8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.linalg.eigvals(x[:, 0]).real

    return Eig()
