"""``parallel=ddp``: the whole model on every rank, ``accumulation_step`` through ``wrap_model`` (ours, torch or none).

The members every step kind has are in ``base.py``; this kind is the one the others build on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn

from app.parallel import wrap_model
from app.parallel.accum import StepResult, accumulation_step
from app.parallel.probes import comm_probe
from app.worker.data import BatchShare
from app.worker.data_stream import build_batches
from app.worker.metrics import synchronize_for
from app.worker.models import parameter_checksum
from app.worker.recipe import LRSchedule, build_step_recipe
from app.worker.steps.base import MicroBatches, StepInputs, StepOutcome, nan_loss
from app.worker.workload import build_splits, compiles_wrapper_whole

log = logging.getLogger("app.train")


class DDPStep:
    """``parallel=ddp``: every rank holds the whole model; ``accumulation_step`` over its micro-batches, gradients
    averaged by the wrapper (``cfg.wrapper``: ours, torch, or none for one process).

    Example::

        step = DDPStep(StepInputs(cfg, ctx, model, build_loss(cfg), grad_accum_steps=2))
        outcome = step.train_step(step.batches.next_micro_batches(), agree_nonfinite=lambda bad: bad)
    """

    def __init__(self, inputs: StepInputs):  # inputs.metrics unused: every series of this kind is the Trainer's
        cfg, ctx = inputs.cfg, inputs.ctx
        self.cfg, self.ctx, self.loss_fn = cfg, ctx, inputs.loss_fn
        self.global_batch = cfg.global_batch(ctx.world_size, inputs.grad_accum_steps)
        dtype = getattr(torch, cfg.dtype)
        self.model = inputs.model.to(ctx.device, dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        dataset = build_splits(cfg)[0]  # the set app.train tried before the process group formed
        share = BatchShare(
            self.global_batch, cfg.micro_batch, ctx.rank, ctx.world_size, ctx.device, dtype,
            equal_counts=self.sync_every_micro_batch,  # a collective per micro-batch: every rank runs as many
        )  # fmt: skip
        self.batches = build_batches(dataset, cfg.seed, share)
        # The bare model and its optimizer are Stateful as they are: checkpoints never hold the wrapper.
        self.model_state, self.optimizer_state = self.model, self.optimizer
        # The schedule's lr scales with this world's global batch (lr_reference_batch), fixed by effective_batch.
        self.lr_schedule: LRSchedule | None = LRSchedule(self.optimizer, cfg, self.global_batch)
        self.recipe = build_step_recipe(cfg, ctx.device)
        self.grad_scaler = self.recipe.scaler  # a Stateful too (its scale and growth tracker), None but for fp16
        self.wrapped = self.wrap(self.model)
        self.probe = comm_probe(self.wrapped)
        if compiles_wrapper_whole(cfg):
            # PyTorch's DDP compiled as its docs say: dynamo's DDPOptimizer cuts the graph at the buckets. The probe
            # and the checkpoints keep the wrapper and the bare model; only the forward goes through dynamo.
            self.wrapped = torch.compile(self.wrapped, backend=cfg.compile)
            log.info("compile (%s): PyTorch's DDP whole, its graph cut at the buckets (DDPOptimizer)", cfg.compile)
        self.synchronize = synchronize_for(ctx.device)

    # A kind whose wrapper has a no_sync() it must not use sets this (zero3: memory before collectives).
    sync_every_micro_batch = False

    def wrap(self, model: nn.Module) -> nn.Module:
        """The data-parallel wrapper the step runs through (broadcasts rank 0's parameters once)."""
        return wrap_model(model, self.cfg.wrapper, bucket_cap_mb=self.cfg.bucket_cap_mb)

    def train_step(
        self, micro_batches: MicroBatches, agree_nonfinite: Callable[[bool], bool], inject_nan: bool = False
    ) -> StepOutcome:
        """One optimizer step; raises ``NonFiniteLossError`` on every rank when any rank's loss is NaN/inf."""
        result: StepResult = accumulation_step(
            self.wrapped,
            self.optimizer,
            micro_batches,
            nan_loss(self.loss_fn) if inject_nan else self.loss_fn,
            synchronize=self.synchronize,
            grad_scale=self.batches.grad_scale,
            agree_nonfinite=agree_nonfinite,
            recipe=self.recipe,
            sync_every_micro_batch=self.sync_every_micro_batch,
        )
        lr = self.optimizer.param_groups[0]["lr"]  # what this step used, before the schedule moves on
        if self.lr_schedule is not None:
            self.lr_schedule.step()  # also after a skipped (overflowed) step: the lr is a function of the step index
        comm = self.probe.take()
        # What accumulation_step measured, and what the wrapper's communication and the optimizer add to it.
        return StepOutcome(
            **dataclasses.asdict(result), comm=comm, comm_seconds=comm.seconds, exposed_seconds=comm.wait_seconds, lr=lr
        )

    def describe_batch(self) -> str:
        b, world, g = self.batches, self.ctx.world_size, self.global_batch
        if len(b.sizes) * b.micro_batch * world == g and len(set(b.sizes)) == 1:
            return f"micro_batch {self.cfg.micro_batch} × grad_accum_steps {len(b.sizes)} × world_size {world}"
        return (
            f"global batch split over world_size {world} ({g // world}-{-(-g // world)} per rank), "
            f"grad_accum_steps {len(b.sizes)} of micro_batch <= {self.cfg.micro_batch}"
        )

    def before_save(self) -> None:
        pass  # every rank holds the whole model and its optimizer: nothing to gather

    def final_checksum(self) -> str:
        return parameter_checksum(self.model)
