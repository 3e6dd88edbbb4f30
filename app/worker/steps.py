"""Step kinds: what differs between plain DDP, pipeline and DataParallel training, handed to the one ``Trainer``.

The ``Trainer`` (app.worker.trainer) runs the same loop for every kind: load a step's micro-batches, call
``step.train_step(...)``, maybe checkpoint, log. A step kind is the one object that knows how the ranks share the
work; each builds what it needs from ``(cfg, ctx, model, loss_fn)`` and exposes (the ``TrainStep`` protocol):

- ``train_step(micro_batches, agree_nonfinite, inject_nan=False) -> StepOutcome``: one optimizer step;
- ``model_state`` / ``optimizer_state``: the two ``Stateful``s (``state_dict``/``load_state_dict``) the
  ``Checkpointer`` saves and restores: always the *whole, bare* model's state, so every checkpoint loads into
  ``build_model(cfg)`` (app.worker.workload) without a wrapper; ``lr_schedule`` / ``grad_scaler``: two more, or
  None where the kind has none (only ``parallel=ddp`` runs the recipe of app.worker.recipe: autocast, GradScaler,
  clipping, schedule);
- ``batches`` (this rank's share of each global batch), ``global_batch``, ``describe_batch()`` for the start line;
- ``before_save()`` (collective: whatever must be gathered first) and ``final_checksum()`` (collective: the
  FINISHED checksum of the whole model, the same on every rank, app.parallel.checksum).

The kinds (``STEP_KINDS`` in app.worker.step_kinds, chosen by ``cfg.parallel`` in ``build_step``):

- ``DDPStep`` (``parallel=ddp``): ``accumulation_step`` (app.parallel.accum) through ``wrap_model`` (ours, torch
  or none);
- ``DataParallelStep`` (``parallel=dp``): the same step through ``nn.DataParallel``; no DDP wrapper is built;
- ``PipelineStep`` (``parallel=pipeline``, app.worker.pipeline_step): one stage per rank, replicas all-reduced;
- ``Zero1Step``/``Zero2Step``/``Zero3Step`` (``parallel=zero1|zero2|zero3``, app.worker.sharded_step): ``DDPStep``
  with optimizer state / + gradients / + parameters sharded over the ranks, checkpointed as shards.

A new kind plugs in by adding a class with these members to ``STEP_KINDS`` (app.worker.step_kinds; its name to
the config's ``parallel`` choices): the ``Trainer`` does not change. Try one:
``python -m app.train --wrapper none --steps 20``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from app.parallel import wrap_model
from app.parallel.accum import StepResult, accumulation_step
from app.parallel.probes import CommSample, comm_probe
from app.worker.config import TrainConfig
from app.worker.data import GlobalBatches
from app.worker.dist import DistContext
from app.worker.metrics import synchronize_for
from app.worker.models import parameter_checksum
from app.worker.recipe import LRSchedule, build_step_recipe
from app.worker.workload import build_dataset

MicroBatches = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StepOutcome:
    """What one step kind's ``train_step`` measured on this rank (the Trainer adds the step index and wall time)."""

    loss: float  # this rank's mean loss over the step's samples
    samples: int  # samples this rank processed
    syncs: int  # gradient synchronisations (all-reduces of the whole gradient) in the step
    forward_seconds: float
    backward_seconds: float
    optimizer_seconds: float
    comm: CommSample  # the wrapper's buckets, for ddp_allreduce_* (empty when not measurable)
    comm_seconds: float  # what the progress line shows as "comm"
    exposed_seconds: float | None  # communication backward waited for; None when not measurable
    lr: float  # the learning rate the optimizer stepped with
    grad_norm: float | None = None  # the gradient's global norm before clipping (None: not clipped)
    skipped: bool = False  # the GradScaler skipped this step (an inf/NaN gradient on some rank: all skip)


