"""Step kinds: what differs between plain DDP, pipeline and DataParallel training, handed to the one ``Trainer``.

The ``Trainer`` (app.worker.trainer) runs the same loop for every kind: load a step's micro-batches, call
``step.train_step(...)``, maybe checkpoint, log. A step kind is the one object that knows how the ranks share the
work; each builds what it needs from ``(cfg, ctx, model, loss_fn)`` and exposes (the ``TrainStep`` protocol):

- ``train_step(micro_batches, agree_nonfinite, inject_nan=False) -> StepOutcome``: one optimizer step;
- ``model_state`` / ``optimizer_state``: the two ``Stateful``s (``state_dict``/``load_state_dict``) the
  ``Checkpointer`` saves and restores: always the *whole, bare* model's state, so every checkpoint loads into
  ``build_model(cfg)`` (app.worker.workload) without a wrapper; ``lr_schedule`` / ``grad_scaler``: two more, or
  None where the kind has none (``parallel=ddp``, zero* and pipeline run the recipe of app.worker.recipe: autocast,
  GradScaler, clipping, schedule);
- ``batches`` (this rank's share of each global batch), ``global_batch``, ``describe_batch()`` for the start line;
- ``before_save()`` (collective: whatever must be gathered first) and ``final_checksum()`` (collective: the
  FINISHED checksum of the whole model, the same on every rank, app.parallel.checksum).

The kinds (``STEP_KINDS`` in app.worker.steps, chosen by ``cfg.parallel`` in ``build_step``):

- ``DDPStep`` (``parallel=ddp``): ``accumulation_step`` (app.parallel.accum) through ``wrap_model`` (ours, torch
  or none);
- ``DataParallelStep`` (``parallel=dp``): the same step through ``nn.DataParallel``; no DDP wrapper is built;
- ``PipelineStep`` (``parallel=pipeline``, app.worker.steps.pipeline): one stage per rank, replicas all-reduced;
- ``Zero1Step``/``Zero2Step``/``Zero3Step`` (``parallel=zero1|zero2|zero3``, app.worker.steps.zero): ``DDPStep``
  with optimizer state / + gradients / + parameters sharded over the ranks, checkpointed as shards.

A new kind plugs in by adding a class with these members to ``STEP_KINDS`` (app.worker.steps; its name to
the config's ``parallel`` choices): the ``Trainer`` does not change. Try one:
``python -m app.train --wrapper none --steps 20``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from app.parallel.probes import CommSample
from app.worker.config import TrainConfig
from app.worker.data import GlobalBatches
from app.worker.data_stream import StreamBatches
from app.worker.dist import DistContext

MicroBatches = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class StepInputs:
    """What every step kind is built from (``build_step`` makes it; a kind takes it whole)."""

    cfg: TrainConfig
    ctx: DistContext  # this rank's place and device, the process group formed
    model: nn.Module  # the bare model, built from the seed: the same on every rank
    loss_fn: Callable
    grad_accum_steps: int  # the kinds that accumulate; the pipeline's micro-batches are its own
    metrics: Any = None  # for the kinds with series of their own (the pipeline's ddp_pipeline_*)


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
    batches: GlobalBatches | StreamBatches
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
