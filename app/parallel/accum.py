"""Gradient accumulation done right: K micro-batches, one gradient sync, one optimizer step.

The recipe (what ``accumulation_step`` does, and the traps it avoids):

    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):            # K = len(micro_batches)
        with model.no_sync() if i < K - 1 else nullcontext():   # forward *inside*: it decides whether to sync
            loss = loss_fn(model(x), y) / K                # divide, or the step comes out K times too big
            loss.backward()                                 # grads add up in p.grad; synced only on the last
    optimizer.step()                                        # once per effective batch: Adam's state too

    effective_batch = micro_batch × grad_accum_steps × world_size      (grad_accum_steps is per rank)

Holding the global batch fixed instead (the same samples per step at any world size, as the trainer does when
``effective_batch`` is set): ``split_global_batch`` gives each rank its share, unevenly when the world size does not
divide it; ``micro_batch_sizes`` cuts a share into micro-batches no larger than the limit; and ``grad_scale`` =
local samples × world_size / global samples makes the wrapper's average over ranks the full batch's gradient::

    mean over ranks of (n_r × W / B) × mean_r  =  Σ_r n_r × mean_r / B  =  the mean over all B samples

The recipe around it (all optional, in this order; docs/training.md "The recipe")::

    with torch.autocast(device_type, dtype):               # bf16 or fp16 forward + loss; backward outside
        loss = loss_fn(model(x), y)
    scaler.scale(loss * weight).backward()                  # fp16 only: GradScaler keeps small grads representable
    scaler.unscale_(optimizer)                              # once per step, so clipping sees the true gradient
    clip_grad_norm_(model.parameters(), grad_clip_norm)     # by the global norm of the averaged gradient
    scaler.step(optimizer); scaler.update()                 # skips the step if any gradient is inf/NaN

Under DDP the gradient a scaler inspects is the all-reduced one, identical on every rank: an overflow on one rank
makes it inf everywhere, so every rank skips the same step and halves its scale alike, with no extra collective.

Used by the trainer (``app.train``); shown across real ranks, with every claim measured, by ``make accum``
(``bench/accum.py``); tested by ``python -m pytest tests/integration/test_accum.py``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf on some rank; raised on *every* rank, before the optimizer step, so the
    parameters stay good everywhere. ``local`` says whether this rank's own loss was the non-finite one."""

    def __init__(self, message: str, local: bool = True):
        super().__init__(message)
        self.local = local


def effective_batch_size(micro_batch: int, grad_accum_steps: int, world_size: int) -> int:
    """Samples that contribute to one optimizer step, over all ranks."""
    return micro_batch * grad_accum_steps * world_size


