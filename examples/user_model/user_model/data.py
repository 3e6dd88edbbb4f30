"""The data: a map-style data set of ``(features, class)`` pairs, the same on every rank for a given seed."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Blobs(Dataset):
    """``size`` points around ``classes`` centres in ``in_features`` dimensions; sample i's class is ``i % classes``.

    Generated once, from ``seed`` alone: every rank holds the same data set, and a DistributedSampler gives each
    rank its own share of it.
    """

    def __init__(self, size: int = 2048, in_features: int = 12, classes: int = 3, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(classes, in_features, generator=g) * 3
        self.targets = torch.arange(size) % classes
        self.inputs = centres[self.targets] + torch.randn(size, in_features, generator=g)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i]
