"""The training loop of ``--parallel pipeline`` (one model stage per rank) and ``--parallel dp`` (nn.DataParallel).

    # a 2-stage pipeline of mini_mlp, 4 micro-batches per step, checkpointed and resumable
    torchrun --standalone --nproc-per-node=2 -m app.train --parallel pipeline --checkpoint-dir /tmp/pp
    # 4 ranks: 2 replicas of a 2-stage pipeline, each stage's gradients all-reduced between its replicas
    torchrun --standalone --nproc-per-node=4 -m app.train --parallel pipeline --pipeline-stages 2
    # one process driving every visible GPU (>= 2) with nn.DataParallel
    python -m app.train --parallel dp

``PipelineTrainer`` keeps the ``Trainer``'s outward behaviour and reuses its components: ``ProgressLog``,
``StepControl`` (the per-step stop/NaN all-reduce over the whole world), ``Checkpointer`` and ``TrainMetrics``.
What differs is the step: ``PipelineRunner.step`` (app.parallel.pipeline) streams the batch through the stages,
then each rank's optimizer updates its own stage's parameters.

- Data: rank r is stage ``r % S`` of replica ``r // S``; the data is dealt to the replicas, so every stage of one
  replica reads the same batch (the first stage uses the inputs, the last the labels).
- Checkpoints: one file per step as the Trainer writes it (``Checkpointer``), whose ``model`` is the whole model
  merged from the stages (it loads into the bare model) and whose ``optimizer`` holds every stage's optimizer
  state. A checkpoint written by another layout (``parallel=ddp``, or another stage count) is refused in one line.
- FINISHED: every rank prints the checksum of the *merged whole model*, so all ranks print the same one, and it
  compares with a ``parallel=ddp`` run's.
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from app.parallel.pipeline import build_pipeline_groups, build_pipeline_stage, merge_state_dicts
from app.parallel.probes import NoCommProbe
from app.worker.checkpoint import CheckpointMismatch
from app.worker.config import TrainConfig
from app.worker.data import GlobalBatches, build_dataset, loss_function
from app.worker.dist import DistContext, WorldEnv
from app.worker.models import MODELS
from app.worker.trainer import ProgressLog, StepControl, StepRecord, Trainer, TrainingDiverged

log = logging.getLogger("app.train")


class _GatheredModel:
    """What ``Checkpointer`` sees as the model: the merged whole-model ``state_dict`` gathered before each save, and
    on resume each stage's slice loaded from a whole-model one."""

    def __init__(self, runner):
        self.runner = runner
        self.gathered: dict | None = None

    def state_dict(self) -> dict:
        return self.gathered

    def load_state_dict(self, state_dict: dict) -> None:
        self.runner.load_state_dict(state_dict)


