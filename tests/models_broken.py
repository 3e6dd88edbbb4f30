"""Models broken in the five ways ``python -m app.check`` diagnoses, importable by spec (``tests.models_broken:...``).

Each is MiniMLP-sized (32 in, 8 out) so the synthetic input is inferred from its first Linear. One stand-in:
``NonDeterministic`` adds noise from a generator seeded by the clock, bigger than rounding, where a real
non-deterministic kernel (atomics on a GPU) varies only in the last bits; what the check observes is the same:
two identical single-process runs differ.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class UnusedParameter(nn.Module):
    """A head that forward never calls: DDP waits for its gradient forever (or errors, as both wrappers do)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(32, 8)
        self.unused_head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class WithSpare(nn.Module):
    """A layer and a spare one its forward never calls."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.used = nn.Linear(32, width)
        self.spare = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.used(x))


class UnusedInSequence(nn.Module):
    """``UnusedParameter`` as a pipeline can cut it: its forward is its children in order, and the first child holds
    a parameter without a gradient (``net.0.spare``). DDP stops on it; a pipeline reduces no gradient over ranks."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(WithSpare(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class WithBatchNorm(nn.Module):
    """BatchNorm in train mode: each rank normalises with its own micro-batch's statistics."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class WithDropout(nn.Module):
    """Dropout in train mode: each rank draws its own masks."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Dropout(p), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class NonDeterministic(nn.Module):
    """Noise torch's seed does not control: two identical runs differ (the stand-in for a non-deterministic op)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
        self.clock = torch.Generator().manual_seed(time.perf_counter_ns())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[0](x)
        return self.net[2](self.net[1](h + 1e-2 * torch.randn(h.shape, generator=self.clock)))


class CreatesInForward(nn.Module):
    """A layer built at the first forward, after DDP has registered the parameters it syncs."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "late"):
            self.late = nn.Linear(16, 8)
        return self.late(torch.relu(self.body(x)))


class IdleSparseTable(nn.Module):
    """A sparse embedding forward never looks up: ours trains it (its gradient stays None), PyTorch's DDP stops with
    "Expected sparse gradient to be defined". Equal with one wrapper and not with the other: the verdict must FAIL."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(32, 8)
        self.idle = nn.Embedding(10, 4, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def not_a_model():
    """A spec that builds something else: the check must refuse it with exit code 2."""
    return [nn.Linear(4, 4)]


def regression_data(size: int = 256, seed: int = 0):
    """(inputs, targets) tensors for a 32 -> 8 model, the shape ``--data`` accepts."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 32, generator=g)
    return x, x[:, :8] * 2 + 0.1 * torch.randn(size, 8, generator=g)


class ClassificationDataset(torch.utils.data.Dataset):
    """A map-style data set of (input, class id) pairs: the other shape ``--data`` accepts."""

    def __init__(self, size: int = 128):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(size, 32, generator=g)
        self.y = self.x[:, :8].argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]
