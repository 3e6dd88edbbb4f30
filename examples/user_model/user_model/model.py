"""The model: a small classifier, built by ``build_model(**kwargs)`` (the spec ``user_model.model:build_model``)."""

from __future__ import annotations

from torch import nn


class Classifier(nn.Module):
    """Two hidden layers with a LayerNorm between them: a shape the project's built-in models do not have."""

    def __init__(self, in_features: int, hidden: int, classes: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.body(x))


def build_model(in_features: int = 12, hidden: int = 48, classes: int = 3) -> nn.Module:
    """The model, with the keywords a spec's ``*_KWARGS`` JSON object passes (e.g. ``{"hidden": 64}``)."""
    return Classifier(in_features, hidden, classes)
