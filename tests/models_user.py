"""A user's own model, data and loss, importable by spec (``tests.models_user:SmallNet``): what the worker's
``model``/``data``/``loss`` settings are tested with. Deterministic (no dropout, no BatchNorm), so N ranks and one
process must end with equal parameters."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from app.worker.data_pack import LineFiles, PackedTokens
from tests.models_broken import ClassificationDataset  # noqa: F401 (re-exported: the data spec of the tests)


class SmallNet(nn.Module):
    """32 features in, 8 class logits out."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, hidden), nn.Tanh(), nn.Linear(hidden, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def scaled_cross_entropy(output: torch.Tensor, target: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """A loss function with a keyword of its own (``loss_kwargs: {scale: 2.0}``)."""
    return scale * nn.functional.cross_entropy(output, target)


def per_sample_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Not reduced: the worker must refuse it (a loss must be a scalar)."""
    return nn.functional.cross_entropy(output, target, reduction="none")


class StackNet(nn.Module):
    """A user model whose forward is its children in order, without a ``.net``: an input layer, a ``ModuleList`` of
    blocks (each an ``nn.Sequential``), a head; what ``parallel=pipeline`` cuts by ``pipeline_split`` (``blocks.1``)."""

    def __init__(self, hidden: int = 16, depth: int = 3):
        super().__init__()
        self.embed = nn.Linear(32, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Tanh(), nn.Linear(hidden, hidden)) for _ in range(depth))
        self.head = nn.Sequential(nn.Tanh(), nn.Linear(hidden, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ResidualNet(nn.Module):
    """Not a sequence of its children (the input skips the first layer): a pipeline must refuse to cut it."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.inner = nn.Linear(32, hidden)
        self.head = nn.Linear(hidden, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(x)) + x)


def flat_mlp(hidden: int = 16) -> nn.Sequential:
    """An ``nn.Sequential`` built by a function (its sequence is ``0``, ``1``, ...); its first module has no
    parameters, so a pipeline cut at ``1`` would leave stage 0 without any."""
    return nn.Sequential(nn.Flatten(), nn.Linear(32, hidden), nn.Tanh(), nn.Linear(hidden, 8))


def one_shot_stream(size: int = 64):
    """A generator of (input, target) pairs: iterable once, with no state to resume from (the worker refuses it)."""
    gen = torch.Generator().manual_seed(0)
    return ((torch.randn(32, generator=gen), torch.tensor(i % 8)) for i in range(size))


class RecordedPacking(PackedTokens):
    """``packed_files`` that tells which windows a run read: rank 0 appends to ``record`` a line ``iter N`` at each
    ``iter()`` (N: the window it starts at) and a line per window it yields (its index in the pass and its inputs),
    flushed at once, so a killed run's record is whole up to the kill."""

    def __init__(self, paths: list[str], seq_len: int, sep: int, record: str):
        super().__init__(LineFiles([Path(p) for p in paths]), seq_len, sep)
        self.record = record

    def __iter__(self):
        windows = super().__iter__()
        return windows if os.environ.get("RANK", "0") != "0" else self._recorded(windows)

    def _recorded(self, windows):
        with open(self.record, "a") as f:
            f.write(f"iter {self.position}\n")
            for x, y in windows:
                f.write(f"{self.position - 1} {x.tolist()}\n")
                f.flush()
                yield x, y