def resolve_grad_accum_steps(
    micro_batch: int, world_size: int, grad_accum_steps: int | None = None, effective_batch: int | None = None
) -> int:
    """Per-rank accumulation steps from either ``grad_accum_steps`` or ``effective_batch`` (not both).

    Raises ValueError with a one-line message naming the field and the fix when they do not fit together.
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch={micro_batch} must be >= 1")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if grad_accum_steps is not None and grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps={grad_accum_steps} must be >= 1 (1 means no accumulation)")
    if grad_accum_steps is not None and effective_batch is not None:
        if effective_batch_size(micro_batch, grad_accum_steps, world_size) != effective_batch:
            raise ValueError(
                f"effective_batch={effective_batch} disagrees with micro_batch={micro_batch} × "
                f"grad_accum_steps={grad_accum_steps} × world_size={world_size}; set only one of the two"
            )
        return grad_accum_steps
    if effective_batch is not None:
        per_step = micro_batch * world_size
        if effective_batch <= 0 or effective_batch % per_step:
            raise ValueError(
                f"effective_batch={effective_batch} is not a positive multiple of micro_batch × world_size = "
                f"{micro_batch} × {world_size} = {per_step}; choose a multiple of {per_step} or change micro_batch"
            )
        return effective_batch // per_step
    return 1 if grad_accum_steps is None else grad_accum_steps


def split_global_batch(global_batch: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, count)`` of ``rank``'s contiguous share of a global batch; shares differ by at most one sample.

    Example::

        >>> [split_global_batch(10, 3, r) for r in range(3)]
        [(0, 4), (4, 3), (7, 3)]
    """
    base, extra = divmod(global_batch, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def micro_batch_sizes(samples: int, micro_batch: int) -> list[int]:
    """Cut ``samples`` into the fewest micro-batches of at most ``micro_batch``, as equal as possible.

    Example::

        >>> micro_batch_sizes(43, 32), micro_batch_sizes(64, 32)
        ([22, 21], [32, 32])
    """
    k = max(math.ceil(samples / micro_batch), 1)
    base, extra = divmod(samples, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def grad_accum_steps_for(global_batch: int, world_size: int, micro_batch: int) -> int:
    """Micro-batches per step on the rank with the largest share (rank 0) of a fixed global batch.

    Example::

        >>> grad_accum_steps_for(128, 3, 32)   # shares 43/43/42, each in 2 micro-batches
        2
    """
    return len(micro_batch_sizes(split_global_batch(global_batch, world_size, 0)[1], micro_batch))


@dataclass
class StepResult:
    """What one ``accumulation_step`` computed on this rank (``PipelineStepResult`` is the pipeline's counterpart;
    the worker's step kinds turn either into a ``StepOutcome``, app.worker.steps.base)."""

    loss: float  # mean loss over the samples of this rank's micro-batches (the unscaled value a user expects)
    samples: int  # samples this rank processed
    syncs: int  # backward passes that synchronised gradients (1 with sync on last, K when syncing every one)
    forward_seconds: float
    backward_seconds: float
    optimizer_seconds: float
    grad_norm: float | None = None  # global norm of the averaged gradient before clipping (None: not clipped)
    skipped: bool = False  # the GradScaler found inf/NaN gradients and skipped the optimizer step (every rank alike)


@dataclass
class StepRecipe:
    """The optional parts of the recipe: autocast, a GradScaler (fp16), clipping by global norm.

    ``autocast_dtype``: ``torch.bfloat16`` / ``torch.float16`` for the forward and loss, None for none.
    ``scaler``: a ``torch.amp.GradScaler`` (fp16: its range is too small for tiny gradients), None for none.
    ``grad_clip_norm``: clip the global L2 norm of the gradient to this (0 = off).

    Example::

        recipe = StepRecipe(torch.float16, torch.amp.GradScaler("cpu"), grad_clip_norm=1.0)
        accumulation_step(ddp, optimizer, micro_batches, F.cross_entropy, recipe=recipe)
    """

    autocast_dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None
    grad_clip_norm: float = 0.0

    def autocast(self, device_type: str):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast_dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float | None, bool]:
        """unscale → clip → step → update; returns ``(grad_norm before clipping, skipped)``."""
        scaler = self.scaler
        if scaler is not None:
            # Once per optimizer step, after the last micro-batch: the gradients hold scale × the true gradient.
            scaler.unscale_(optimizer)
        norm = None
        if self.grad_clip_norm > 0:
            # The all-reduced gradient is the same on every rank, so every rank computes the same norm and clips
            # alike; a wrapper whose gradients are sharded (ZeRO-2/3) clips by the norm over every rank's shards
            # with its own clip_grad_norm_, as PyTorch's FSDP does. Non-finite (an fp16 overflow) gives a NaN
            # norm; scaler.step skips that step anyway.
            if sharded_clip := getattr(model, "clip_grad_norm_", None):
                norm = float(sharded_clip(self.grad_clip_norm))
            else:
                norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), self.grad_clip_norm))
        if scaler is None:
            optimizer.step()
            return norm, False
        before = scaler.get_scale()
        scaler.step(optimizer)  # skipped when unscale_ found inf/NaN in any gradient of this optimizer
        scaler.update()  # once per optimizer step: halves the scale after a skip, grows it after growth_interval
        return norm, scaler.get_scale() < before  # the scale only ever shrinks after a skipped step


def _process_group(model: nn.Module):
    """The group a DDP wrapper (ours or PyTorch's) syncs over; None for a bare module or a world of one."""
    group = getattr(model, "process_group", None)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    return group


