"""The ZeRO step kinds, ``--parallel zero1 | zero2 | zero3``: the ``parallel=ddp`` step with state sharded over ranks.

    # stage 2 (gradients and AdamW state sharded), checkpointed as shards, resumable on another world size
    torchrun --standalone --nproc-per-node=4 -m app.train --parallel zero2 --checkpoint-dir /tmp/z2
    torchrun --standalone --nproc-per-node=3 -m app.train --parallel zero2 --checkpoint-dir /tmp/z2 --steps 400
    # stage 3 (parameters too), one unit per Block of the transformer
    torchrun --standalone --nproc-per-node=2 -m app.train --parallel zero3 --model tiny_transformer --fsdp-units Block

What stays as for ``parallel=ddp`` (``DDPStep``, whose data dealing and batch description these kinds inherit): the
same global batches, the loss weighted by ``grad_scale``, ``accumulation_step`` (app.parallel.accum) with its NaN/inf
agreement through the Trainer's ``StepControl``. What each stage changes (app.parallel, docs/sharding.md):

- ``zero1``: our DDP all-reduces the gradient; ``ZeroRedundancyOptimizer`` keeps 1/N of AdamW's state and
  broadcasts each partition after its step. Micro-batches before the last run under DDP's ``no_sync``;
- ``zero2``: ``ShardedGradDataParallel`` reduce-scatters the gradient in buckets during backward, each rank steps
  its chunk, then all-gathers the parameters. ``no_sync`` on the non-final micro-batches, as for DDP;
- ``zero3``: ``FullyShardedDataParallel``: parameters live as 1/N fp32 shards, each unit gathered only while it
  computes. It has no ``no_sync`` (skipping the reduce-scatter would mean keeping the whole gradient, what stage 3
  exists to avoid), so every micro-batch reduce-scatters and adds into the shard's gradient. Units: each child of
  the root, or the classes named by ``fsdp_units``. CPU only (its buffers are CPU tensors).

Checkpoints are sharded (``ShardedState``, saved by app.worker.checkpoint through app.parallel.zero.checkpoint):
every rank writes its own shard, rank 0 the manifest, and a world of another size cuts them again on load.
FINISHED prints the whole model's checksum, the same on every rank (stage 3 gathers it first). The series
``ddp_zero_*`` (app.worker.metrics) are registered only by these kinds.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from app.parallel import wrap_model
from app.parallel.zero.stage1 import ZeroRedundancyOptimizer
from app.parallel.zero.stage2 import ShardedGradDataParallel
from app.parallel.zero.stage3 import FullyShardedDataParallel
from app.worker.checkpoint.checkpointer import ShardedState
from app.worker.config import ConfigError
from app.worker.recipe import LRSchedule
from app.worker.steps.base import MicroBatches, StepInputs, StepOutcome
from app.worker.steps.ddp import DDPStep

log = logging.getLogger("app.train")


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer keeps per parameter (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``)."""
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