class _StageOptimizers:
    """What ``Checkpointer`` sees as the optimizer: every stage's optimizer state in one dict (gathered before each
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


class PipelineTrainer(Trainer):
    """One rank's stage of a pipeline run, with the ``Trainer``'s run loop, checkpoints, progress and stop logic.

    Args:
        cfg: the configuration (``cfg.parallel == "pipeline"``; ``cfg.check_world`` accepted the layout).
        ctx, world, stop, metrics: as for ``Trainer``.

    Example::

        code = PipelineTrainer(cfg, ctx, world, stop, metrics).run()  # every rank of the world
    """

    def __init__(self, cfg: TrainConfig, ctx: DistContext, world: WorldEnv, stop, metrics):
        self.cfg, self.ctx, self.stop, self.metrics = cfg, ctx, stop, metrics
        num_stages, replicas = cfg.pipeline_layout(ctx.world_size)
        batch = cfg.pipeline_batch(ctx.world_size)  # one replica's samples per step
        self.global_batch = batch * replicas
        torch.manual_seed(cfg.seed)  # every rank builds the same whole model and keeps its stage's slice
        self.model = MODELS[cfg.model]().to(ctx.device)
        pp_group, dp_group, self.stage, replica = build_pipeline_groups(num_stages)
        self.loss_fn = loss_function(cfg.model)
        self.runner = build_pipeline_stage(
            self.model,
            stage_index=self.stage,
            num_stages=num_stages,
            n_microbatches=cfg.pipeline_microbatches,
            schedule=cfg.pipeline_schedule,
            device=ctx.device,
            group=pp_group,
            dp_group=dp_group,
            loss_fn=self.loss_fn,
            bucket_cap_mb=cfg.bucket_cap_mb,
        )
        self.optimizer = torch.optim.AdamW(self.runner.module.parameters(), lr=cfg.lr)
        dataset = build_dataset(cfg.model, cfg.dataset_size, cfg.seed, cfg.seq_len)
        # The replicas split the data; rank and world size of the sampler are the replica's, not the rank's.
        self.batches = GlobalBatches(dataset, self.global_batch, batch, replica, replicas, cfg.seed, ctx.device)
        self._ckpt_model = _GatheredModel(self.runner)
        self._ckpt_optimizer = _StageOptimizers(self.optimizer, self.stage, num_stages)
        self.checkpointer = self.build_checkpointer(self._ckpt_model, self._ckpt_optimizer)
        torch.manual_seed(cfg.seed + ctx.rank)
        self.resumed = self.checkpointer.resume()
        self.step = self.resumed.step if self.resumed else 0
        self._observe_start(world)
        self.metrics.enable_pipeline()
        self.probe = NoCommProbe()  # the pipeline's traffic is counted by the stage (ddp_pipeline_*)
        self.control = StepControl(ctx, stop)
        self.progress = ProgressLog(cfg.steps, cfg.log_every, self.step + 1)
        log.info(
            "pipeline: %d stages x %d replicas, %s schedule, %d micro-batches of %d samples per step",
            num_stages,
            replicas,
            cfg.pipeline_schedule,
            cfg.pipeline_microbatches,
            batch // cfg.pipeline_microbatches,
        )

    def train_step(self, step: int) -> StepRecord:
        """Forward and backward through the pipeline, the control all-reduce, then this stage's optimizer step."""
        t0 = time.perf_counter()
        ((x, y),) = self.batches.next_micro_batches()
        stats = self.runner.step(x if self.runner.stage.is_first else None, y if self.runner.stage.is_last else None)
        backward_done = time.perf_counter()
        # Every rank knows the loss (the last stage broadcasts it), so every rank agrees before any parameter moves.
        if self.control(not math.isfinite(stats.loss)):
            raise TrainingDiverged(
                f"loss became NaN/inf at step {step}; every stage stopped before the optimizer step. "
                f"{self.checkpointer.last_good()} Lower lr or check the data"
            )
        opt0 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        self.metrics.observe_step(
            step_seconds=seconds,
            forward_seconds=0.0,  # forwards and backwards interleave in a schedule: see ddp_pipeline_compute_seconds
            backward_seconds=backward_done - t0,
            optimizer_seconds=time.perf_counter() - opt0,
            comm=self.probe.take(),
            samples=self.global_batch // self.ctx.world_size,
            syncs=1 if self.runner.dp_group is not None else 0,
            loss=stats.loss,
            lr=self.cfg.lr,
        )
        self.metrics.observe_pipeline(
            stage=self.stage,
            compute_seconds=stats.compute_seconds,
            send_recv_seconds=stats.send_recv_seconds,
            bubble_ratio=stats.bubble_ratio,
            activation_bytes=stats.activation_bytes,
        )
        self.metrics.observe_progress(step, self.cfg.steps)
        if self.resumed and self.resumed.wall_time and not self.progress.all:
            self.metrics.observe_reformation(time.time() - self.resumed.wall_time)
        return StepRecord(step, seconds, stats.send_recv_seconds, None, stats.loss, self.global_batch)

    def save(self) -> None:
        self.gather()
        super().save()

    def gather(self) -> dict:
        """The merged whole model, on every rank; also stages it (and every stage's optimizer state) for a save.

        Collective over the world: every rank calls it. Replicas hold equal stages, so replica 0's are taken.
        """
        mine = (
            self.stage,
            {k: v.cpu() for k, v in self.runner.state_dict().items()},
            self.optimizer.state_dict() if self.checkpointer.directory else None,
        )
        everyone: list = [None] * self.ctx.world_size
        dist.all_gather_object(everyone, mine)
        first = everyone[: self.runner.num_stages]  # replica 0: ranks 0 .. S-1, stage order
        merged = merge_state_dicts([part for _, part, _ in first])
        self._ckpt_model.gathered = merged
        self._ckpt_optimizer.gathered = {
            "pipeline_stages": self.runner.num_stages,
            "stages": [opt for _, _, opt in first],
        }
        return merged

    def _announce(self) -> None:
        if self.step >= self.cfg.steps:
            log.warning("checkpoint step %d >= steps=%d: nothing to train", self.step, self.cfg.steps)
        log.info(
            "training %s from step %d to %d: %d samples x %d replicas = %d samples per step",
            self.cfg.model,
            self.step,
            self.cfg.steps,
            self.batches.local_samples,
            self.global_batch // self.batches.local_samples,
            self.global_batch,
        )

    def _finished(self) -> None:
        # The checksum of the merged whole model: the same on every rank, comparable with a parallel=ddp run's.
        merged = self.gather()
        whole = MODELS[self.cfg.model]()
        whole.load_state_dict(merged)
        self.model = whole
        super()._finished()


class DataParallelTrainer(Trainer):
    """``--parallel dp``: one process, the model replicated on every visible GPU by ``nn.DataParallel`` each forward.

    The ``Trainer`` with the wrapper swapped: the batch is scattered over the GPUs, the outputs gathered on
    ``cuda:0`` (which therefore holds more memory), the gradients summed back onto ``cuda:0``'s module. Checkpoints
    save the bare model (``.module``), as the ``Trainer`` does for DDP.
    """

    def __init__(self, cfg: TrainConfig, ctx: DistContext, world: WorldEnv, grad_accum_steps: int, stop, metrics):
        super().__init__(cfg, ctx, world, grad_accum_steps, stop, metrics)
        self.wrapped = torch.nn.DataParallel(self.model)  # self.model (on cuda:0) stays the bare module
        self.probe = NoCommProbe()
