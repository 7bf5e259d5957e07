"""A small residual CNN, written as a user would: `scalelab run --model
examples/models/rescnn.py:rescnn --input-shape 3,32,32 --check`."""

import torch
from torch import nn


class Residual(nn.Module):
    """x + conv-bn-relu-conv-bn(x), then ReLU: shapes kept, (N, C, H, W)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class ResCNN(nn.Module):
    def __init__(self, width: int, blocks: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)  # (N, W, H, W)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)  # (N, W, H/2, W/2)
        self.blocks = nn.Sequential(*(Residual(width) for _ in range(blocks)))
        self.head = nn.AdaptiveAvgPool2d(1)  # (N, W, 1, 1)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.stem(x)))
        x = self.head(self.blocks(x))
        return self.fc(x.flatten(1))  # (N, classes)


def rescnn(width: int = 16, blocks: int = 2, classes: int = 10) -> nn.Module:
    return ResCNN(width, blocks, classes)