class ShardedStep(DDPStep):
    """What the three stages share: ``DDPStep``'s data and loop, another wrapper and optimizer, sharded checkpoints.

    A stage sets ``stage`` and implements ``wrap`` (the wrapper, built once), ``build_optimizer`` and
    ``memory_bytes``; ``comm_source`` is the wrapper whose ``comm_bytes``/``comm_seconds`` it reports (None: none).

    Example::

        step = STEP_KINDS["zero2"](StepInputs(cfg, ctx, model, build_loss(cfg), grad_accum_steps=2, metrics=metrics))
        outcome = step.train_step(step.batches.next_micro_batches(), agree_nonfinite=lambda bad: bad)
    """

    stage = 0

    def __init__(self, inputs: StepInputs):
        super().__init__(inputs)
        cfg, ctx, metrics = inputs.cfg, inputs.ctx, inputs.metrics
        # DDPStep built an AdamW over the bare parameters (it allocates no state before a step): replaced here,
        # and the schedule with it. The recipe (autocast, clipping by the global norm, the schedule) is DDPStep's.
        self.optimizer = self.build_optimizer()
        self.lr_schedule = LRSchedule(self.optimizer, cfg, self.global_batch)
        if self.recipe.scaler is not None and self.stage >= 2:
            # Sharded gradients: one rank's inf is in its shard only. ShardedGradScaler all-reduces what unscale_
            # found, so every rank skips the same step (stage 1's gradients are whole and equal: GradScaler's own).
            self.recipe = dataclasses.replace(self.recipe, scaler=ShardedGradScaler(ctx.device.type))
            self.grad_scaler = self.recipe.scaler
        self.model_state = self.optimizer_state = ShardedState(self.wrapped, self.optimizer, cfg.parallel)
        self.metrics = metrics
        metrics.enable_zero(self.stage)
        self._seen = self._comm_totals()

    def build_optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError

    def before_save(self) -> None:
        # The last step's gradients are used by nothing (every step starts with zero_grad): dropped before the
        # save, whose pieces take their place, so a save adds nothing to the step's peak.
        self.optimizer.zero_grad(set_to_none=True)

    def memory_bytes(self) -> tuple[int, int, int]:
        """``(parameters, gradients, optimizer state)`` bytes this rank holds after a step."""
        raise NotImplementedError

    @property
    def comm_source(self):
        return None

    def _comm_totals(self) -> dict[str, tuple[int, float]]:
        src = self.comm_source
        if src is None:
            return {}
        return {name: (src.comm_bytes[name], src.comm_seconds[name]) for name in ("reduce_scatter", "all_gather")}

    def micro_batch_syncs(self, micro_batches: MicroBatches, counted: int) -> int:
        return counted  # accumulation_step counts the synchronised backwards of a wrapper with no_sync

    def train_step(
        self, micro_batches: MicroBatches, agree_nonfinite: Callable[[bool], bool], inject_nan: bool = False
    ) -> StepOutcome:
        """``DDPStep``'s step over the sharded wrapper, then the stage's own traffic and memory in its metrics."""
        outcome = super().train_step(micro_batches, agree_nonfinite, inject_nan)  # stage 1: our DDP's buckets
        now = self._comm_totals()
        delta = {k: (now[k][0] - self._seen[k][0], now[k][1] - self._seen[k][1]) for k in now}
        self._seen = now
        params, grads, opt_state = self.memory_bytes()
        self.metrics.observe_zero(
            collectives=delta, parameter_bytes=params, gradient_bytes=grads, optimizer_state_bytes=opt_state
        )
        return dataclasses.replace(
            outcome,
            syncs=self.micro_batch_syncs(micro_batches, outcome.syncs),
            comm_seconds=outcome.comm_seconds + sum(seconds for _, seconds in delta.values()),
            exposed_seconds=outcome.exposed_seconds if self.stage == 1 else delta["reduce_scatter"][1],
        )


class Zero1Step(ShardedStep):
    """``parallel=zero1``: the model whole on every rank, gradients all-reduced, AdamW's state 1/N per rank."""

    stage = 1

    def wrap(self, model: nn.Module) -> nn.Module:
        # The gradient lives in DDP's buckets alone (p.grad a view of them), not once there and again in p.grad:
        # stage 1 keeps a whole gradient per rank, not two (PyTorch's ZeRO examples set it for the same reason).
        return wrap_model(model, self.cfg.wrapper, bucket_cap_mb=self.cfg.bucket_cap_mb, gradient_as_bucket_view=True)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=torch.optim.AdamW, lr=self.cfg.lr)

    def memory_bytes(self) -> tuple[int, int, int]:
        params = list(self.model.parameters())
        return tensor_bytes(params), tensor_bytes(p.grad for p in params), optimizer_state_bytes(self.optimizer.optim)


