"""The loss: cross-entropy with label smoothing, a function (the spec ``user_model.loss:smoothed_cross_entropy``).

A mean over the samples, so the ranks' averaged gradient equals one process's gradient over the whole batch.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def smoothed_cross_entropy(output: torch.Tensor, target: torch.Tensor, smoothing: float = 0.05) -> torch.Tensor:
    return F.cross_entropy(output, target, label_smoothing=smoothing)
