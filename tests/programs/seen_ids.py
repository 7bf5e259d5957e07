"""A token classifier that keeps every batch of ids its forward was handed (SEEN: its class's
name, FSDP's own under fully_shard, and the ids), for tests/test_fsdp.py: whether a
strategy's precision reached the token ids on their way in."""

import torch
from torch import nn

SEEN: list[tuple[str, torch.Tensor]] = []


class SeenIds(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (N, T) int64 -> (N, vocab)
        if ids.device.type != "meta":  # the shape probe's
            SEEN.append((type(self).__name__, ids.detach().cpu().clone()))
        return self.head(self.emb(ids).mean(dim=1))


def model(vocab: int = 300, width: int = 8) -> SeenIds:
    return SeenIds(vocab, width)
