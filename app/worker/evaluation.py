"""The validation loss: the model's mean loss over the held-out split, every ``eval_every`` steps.

    # 10% of the data set held out of training, its loss every 50 steps (a log line and ddp_validation_loss)
    python -m app.train --eval-fraction 0.1 --eval-every 50

Every rank takes a contiguous share of the held-out samples (as ``split_global_batch`` shares a global batch),
runs the bare model on it in eval mode under ``no_grad``, in micro-batches of at most ``micro_batch``, and sums
``loss × samples``; one all-reduce of ``(sum, samples)`` gives the mean over every held-out sample, the same
number at any world size (up to the order of the sum). The loss is taken as a mean over a micro-batch's samples,
as training takes it. The bare model, not the wrapper: a forward of our DDP wrapper would prepare a backward that
never comes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from app.parallel.accum import micro_batch_sizes, split_global_batch
from app.worker.config import TrainConfig
from app.worker.data import stack_samples
from app.worker.dist import DistContext
from app.worker.workload import build_splits


class Validator:
    """This rank's share of the held-out set and the loss to evaluate it with.

    Example::

        validator = Validator(held_out, loss_fn, ctx, micro_batch=32, dtype=torch.float32)
        loss = validator.evaluate(model)   # collective: every rank calls it at the same step
    """

    def __init__(self, held_out: Any, loss_fn: Callable, ctx: DistContext, micro_batch: int, dtype: torch.dtype):
        self.held_out, self.loss_fn, self.ctx, self.dtype = held_out, loss_fn, ctx, dtype
        self.size = len(held_out)
        self.start, count = split_global_batch(self.size, ctx.world_size, ctx.rank)
        self.sizes = micro_batch_sizes(count, micro_batch) if count else []  # fewer samples than ranks: none here

    def evaluate(self, model: nn.Module) -> float:
        """The mean loss over every held-out sample, on every rank (collective)."""
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64)  # loss × samples, samples
        at = self.start
        with torch.no_grad():
            for n in self.sizes:
                x, y = stack_samples([self.held_out[i] for i in range(at, at + n)], self.ctx.device, self.dtype)
                totals[0] += float(self.loss_fn(model(x), y)) * n
                totals[1] += n
                at += n
        model.train(was_training)
        totals = totals.to(self.ctx.device)
        dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()


def build_validator(cfg: TrainConfig, ctx: DistContext, loss_fn: Callable) -> Validator | None:
    """The validator of ``eval_every`` over ``eval_fraction``'s held-out split; None when validation is off."""
    held_out = build_splits(cfg)[1]
    if not cfg.eval_every or held_out is None:
        return None
    return Validator(held_out, loss_fn, ctx, cfg.micro_batch, getattr(torch, cfg.dtype))
