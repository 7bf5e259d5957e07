"""Three networks scalelab does not ship, written as a user would (tests/test_user_model.py
runs them with --model tests/programs/user_nets.py:FACTORY), and two it must refuse to cut."""

import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(h)))


class ResNetBN(nn.Module):
    """(N, 3, 12, 12) -> (N, 5): a conv stem, one residual block, global pooling, a head."""

    def __init__(self, width: int = 6, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.res = Residual(width)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        x = self.pool(self.act(self.bn(self.stem(x))))
        return self.fc(torch.flatten(self.gap(self.res(x)), 1))


def rescnn(width: int = 6, classes: int = 5, stats: bool = True) -> nn.Module:
    net = ResNetBN(width, classes)
    if stats:  # BatchNorm statistics that are not the identity, so eval mode matters
        gen = torch.Generator().manual_seed(7)
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5, generator=gen)
                m.running_var.uniform_(0.5, 2.0, generator=gen)
    return net


class Transpose(nn.Module):
    def forward(self, x):
        return x.transpose(1, 2)  # (N, L, D) -> (N, D, L)


def tokconv(vocab: int = 40, dim: int = 6, classes: int = 3) -> nn.Module:
    """(N, L) int64 token ids -> (N, 3)."""
    return nn.Sequential(
        nn.Embedding(vocab, dim), Transpose(),
        nn.Conv1d(dim, 8, 3, padding=1), nn.ReLU(), nn.MaxPool1d(2),
        nn.Conv1d(8, 8, 3), nn.GELU(),
        nn.AdaptiveMaxPool1d(1), nn.Flatten(), nn.Linear(8, classes),
    )  # fmt: skip


class MLP(nn.Module):
    """(N, 3, 4) float -> (N, 4): flatten, Linear, LayerNorm, GELU, dropout, Linear pair."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.ln = nn.LayerNorm(16)
        self.act = nn.GELU()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(16, 16)
        self.relu = nn.ReLU()
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        x = self.drop(self.act(self.ln(self.fc1(x.flatten(1)))))
        return self.fc3(self.relu(self.fc2(x)))

    def loss(self, output, target):
        return nn.functional.cross_entropy(output, target, label_smoothing=0.05)


def mlp(p: float = 0.3) -> nn.Module:
    return MLP(p)


class Float32Norm(nn.Module):
    """Gemma's RMSNorm as Hugging Face writes it: input and weight in float32, the result
    cast back, whatever the model's dtype."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * (1.0 + self.weight.float())).type_as(x)


def fp32_norm_mlp() -> nn.Module:
    """(N, 3, 4) -> (N, 4) with a float32-inside norm between its Linears."""
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), Float32Norm(16), nn.GELU(),
                         nn.Linear(16, 4))  # fmt: skip


class Branchy(nn.Module):
    """Two heads added: no chain of modules to cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 3), nn.Linear(12, 3)

    def forward(self, x):
        x = x.flatten(1)
        return self.a(x) + self.b(x)


def branchy() -> nn.Module:
    return Branchy()


def raises(**kwargs) -> nn.Module:
    raise ValueError(f"no such width {kwargs}")


def not_a_module() -> int:
    return 3


class PerRank(nn.Module):
    """A deliberately wrong training (tests/test_train_check.py): in training mode the output
    is scaled by 1 + rank (from the launcher's environment), so each rank's gradient differs
    from its share of one process's and the averaged step is not one process's step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x.flatten(1)))
        if self.training:
            h = h * (1 + _rank())
        return self.fc2(h)


def _rank() -> int:
    import os

    for key in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def per_rank() -> nn.Module:
    return PerRank()