class Stateful(Protocol):
    """What ``torch.distributed.checkpoint.stateful.Stateful`` names: an object the Checkpointer saves."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


class TrainStep(Protocol):
    """The members the Trainer uses; every kind in ``STEP_KINDS`` has them (see the module docstring)."""

    global_batch: int
    batches: GlobalBatches
    model_state: Stateful
    optimizer_state: Stateful
    lr_schedule: Stateful | None
    grad_scaler: Stateful | None

    def train_step(
        self, micro_batches: MicroBatches, agree_nonfinite: Callable[[bool], bool], inject_nan: bool = False
    ) -> StepOutcome: ...

    def describe_batch(self) -> str: ...

    def before_save(self) -> None: ...

    def final_checksum(self) -> str: ...


def nan_loss(loss_fn: Callable) -> Callable:
    """``loss_fn`` made NaN: the failure drill of ``inject_nan_at_step``."""
    return lambda out, y: loss_fn(out, y) * float("nan")


class DDPStep:
    """``parallel=ddp``: every rank holds the whole model; ``accumulation_step`` over its micro-batches, gradients
    averaged by the wrapper (``cfg.wrapper``: ours, torch, or none for one process).

    Example::

        step = DDPStep(cfg, ctx, model, build_loss(cfg), grad_accum_steps=2)
        outcome = step.train_step(step.batches.next_micro_batches(), agree_nonfinite=lambda bad: bad)
    """

    def __init__(
        self,
        cfg: TrainConfig,
        ctx: DistContext,
        model: nn.Module,
        loss_fn: Callable,
        *,
        grad_accum_steps: int,
        metrics=None,  # unused: every series of this kind is the Trainer's
    ):
        self.cfg, self.ctx, self.loss_fn = cfg, ctx, loss_fn
        self.global_batch = cfg.global_batch(ctx.world_size, grad_accum_steps)
        dtype = getattr(torch, cfg.dtype)
        self.model = model.to(ctx.device, dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        dataset = build_dataset(cfg)  # the set app.train tried before the process group formed
        self.batches = GlobalBatches(
            dataset, self.global_batch, cfg.micro_batch, ctx.rank, ctx.world_size, cfg.seed, ctx.device, dtype
        )
        # The bare model and its optimizer are Stateful as they are: checkpoints never hold the wrapper.
        self.model_state, self.optimizer_state = self.model, self.optimizer
        # The schedule's lr scales with this world's global batch (lr_reference_batch), fixed by effective_batch.
        self.lr_schedule: LRSchedule | None = LRSchedule(self.optimizer, cfg, self.global_batch)
        self.recipe = build_step_recipe(cfg, ctx.device)
        self.grad_scaler = self.recipe.scaler  # a Stateful too (its scale and growth tracker), None but for fp16
        self.wrapped = self.wrap(self.model)
        self.probe = comm_probe(self.wrapped)
        self.synchronize = synchronize_for(ctx.device)

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
        )
        lr = self.optimizer.param_groups[0]["lr"]  # what this step used, before the schedule moves on
        if self.lr_schedule is not None:
            self.lr_schedule.step()  # also after a skipped (overflowed) step: the lr is a function of the step index
        comm = self.probe.take()
        return StepOutcome(
            loss=result.loss,
            samples=result.samples,
            syncs=result.syncs,
            forward_seconds=result.forward_seconds,
            backward_seconds=result.backward_seconds,
            optimizer_seconds=result.optimizer_seconds,
            comm=comm,
            comm_seconds=comm.seconds,
            exposed_seconds=comm.wait_seconds,
            lr=lr,
            grad_norm=result.grad_norm,
            skipped=result.skipped,
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


class DataParallelStep(DDPStep):
    """``parallel=dp``: one process, the model replicated on every visible GPU by ``nn.DataParallel`` each forward.

    ``DDPStep`` with the wrapper swapped (no DDP wrapper is built, so no gradient hooks are left on the
    parameters): the batch is scattered over the GPUs, the outputs gathered on ``cuda:0`` (which therefore holds
    more memory), the gradients summed back onto ``cuda:0``'s module. Checkpoints save the bare model, as for DDP.
    """

    def wrap(self, model: nn.Module) -> nn.Module:
        return nn.DataParallel(model)  # model (on cuda:0) stays the bare module; comm_probe finds nothing to time
