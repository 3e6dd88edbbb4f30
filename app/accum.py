"""Gradient accumulation done right: K micro-batches, one gradient sync, one optimizer step.

The recipe (what ``accumulation_step`` does, and the traps it avoids):

    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):            # K = len(micro_batches)
        with model.no_sync() if i < K - 1 else nullcontext():   # forward *inside*: it decides whether to sync
            loss = loss_fn(model(x), y) / K                # divide, or the step comes out K times too big
            loss.backward()                                 # grads add up in p.grad; synced only on the last
    optimizer.step()                                        # once per effective batch: Adam's state too

    effective_batch = micro_batch × grad_accum_steps × world_size

Used by the trainer (``app.train``) and shown across real ranks by ``make accum``.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf; raised *before* the optimizer step so the parameters stay good."""


def effective_batch_size(micro_batch: int, grad_accum_steps: int, world_size: int) -> int:
    """Samples that contribute to one optimizer step, over all ranks."""
    return micro_batch * grad_accum_steps * world_size


def resolve_grad_accum_steps(micro_batch: int, world_size: int, grad_accum_steps: int | None = None,
                             effective_batch: int | None = None) -> int:
    """Per-rank accumulation steps from either ``grad_accum_steps`` or ``effective_batch`` (not both).

    Raises ValueError with a one-line message naming the field and the fix when they do not fit together.
    """
    if grad_accum_steps is not None and effective_batch is not None:
        if effective_batch_size(micro_batch, grad_accum_steps, world_size) != effective_batch:
            raise ValueError(
                f"effective_batch={effective_batch} disagrees with micro_batch={micro_batch} × "
                f"grad_accum_steps={grad_accum_steps} × world_size={world_size}; set only one of the two")
        return grad_accum_steps
    if effective_batch is not None:
        per_step = micro_batch * world_size
        if effective_batch <= 0 or effective_batch % per_step:
            raise ValueError(
                f"effective_batch={effective_batch} is not a positive multiple of micro_batch × world_size = "
                f"{micro_batch} × {world_size} = {per_step}; choose a multiple of {per_step} or change micro_batch")
        return effective_batch // per_step
    steps = 1 if grad_accum_steps is None else grad_accum_steps
    if steps < 1:
        raise ValueError(f"grad_accum_steps={steps} must be >= 1")
    return steps


@dataclass
class StepResult:
    loss: float  # mean loss over the micro-batches of this rank (the unscaled value a user expects to see)
    samples: int  # samples this rank processed
    syncs: int  # backward passes that synchronised gradients (1 with sync on last, K when syncing every one)
    forward_seconds: float
    backward_seconds: float
    optimizer_seconds: float


def accumulation_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                      micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                      sync_every_micro_batch: bool = False, scale_loss: bool = True,
                      check_finite: bool = True, synchronize: Callable[[], None] = lambda: None) -> StepResult:
    """One optimizer step over ``K = len(micro_batches)`` micro-batches.

    ``model`` is our DDP, PyTorch's DDP or a bare module (no ``no_sync``: nothing to skip).
    ``sync_every_micro_batch`` and ``scale_loss=False`` exist only to demonstrate the two classic mistakes.
    ``synchronize`` is called before each clock read (``torch.cuda.synchronize`` on GPU, so times are real).
    """
    k = len(micro_batches)
    if k == 0:
        raise ValueError("accumulation_step needs at least one micro-batch")
    has_no_sync = hasattr(model, "no_sync")
    optimizer.zero_grad(set_to_none=True)
    total_loss = 0.0
    samples = syncs = 0
    fwd = bwd = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == k - 1
        skip_sync = has_no_sync and not last and not sync_every_micro_batch
        # The forward belongs inside no_sync(): a DDP wrapper decides at forward time whether the coming backward
        # synchronises. Wrapping only backward() silently syncs every micro-batch.
        context = model.no_sync() if skip_sync else contextlib.nullcontext()
        with context:
            synchronize()
            t0 = time.perf_counter()
            loss = loss_fn(model(x), y)
            synchronize()
            t1 = time.perf_counter()
            # Each micro-batch loss is a mean over its samples; dividing by K makes the accumulated gradient the
            # mean over all K×micro samples, exactly the gradient of one big batch.
            (loss / k if scale_loss else loss).backward()
            synchronize()
            t2 = time.perf_counter()
        fwd += t1 - t0
        bwd += t2 - t1
        total_loss += loss.item()
        samples += x.shape[0]
        syncs += 0 if skip_sync or not has_no_sync else 1
    mean_loss = total_loss / k
    if check_finite and not math.isfinite(mean_loss):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(f"loss is {mean_loss}; stopping before the optimizer step so the parameters and "
                                 f"the last checkpoint stay good. Lower the learning rate or check the data")
    t3 = time.perf_counter()
    optimizer.step()  # once per effective batch: momentum and Adam moments advance once, not K times
    synchronize()
    opt = time.perf_counter() - t3
    return StepResult(loss=mean_loss, samples=samples, syncs=syncs, forward_seconds=fwd, backward_seconds=bwd,
                      optimizer_seconds=opt)
