"""The step kind of ``--parallel pipeline``: one model stage per rank, handed to the ``Trainer`` like any other.

    # a 2-stage pipeline of mini_mlp, 4 micro-batches per step, checkpointed and resumable
    torchrun --standalone --nproc-per-node=2 -m app.train --parallel pipeline --checkpoint-dir /tmp/pp
    # 4 ranks: 2 replicas of a 2-stage pipeline, each stage's gradients all-reduced between its replicas
    torchrun --standalone --nproc-per-node=4 -m app.train --parallel pipeline --pipeline-stages 2
    # your model (its forward: its children in order), the second stage beginning at its module blocks.4
    torchrun --standalone --nproc-per-node=2 -m app.train --parallel pipeline --model mypkg.models:build \
        --data mypkg.data:train_set --loss cross_entropy --pipeline-split blocks.4

``PipelineStep.train_step``: ``PipelineRunner.forward_backward`` (app.parallel.pipeline) streams the batch through
the stages, the ``StepControl`` all-reduce agrees on the loss and a stop, then each rank's optimizer updates its own
stage's parameters. The Trainer's loop, checkpoints, progress and stop logic are the same as for ``parallel=ddp``.

- Split: ``pipeline_split`` names where stages 2.. begin, or the stages are balanced by parameter count
  (``app.worker.workload.pipeline_split``, checked with the rest of the workload before any rank waits).
- Recipe: all of it (app.worker.recipe): the lr schedule, clipping by the whole model's norm (over every stage),
  autocast bf16/fp16 in every stage's forward (activations cross in the dtype they come out in), fp16 with a
  ``ShardedGradScaler`` whose found-inf flag is all-reduced over the world: every stage skips the same step.
- Data: rank r is stage ``r % S`` of replica ``r // S``; the data is dealt to the replicas, so every stage of one
  replica reads the same batch (the first stage uses the inputs, the last the labels).
- Checkpoints: one file per step as for ``parallel=ddp``, whose ``model`` is the whole model merged from the stages
  (it loads into the bare model) and whose ``optimizer`` holds every stage's optimizer state. A checkpoint written
  by another layout (``parallel=ddp``, or another stage count) is refused in one line (exit 2).
- FINISHED: every rank prints the checksum of the *merged whole model*, so all ranks print the same one, and it
  compares with a ``parallel=ddp`` run's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from app.parallel.accum import NonFiniteLossError
from app.parallel.pipeline.stages import build_pipeline_groups, build_pipeline_stage, merge_state_dicts
from app.parallel.probes import NoCommProbe
from app.worker.checkpoint.checkpointer import CheckpointMismatch
from app.worker.data import BatchShare
from app.worker.data_stream import build_batches
from app.worker.models import parameter_checksum
from app.worker.recipe import LRSchedule, build_step_recipe
from app.worker.steps.base import MicroBatches, StepInputs, StepOutcome
from app.worker.workload import build_model, build_splits, pipeline_split

log = logging.getLogger("app.train")


class _GatheredModel:
    """What the Checkpointer sees as the model: the merged whole-model ``state_dict`` gathered before each save, and
    on resume each stage's slice loaded from a whole-model one."""

    def __init__(self, runner):
        self.runner = runner
        self.gathered: dict | None = None

    def state_dict(self) -> dict:
        return self.gathered

    def load_state_dict(self, state_dict: dict) -> None:
        self.runner.load_state_dict(state_dict)


class _StageOptimizers:
    """What the Checkpointer sees as the optimizer: every stage's optimizer state in one dict (gathered before each
    save); on resume, this stage's entry. A state of another layout is a ``CheckpointMismatch`` (exit 2)."""

    def __init__(self, optimizer: torch.optim.Optimizer, stage: int, num_stages: int):
        self.optimizer, self.stage, self.num_stages = optimizer, stage, num_stages
        self.gathered: dict | None = None
        self.param_groups = optimizer.param_groups  # the Checkpointer sets the configured lr on these

    def state_dict(self) -> dict:
        return self.gathered

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("pipeline_stages")
        if saved is None:
            raise CheckpointMismatch(
                "the checkpoint was written by parallel=ddp (one optimizer for the whole model); resume it with "
                "parallel=ddp, or give parallel=pipeline another checkpoint_dir"
            )
        if saved != self.num_stages:
            raise CheckpointMismatch(
                f"the checkpoint was written by a {saved}-stage pipeline, this one has {self.num_stages} stages; "
                f"set pipeline_stages={saved}, or use another checkpoint_dir"
            )
        self.optimizer.load_state_dict(state["stages"][self.stage])


