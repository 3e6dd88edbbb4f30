"""A residual stack of square Linear layers: a model whose state (parameters, gradients, AdamW's two moments)
dominates a rank's memory, as in issue 37's report (16 → depth × Linear(width, width) with a skip → 8).

    python -m app.train --wrapper none --model bench.models.residual:ResidualStack \\
        --model-kwargs '{"width": 1536, "depth": 16}' --data teacher_classification \\
        --data-kwargs '{"size": 512, "seed": 0}' --loss cross_entropy --steps 3

Its input is ``teacher_classification``'s (32 features, 8 classes). Each ``Residual`` block is an FSDP unit
(``fsdp_units=Residual``, or each item of ``blocks`` by default): one gathered unit is ``width²+width`` parameters.
"""

from __future__ import annotations

import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


class ResidualStack(nn.Module):
    def __init__(self, width: int = 1536, depth: int = 16, in_features: int = 32, out_features: int = 8):
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(Residual(width) for _ in range(depth))
        self.out = nn.Linear(width, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)