def _any_rank_true(model: nn.Module, local: bool) -> bool:
    """OR of ``local`` over the wrapper's ranks: one 4-byte all-reduce per optimizer step.

    A NaN loss on one rank must stop *every* rank: a rank that raised alone would leave the others blocked in
    their next gradient sync until the collective timeout (and the averaged gradients they hold carry its NaNs).
    """
    group = _process_group(model)
    if group is None:
        return local
    device = next(model.parameters()).device  # NCCL reduces only device tensors
    flag = torch.tensor([1.0 if local else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _stop_if_any_rank_nonfinite(model, optimizer, mean_loss: float, agree: Callable[[bool], bool] | None) -> None:
    """Raise NonFiniteLossError on every rank, gradients dropped, if any rank's loss is NaN/inf (one all-reduce)."""
    local = not math.isfinite(mean_loss)
    agree = agree or (lambda flag: _any_rank_true(model, flag))
    if agree(local):
        optimizer.zero_grad(set_to_none=True)
        where = "this rank" if local else f"another rank (here {mean_loss:.6g})"
        raise NonFiniteLossError(
            f"loss is {mean_loss if local else 'NaN/inf'} on {where}; every rank stops before "
            f"the optimizer step so the parameters and the last checkpoint stay good. Lower the "
            f"learning rate or check the data",
            local=local,
        )


def accumulation_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    sync_every_micro_batch: bool = False,
    scale_loss: bool = True,
    check_finite: bool = True,
    synchronize: Callable[[], None] = lambda: None,
    grad_scale: float = 1.0,
    agree_nonfinite: Callable[[bool], bool] | None = None,
    recipe: StepRecipe | None = None,
) -> StepResult:
    """One optimizer step over ``K = len(micro_batches)`` micro-batches.

    ``model`` is our DDP, PyTorch's DDP or a bare module (no ``no_sync``: nothing to skip). ``loss_fn`` returns
    the *mean* over its micro-batch, as PyTorch's losses do by default.
    ``sync_every_micro_batch`` and ``scale_loss=False`` exist only to demonstrate the two classic mistakes.
    ``check_finite`` stops every rank together (NonFiniteLossError) before the step if any rank's loss is not
    finite. ``synchronize`` is called before each clock read (``torch.cuda.synchronize`` on GPU, so times are
    real). ``grad_scale`` multiplies every micro-batch's loss weight: local samples × world_size / global samples
    when the ranks' shares of a global batch differ. ``agree_nonfinite(local) -> any rank`` replaces the built-in
    one-flag all-reduce, so a caller can carry its own per-step agreement in the same collective.
    ``recipe`` adds autocast, loss scaling and clipping (``StepRecipe``); none of them adds a collective.
    """
    k = len(micro_batches)
    if k == 0:
        raise ValueError("accumulation_step needs at least one micro-batch")
    sizes = [x.shape[0] for x, _ in micro_batches]
    total = sum(sizes)
    has_no_sync = hasattr(model, "no_sync")
    recipe = recipe or StepRecipe()
    device_type = micro_batches[0][0].device.type
    optimizer.zero_grad(set_to_none=True)
    # The loss stays on its device until the end: a .item() per micro-batch would stall a GPU queue K times a step.
    loss_sum: torch.Tensor | float = 0.0
    syncs = 0
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
            with recipe.autocast(device_type):  # forward and loss only: backward runs in the forward's dtypes
                loss = loss_fn(model(x), y)
            synchronize()
            t1 = time.perf_counter()
            # Each micro-batch loss is a mean over its samples; weighting it by its share of the samples (1/K when
            # the micro-batches are equal) makes the accumulated gradient the mean over all of them: exactly the
            # gradient of one big batch. Unequal micro-batches (a short last one) keep their true weight.
            weight = sizes[i] / total * grad_scale if scale_loss else 1.0
            recipe.scale(loss * weight).backward()
            synchronize()
            t2 = time.perf_counter()
        fwd += t1 - t0
        bwd += t2 - t1
        loss_sum = loss_sum + loss.detach().double() * sizes[i]
        syncs += 1 if has_no_sync and not skip_sync else 0
    mean_loss = float(loss_sum) / total
    if check_finite:
        _stop_if_any_rank_nonfinite(model, optimizer, mean_loss, agree_nonfinite)
    t3 = time.perf_counter()
    # Once per effective batch: momentum and Adam moments advance once, not K times.
    grad_norm, skipped = recipe.step(model, optimizer)
    synchronize()
    opt = time.perf_counter() - t3
    return StepResult(
        loss=mean_loss,
        samples=total,
        syncs=syncs,
        forward_seconds=fwd,
        backward_seconds=bwd,
        optimizer_seconds=opt,
        grad_norm=grad_norm,
        skipped=skipped,
    )