class Zero2Step(ShardedStep):
    """``parallel=zero2``: parameters whole, gradients reduce-scattered (1/N kept), AdamW over this rank's shards."""

    stage = 2

    def wrap(self, model: nn.Module) -> nn.Module:
        wrapped = ShardedGradDataParallel(
            model, bucket_cap_mb=self.cfg.bucket_cap_mb, overlap_gather=bool(self.cfg.overlap_gather)
        )
        if wrapped.overlap_gather:  # read back from the wrapper: the log says what it was built with
            log.info("zero2: overlap_gather on: each step's parameter all-gathers run on into the next forward")
        return wrapped

    def build_optimizer(self) -> torch.optim.Optimizer:
        # The wrapper's own builder: AdamW over the shards, all-gathering the parameters after every step.
        return self.wrapped.build_optimizer(torch.optim.AdamW, lr=self.cfg.lr)

    @property
    def comm_source(self):
        return self.wrapped

    def final_checksum(self) -> str:
        # overlap_gather leaves the last step's all-gathers in flight until a next forward, which never comes.
        self.wrapped.wait_parameters()
        return super().final_checksum()

    def memory_bytes(self) -> tuple[int, int, int]:
        shards = self.wrapped.shard_parameters()
        return (
            tensor_bytes(self.model.parameters()),
            tensor_bytes(s.grad for s in shards),
            optimizer_state_bytes(self.optimizer),
        )


class Zero3Step(ShardedStep):
    """``parallel=zero3``: parameters, gradients and AdamW's state all 1/N per rank (``FullyShardedDataParallel``)."""

    stage = 3
    # FullyShardedDataParallel.no_sync() keeps a whole model's gradient per rank: the memory stage 3 exists to save.
    # The worker reduce-scatters every micro-batch instead (more collectives, no such peak).
    sync_every_micro_batch = True

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.ctx.device.type != "cpu":
            raise ConfigError(
                f"parallel=zero3 runs on the CPU only (ZeRO stage 3's buffers are CPU tensors), this rank has "
                f"{self.ctx.device}; set device=cpu, or use parallel=zero2"
            )
        wrapped = FullyShardedDataParallel(
            model,
            units=resolve_fsdp_units(model, self.cfg.fsdp_units),
            prefetch=self.cfg.prefetch,
            reshard_after_forward=bool(self.cfg.reshard_after_forward),
        )
        if wrapped.prefetch or not wrapped.reshard_after_forward:  # read back from the wrapper, as zero2's
            log.info(
                "zero3: prefetch %d, reshard_after_forward %s",
                wrapped.prefetch,
                "on" if wrapped.reshard_after_forward else "off: each unit whole from its forward to its backward",
            )
        return wrapped

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.wrapped.parameters(), lr=self.cfg.lr)  # the fp32 shards (+ frozen ones)

    @property
    def comm_source(self):
        return self.wrapped

    def micro_batch_syncs(self, micro_batches: MicroBatches, counted: int) -> int:
        return len(micro_batches)  # no no_sync (sync_every_micro_batch): every micro-batch's backward reduce-scatters

    def memory_bytes(self) -> tuple[int, int, int]:
        shards = list(self.wrapped.parameters())
        return tensor_bytes(shards), tensor_bytes(s.grad for s in shards), optimizer_state_bytes(self.optimizer)

    def final_checksum(self) -> str:
        # Collective, one unit at a time: the whole model's checksum on every rank, without the whole model.
        return self.wrapped.parameter_checksum()


def resolve_fsdp_units(model: nn.Module, fsdp_units: str) -> list[type] | None:
    """The module classes ``fsdp_units`` names (a comma list); None for "" (each child of the root).

    A name that matches no module of ``model`` is a ``ConfigError`` naming the classes it does have.
    """
    names = [n.strip() for n in fsdp_units.split(",") if n.strip()]
    if not names:
        return None
    classes = {type(m).__name__: type(m) for _, m in model.named_modules() if _}
    missing = [n for n in names if n not in classes]
    if missing:
        raise ConfigError(
            f"fsdp_units={fsdp_units!r}: {', '.join(missing)} names no module class of {type(model).__name__} "
            f"(it has {', '.join(sorted(classes))}); name those, or leave fsdp_units empty"
        )
    return [classes[n] for n in names]


STAGES: dict[str, type[ShardedStep]] = {"zero1": Zero1Step, "zero2": Zero2Step, "zero3": Zero3Step}
