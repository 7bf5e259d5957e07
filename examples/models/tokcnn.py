"""A 1-D conv net over token ids, written as a user would: `scalelab run --model
examples/models/tokcnn.py:tokcnn --input-shape 64 --input-dtype int64 --vocab 100 --check`.

Its forward is a straight chain of modules (the transpose is a module too), so `pipeline` can
cut it between any two of them."""

import torch
from torch import nn


class ChannelsFirst(nn.Module):
    """(N, L, D) -> (N, D, L): embeddings as Conv1d channels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class TokCNN(nn.Module):
    def __init__(self, vocab: int, dim: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)  # (N, L) -> (N, L, D)
        self.channels_first = ChannelsFirst()  # (N, D, L)
        self.convs = nn.Sequential(
            nn.Conv1d(dim, dim, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),  # (N, D, L/2)
            nn.Conv1d(dim, dim, 3, padding=1), nn.ReLU(),
        )
        self.pool = nn.AdaptiveMaxPool1d(1)  # max over positions: (N, D, 1)
        self.fc = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.convs(self.channels_first(self.embed(ids)))
        return self.fc(self.pool(h).flatten(1))  # (N, classes)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Label-smoothed cross-entropy: scalelab trains with a model's own loss."""
        return nn.functional.cross_entropy(output, target, label_smoothing=0.1)


def tokcnn(vocab: int = 100, dim: int = 32, classes: int = 4) -> nn.Module:
    return TokCNN(vocab, dim, classes)