class PipelineStep:
    """This rank's stage of a pipeline run (``cfg.parallel == "pipeline"``; ``cfg.check_world`` accepted the layout).

    Every rank builds the same whole ``model`` (from the seed) and keeps its stage's slice.

    Example::

        step = PipelineStep(StepInputs(cfg, ctx, model, build_loss(cfg), grad_accum_steps=1, metrics=metrics))
    """

    def __init__(self, inputs: StepInputs):  # inputs.grad_accum_steps unused: its micro-batches are its own
        cfg, ctx, model, loss_fn = inputs.cfg, inputs.ctx, inputs.model, inputs.loss_fn
        self.cfg, self.ctx, self.metrics = cfg, ctx, inputs.metrics
        num_stages, replicas = cfg.pipeline_layout(ctx.world_size)
        batch = cfg.pipeline_batch(ctx.world_size)  # one replica's samples per step
        self.global_batch = batch * replicas
        self.model = model.to(ctx.device)
        pp_group, dp_group, self.stage, replica = build_pipeline_groups(num_stages)
        recipe = build_step_recipe(cfg, ctx.device)
        if recipe.scaler is not None:  # each stage holds a slice of the gradient: one found-inf flag for all
            recipe = dataclasses.replace(recipe, scaler=ShardedGradScaler(ctx.device.type))
        self.split = pipeline_split(cfg, self.model, num_stages)  # (check_workload checked it before any rank waited)
        self.runner = build_pipeline_stage(
            self.model,
            stage_index=self.stage,
            num_stages=num_stages,
            n_microbatches=cfg.pipeline_microbatches,
            schedule=cfg.pipeline_schedule,
            device=ctx.device,
            group=pp_group,
            dp_group=dp_group,
            loss_fn=loss_fn,
            bucket_cap_mb=cfg.bucket_cap_mb,
            split=self.split,
            recipe=recipe,
        )
        self.optimizer = torch.optim.AdamW(self.runner.module.parameters(), lr=cfg.lr)
        # The schedule steps every stage's optimizer alike; clipping and the scaler are the runner's optimizer_step.
        self.lr_schedule = LRSchedule(self.optimizer, cfg, self.global_batch)
        self.grad_scaler = recipe.scaler
        dataset = build_splits(cfg)[0]  # the set app.train tried before the process group formed
        # The replicas split the data; rank and world size of the sampler are the replica's, not the rank's.
        share = BatchShare(self.global_batch, batch, replica, replicas, ctx.device, torch.float32)
        self.batches = build_batches(dataset, cfg.seed, share)
        self.model_state = _GatheredModel(self.runner)
        self.optimizer_state = _StageOptimizers(self.optimizer, self.stage, num_stages)
        self.probe = NoCommProbe()  # the pipeline's traffic is counted by the stage (ddp_pipeline_*)
        inputs.metrics.enable_pipeline()
        log.info(
            "pipeline: %d stages x %d replicas, %s schedule, %d micro-batches of %d samples per step; stages 2.. "
            "begin at %s",
            num_stages,
            replicas,
            cfg.pipeline_schedule,
            cfg.pipeline_microbatches,
            batch // cfg.pipeline_microbatches,
            ",".join(self.split),
        )

    def train_step(
        self, micro_batches: MicroBatches, agree_nonfinite: Callable[[bool], bool], inject_nan: bool = False
    ) -> StepOutcome:
        """Forward and backward through the pipeline, the control all-reduce, then this stage's optimizer step.

        ``inject_nan`` is not supported here (the loss lives inside the schedule): the drill is parallel=ddp's.
        """
        t0 = time.perf_counter()
        ((x, y),) = micro_batches
        stage = self.runner.stage
        result = self.runner.forward_backward(x if stage.is_first else None, y if stage.is_last else None)
        backward_done = time.perf_counter()
        # Every rank knows the loss (the last stage broadcasts it), so every rank agrees before any parameter moves;
        # only the last stages flag it, so the error names a rank that computed it.
        if agree_nonfinite(stage.is_last and not math.isfinite(result.loss)):
            raise NonFiniteLossError(f"loss is {result.loss} on the last stage", local=stage.is_last)
        opt0 = time.perf_counter()
        grad_norm, skipped = self.runner.optimizer_step(self.optimizer)
        lr = self.optimizer.param_groups[0]["lr"]  # what this step used, before the schedule moves on
        self.lr_schedule.step()
        optimizer_seconds = time.perf_counter() - opt0
        self.metrics.observe_pipeline(
            stage=self.stage,
            compute_seconds=result.compute_seconds,
            send_recv_seconds=result.send_recv_seconds,
            bubble_ratio=result.bubble_ratio,
            activation_bytes=result.activation_bytes,
        )
        return StepOutcome(
            loss=result.loss,
            samples=self.global_batch // self.ctx.world_size,
            syncs=1 if self.runner.dp_group is not None else 0,
            forward_seconds=0.0,  # forwards and backwards interleave in a schedule: see ddp_pipeline_compute_seconds
            backward_seconds=backward_done - t0,
            optimizer_seconds=optimizer_seconds,
            comm=self.probe.take(),
            comm_seconds=result.send_recv_seconds,
            exposed_seconds=None,
            lr=lr,
            grad_norm=grad_norm,
            skipped=skipped,
        )

    def describe_batch(self) -> str:
        return f"{self.batches.local_samples} samples x {self.global_batch // self.batches.local_samples} replicas"

    def before_save(self) -> None:
        self.gather()

    def final_checksum(self) -> str:
        # The merged whole model's: the same on every rank, comparable with a parallel=ddp run's.
        whole = build_model(self.cfg)
        whole.load_state_dict(self.gather())
        return parameter_checksum(whole)

    def gather(self) -> dict:
        """The merged whole model, on every rank; also stages it (and every stage's optimizer state) for a save.

        Collective over the world: every rank calls it. Replicas hold equal stages, so replica 0's are taken.
        """
        mine = (
            self.stage,
            {k: v.cpu() for k, v in self.runner.state_dict().items()},
            self.optimizer.state_dict() if self.cfg.checkpoint_dir else None,
        )
        everyone: list = [None] * self.ctx.world_size
        dist.all_gather_object(everyone, mine)
        first = everyone[: self.runner.num_stages]  # replica 0: ranks 0 .. S-1, stage order
        merged = merge_state_dicts([part for _, part, _ in first])
        self.model_state.gathered = merged
        self.optimizer_state.gathered = {
            "pipeline_stages": self.runner.num_stages,
            "stages": [opt for _, _, opt in first],
        }
        return merged
