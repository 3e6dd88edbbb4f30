"""The training recipe the worker's config asks for: autocast, a GradScaler, clipping, and the learning-rate schedule.

    # bf16 autocast, clipping at 1.0, 20 steps of warm-up then cosine decay to 10 % of lr, lr scaled with the batch
    torchrun --standalone --nproc-per-node=2 -m app.train --autocast bf16 --grad-clip-norm 1.0 \\
        --lr-schedule cosine --warmup-steps 20 --min-lr-ratio 0.1 --lr-reference-batch 64

``build_step_recipe`` turns the config into ``app.parallel.accum.StepRecipe`` (what ``accumulation_step`` runs);
``LRSchedule`` is a ``LambdaLR`` whose factor is a pure function of the optimizer step index, so a run resumed at
step k, on any world size, continues with exactly the lr the uninterrupted run had (docs/training.md "The recipe").
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from app.parallel.accum import StepRecipe
from app.worker.config import TrainConfig

AUTOCAST_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_step_recipe(cfg: TrainConfig, device: torch.device) -> StepRecipe:
    """Autocast and clipping as configured; a GradScaler for fp16 only (bf16 has fp32's range: nothing to scale)."""
    scaler = torch.amp.GradScaler(device.type) if cfg.autocast == "fp16" else None
    return StepRecipe(AUTOCAST_DTYPES[cfg.autocast], scaler, cfg.grad_clip_norm)


def peak_lr(cfg: TrainConfig, global_batch: int) -> float:
    """``lr``, or ``lr × global_batch / lr_reference_batch`` (the linear scaling rule) when that is set."""
    return cfg.lr * global_batch / cfg.lr_reference_batch if cfg.lr_reference_batch else cfg.lr


def lr_factor(step: int, *, schedule: str, steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """The fraction of the peak lr that optimizer step ``step + 1`` uses (``step`` steps done before it).

    Warm-up: steps 1..warmup_steps use 1/warmup_steps, 2/warmup_steps, ... 1 of the peak. Then ``cosine`` or
    ``linear`` decay from 1 to ``min_lr_ratio`` at step ``steps``; ``constant`` stays at 1.

        >>> [round(lr_factor(s, schedule="linear", steps=5, warmup_steps=2, min_lr_ratio=0.0), 3) for s in range(5)]
        [0.5, 1.0, 1.0, 0.5, 0.0]
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    # 0 at the first step after warm-up, 1 at the last (clamped: a resumed run may train past the old horizon)
    progress = min((step - warmup_steps) / max(steps - warmup_steps - 1, 1), 1.0)
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_lr_ratio + (1 - min_lr_ratio) * decay


class LRSchedule:
    """``LambdaLR`` over ``optimizer`` with ``lr_factor``; a ``Stateful`` for the Checkpointer.

    Stepped once per optimizer step, also when the GradScaler skipped it (PyTorch's AMP recipe does the same): the
    lr stays a function of the step index alone, the same on every rank and in every world that resumes the run.

    Its state is the step index (``last_epoch``, as ``LambdaLR`` names it). The base lr is *not* restored: the
    configured one (``peak_lr``) wins on resume, so changing ``lr`` between runs rescales the rest of the schedule.

    Example::

        schedule = LRSchedule(optimizer, cfg, global_batch=128)
        ... accumulation_step(...); schedule.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: TrainConfig, global_batch: int):
        self.optimizer, self.base_lr = optimizer, peak_lr(cfg, global_batch)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] = self.base_lr  # LambdaLR multiplies initial_lr by the factor

        kw = {"schedule": cfg.lr_schedule, "warmup_steps": cfg.warmup_steps, "min_lr_ratio": cfg.min_lr_ratio}
        self.factor = lambda step: lr_factor(step, steps=cfg.steps, **kw)
        self.scheduler = LambdaLR(optimizer, self.factor)  # sets lr = base × factor(0): the first step's lr

    @property
    def lr(self) -> float:
        """The lr the next optimizer step uses."""
        return self.optimizer.param_groups[0]["lr"]

    def step(self) -> None:
        self.scheduler.step()

    def state_dict(self) -> dict:
        return {"last_epoch": self.scheduler.last_epoch, "base_lr": self.base_lr}

    def load_state_dict(self, state: dict) -> None:
        self.resume_at(int(state["last_epoch"]))

    def resume_at(self, step: int) -> None:
        """Put the schedule at optimizer step ``step`` (steps done), with the configured base lr."""
        self.scheduler.base_lrs = [self.base_lr] * len(self.optimizer.param_groups)
        self.scheduler.last_epoch = step
        for group in self.optimizer.param_groups:
            group["lr"], group["initial_lr"] = self.base_lr * self.factor(step), self.base_lr
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]  # what get_last_lr() reads
