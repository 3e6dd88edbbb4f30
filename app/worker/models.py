"""The models the project trains, tests and benchmarks: small enough for 2 CPU cores, shaped like real ones.

- ``MiniMLP``: the lesson's 3-layer MLP (6 parameter tensors), used by the demo and most tests.
- ``DeepMLP``: 24 linear layers of 512×512 (48 parameter tensors, ~25 MB of fp32 gradients), the bucketing
  benchmark's model: enough tensors for per-tensor latency to matter, enough bytes for bucket size to matter.
- ``TinyTransformer``: a small pre-norm decoder-only transformer (≥ 48 parameter tensors) for next-token
  prediction, the other realistic shape: many small tensors (norms, biases) next to a few big ones.

``parameter_checksum(model)`` is the one parameter hash the trainer, the demo and the tests compare ranks with.
"""

from __future__ import annotations

import torch
from torch import nn

from app.parallel.checksum import tensors_checksum


class MiniMLP(nn.Module):
    def __init__(self, in_features: int = 32, hidden: int = 64, out_features: int = 8):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, out_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DeepMLP(nn.Module):
    def __init__(self, width: int = 512, depth: int = 24):
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])  # no activation after the last layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Decoder-only transformer; ``forward(tokens[B, T]) -> logits[B, T, vocab]``. Output head tied to the
    embedding (as in GPT-2), which also exercises DDP with a shared parameter."""

    def __init__(self, vocab: int = 64, dim: int = 64, heads: int = 4, layers: int = 6, max_len: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        # GPT-2's init: N(0, 0.02) embeddings. PyTorch's N(0, 1) default would, through the tied head, start the
        # model with logits of size ~sqrt(dim) and a loss near 35 instead of ln(vocab) ≈ 4.
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        mask = torch.triu(torch.full((t, t), float("-inf"), device=tokens.device), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


MODELS = {"mini_mlp": MiniMLP, "deep_mlp": DeepMLP, "tiny_transformer": TinyTransformer}


def count_parameter_tensors(model: nn.Module) -> int:
    return sum(1 for _ in model.parameters())


def parameter_checksum(model: nn.Module) -> str:
    """sha256 (hex) over every parameter's bytes, in ``model.parameters()`` order (app/parallel/checksum.py): equal
    on two ranks means bit-identical models. The trainer's FINISHED line shows the first 16 hex, the demo's 12."""
    return tensors_checksum(model.parameters())
