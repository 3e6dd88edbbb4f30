"""The training loop: build → resume → (step → maybe checkpoint → log) until done or stopped, for every step kind.

``Trainer.run()`` only calls components, each owning one job:

- the step kind (app.worker.steps: ``DDPStep``, ``DataParallelStep``, ``PipelineStep``, the ZeRO stages): one
  optimizer step over this rank's share of the global batch, and the model/optimizer ``Stateful``s a checkpoint holds;
- ``StepControl`` (app.worker.control): the one control all-reduce per step, carrying the NaN/inf flag and the stop;
- ``Checkpointer`` (app.worker.checkpoint.checkpointer): resume, cadence, RNG state, the final save;
- ``ProgressLog`` (app.worker.progress): rank 0's progress lines and the summary, one ``StepRecord`` per step;
- ``TrainMetrics`` (app.worker.metrics): the ``/metrics`` endpoint;
- ``Validator`` (app.worker.evaluation): the validation loss over the held-out split, every ``eval_every`` steps.

``Trainer.step_index`` counts optimizer steps (0 before the first; the checkpoint's step after a resume);
``Trainer.step`` is the step kind. ``app.train`` builds the process group, the metrics, the stop signal and the step
kind (``build_step``), then runs ``Trainer(...).run()``.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from app.diagnostics.recorder import RECORDER, failure_reason
from app.diagnostics.session import start_recording
from app.diagnostics.throughput import StepFlops, tokens_per_sample
from app.exit_codes import OK, PEER_STOPPED
from app.parallel.accum import NonFiniteLossError
from app.worker.checkpoint.checkpointer import Checkpointer
from app.worker.config import TrainConfig
from app.worker.control import StepControl, StopSignal
from app.worker.dist import DistContext, WorldEnv
from app.worker.evaluation import build_validator
from app.worker.progress import ProgressLog, StepRecord
from app.worker.steps.base import TrainStep
from app.worker.workload import model_name

log = logging.getLogger("app.train")
# compose/k8s signal every container within milliseconds: wait this long before calling a stop a peer's alone.
PEER_STOP_GRACE_SECONDS = 3.0


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf on some rank; every rank stops before the optimizer step."""


class Trainer:
    """One rank's training run: the step kind it is handed, and the components above.

    Example::

        step = build_step(cfg, ctx, grad_accum_steps, metrics)   # app.worker.steps
        code = Trainer(cfg, ctx, world, stop, metrics, step=step).run()
    """

    def __init__(
        self, cfg: TrainConfig, ctx: DistContext, world: WorldEnv, stop: StopSignal, metrics, *, step, healer=None
    ):
        self.cfg, self.ctx, self.stop, self.metrics = cfg, ctx, stop, metrics
        self.step: TrainStep = step
        self.healer = healer  # heal=in_place (app.worker.heal); None: a lost peer ends the run, torchrun restarts it
        self.start_recording()
        self.checkpointer = Checkpointer(
            cfg.checkpoint_dir,
            every=cfg.checkpoint_every,
            keep=cfg.keep_checkpoints,
            ctx=ctx,
            model=step.model_state,
            optimizer=step.optimizer_state,
            batches=step.batches,
            model_name=model_name(cfg),  # the model spec and its keywords: a resume with another is refused
            seed=cfg.seed,
            lr=cfg.lr,
            global_batch=step.global_batch,
            lr_schedule=getattr(step, "lr_schedule", None),  # only the kinds that run the recipe have these
            grad_scaler=getattr(step, "grad_scaler", None),
        )
        torch.manual_seed(cfg.seed + ctx.rank)  # per-rank randomness (dropout, ...) differs between ranks
        # A newcomer to a live world (heal=in_place) is given the state by a peer (attach, below), not the disk.
        self.resumed = None if healer and healer.joining else self.checkpointer.resume()
        self.step_index = self.resumed.step if self.resumed else 0
        self._observe_start(world)
        self.control = StepControl(ctx, stop)
        self.flops = StepFlops()
        self.progress = ProgressLog(cfg.steps, cfg.log_every, self.step_index + 1)
        self.validator = build_validator(cfg, ctx, step.loss_fn) if cfg.eval_every else None
        if healer:
            healer.attach(self)

    def start_recording(self) -> None:
        """This world's flight recorder (docs/diagnostics.md); a heal in place starts it again for the new world."""
        cfg = self.cfg
        flight = str(Path(cfg.checkpoint_dir) / "flight") if cfg.checkpoint_dir else None
        start_recording(entries=cfg.flight_recorder_entries, dump_dir=flight, desync_check=bool(cfg.desync_check))

    def run(self) -> int:
        """Train up to ``steps``; OK when finished or stopped on request, PEER_STOPPED when stopped for a peer."""
        try:
            return self._run()
        except Exception as e:  # a collective timeout, a lost peer, a desync, a NaN: the ring says where each rank was
            RECORDER.dump(failure_reason(e))
            raise

    def _run(self) -> int:
        self._announce()
        cause = None
        while True:
            try:
                if cause:  # outside the except: the failed step's frames (and its wrapper) are gone by now
                    self.healer.heal(self, cause)
                stopped = self._train()
                break
            except RuntimeError as e:  # heal=in_place: a lost peer is healed, and the loop goes on
                cause = self.healer.cause(e) if self.healer else None
                if cause is None:
                    raise
        if stopped is not None:
            return stopped
        if self.healer:
            self.healer.leave(self)
        self.progress.summary()
        self._finished()
        self._barrier()  # leave together: a gather's source must not tear down while a peer reads (app.worker.dist)
        return OK

    def _train(self) -> int | None:
        """The steps up to ``steps`` (None), or the exit code of a stop."""
        cfg = self.cfg
        while self.step_index < cfg.steps:
            if self.healer:
                self.healer.before_step(self)
            record = self.run_step(self.step_index + 1)
            self.step_index = record.step_index
            if self.healer:
                self.healer.after_step(self)
            if self.progress.record(record):
                self.checkpointer.note_progress(self.step_index)
            self.maybe_validate()
            final = self.step_index == cfg.steps or self.control.stop
            if self.checkpointer.should_save(self.step_index, final=final):
                self.save()
            if self.control.stop and self.step_index < cfg.steps:  # a signal during the last step: complete anyway
                return self._stopped()
            if self.control.join and self.step_index < cfg.steps:  # every rank saw it in the same step control
                self.healer.heal(self, "a new rank asks to join")
        self._barrier()  # nobody reports FINISHED before rank 0's final checkpoint is on disk
        return None

    def run_step(self, step_index: int) -> StepRecord:
        """One optimizer step with its measurements; raises TrainingDiverged on a NaN/inf loss on any rank."""
        cfg, ctx = self.cfg, self.ctx
        drill = step_index == cfg.inject_nan_at_step and ctx.rank == ctx.world_size - 1
        t0 = time.perf_counter()
        try:
            with self.flops.measure():  # (counts the first step's FLOPs only: ddp_mfu_ratio's numerator)
                micro_batches = self.step.batches.next_micro_batches()
                outcome = self.step.train_step(micro_batches, self.control, inject_nan=drill)
        except NonFiniteLossError:  # raised on every rank together, before any optimizer step
            raise TrainingDiverged(
                f"loss became NaN/inf at step {step_index} on rank {self.control.bad_rank}; every rank stopped "
                f"before the optimizer step. {self.checkpointer.last_good()} Lower lr or check the data"
            ) from None
        seconds = time.perf_counter() - t0
        if outcome.skipped:  # every rank skipped it alike; the schedule moved on all the same
            log.info("step %d skipped by the GradScaler (inf/NaN gradient on some rank); scale halved", step_index)
        self.metrics.observe_step(
            step_seconds=seconds,
            forward_seconds=outcome.forward_seconds,
            backward_seconds=outcome.backward_seconds,
            optimizer_seconds=outcome.optimizer_seconds,
            comm=outcome.comm,
            samples=outcome.samples,
            syncs=outcome.syncs,
            loss=outcome.loss,
            lr=outcome.lr,
        )
        tokens = tokens_per_sample(micro_batches[0][0]) if micro_batches else 1
        self.metrics.observe_throughput(
            samples=outcome.samples,
            tokens_per_sample=tokens,
            seconds=seconds,
            flops=self.flops.per_step,
            device=ctx.device,
        )
        self.metrics.observe_progress(step_index, cfg.steps)
        if self.resumed and self.resumed.wall_time and not self.progress.all:
            self.metrics.observe_reformation(time.time() - self.resumed.wall_time)
        if cfg.min_step_seconds:  # paced after the step's own figures: the metrics keep the step's real time
            time.sleep(max(0.0, cfg.min_step_seconds - (time.perf_counter() - t0)))
        return StepRecord(
            step_index, seconds, outcome.comm_seconds, outcome.exposed_seconds, outcome.loss, self.step.global_batch
        )

    def maybe_validate(self) -> None:
        """Every ``eval_every`` steps: the validation loss, logged by rank 0 and set as ``ddp_validation_loss``."""
        if self.validator is None or self.step_index % self.cfg.eval_every:
            return
        loss = self.validator.evaluate(self.step.model)  # collective: every rank is at this step
        self.metrics.observe_validation(loss)
        log.info("step %d: validation loss %.6f over %d held-out samples", self.step_index, loss, self.validator.size)

    def save(self) -> None:
        self.step.before_save()  # collective: e.g. the pipeline gathers its stages
        written = self.checkpointer.save(self.step_index)
        self.metrics.observe_checkpoint(self.step_index, written[1] if written else None)
        if written:
            log.info("checkpoint %s written in %.0f ms", written[0], written[1] * 1e3)
        if written and written[1] > self.cfg.checkpoint_timeout_seconds:  # (the order: app.worker.config.timeouts)
            log.warning(
                "checkpoint write took %.1f s > checkpoint_timeout_seconds=%g: raise it, and stop_timeout_seconds "
                "and collective_timeout_seconds above it, or a slow save will pass for a hung rank 0",
                written[1],
                self.cfg.checkpoint_timeout_seconds,
            )

    # -- the edges of the run ---------------------------------------------------------------------------------------
    def _observe_start(self, world: WorldEnv) -> None:
        generation = self.checkpointer.generation
        self.metrics.observe_world(
            world_size=self.ctx.world_size,
            min_world_size=world.min_world_size,
            max_world_size=world.max_world_size,
            restart_count=world.restart_count,
            generation=generation,
        )
        self.metrics.observe_progress(self.step_index, self.cfg.steps)  # before the first step: where a job is
        r = self.resumed
        if r is None:
            if self.cfg.checkpoint_dir:
                log.info("no checkpoint in %s: starting from step 0", self.cfg.checkpoint_dir)
            return
        self.metrics.observe_checkpoint(r.step, None)
        self.metrics.observe_resume(steps_redone=r.steps_redone or 0)
        log.info(
            "resumed from %s (step %d, epoch %d, saved by a world of %d; world generation %d)",
            r.path,
            r.step,
            r.epoch,
            r.world_size,
            generation,
        )
        global_batch = self.step.global_batch
        if r.global_batch is not None and r.global_batch != global_batch:
            log.warning(
                "the global batch changes from %d to %d samples per step with this world of %d; "
                "set effective_batch=%d to keep it at any world size",
                r.global_batch,
                global_batch,
                self.ctx.world_size,
                r.global_batch,
            )

    def _announce(self) -> None:
        cfg = self.cfg
        if self.step_index >= cfg.steps:
            log.warning("checkpoint step %d >= steps=%d: nothing to train", self.step_index, cfg.steps)
        log.info(
            "training %s from step %d to %d: %s = %d samples per step",
            cfg.model,
            self.step_index,
            cfg.steps,
            self.step.describe_batch(),
            self.step.global_batch,
        )

    def _finished(self) -> None:
        checksum = self.step.final_checksum()[:16]  # collective for a pipeline and zero3: before the write
        # One write call for the whole line: torchrun runs workers unbuffered (-u), and print() would write the
        # text and the newline separately, letting two ranks' lines interleave on a shared stdout.
        sys.stdout.write(
            f"FINISHED rank={self.ctx.rank} world_size={self.ctx.world_size} step={self.step_index} "
            f"checksum={checksum}\n"
        )
        sys.stdout.flush()

    def _barrier(self) -> None:
        dist.all_reduce(torch.zeros(1, device=self.ctx.device))

    def _stopped(self) -> int:
        self._barrier()
        where = (
            f"checkpoint at step {self.step_index}" if self.cfg.checkpoint_dir else "no checkpoint_dir: progress lost"
        )
        # A rank not signalled itself may just be a few ms behind its own signal (compose stops all containers).
        if self.stop.requested or self.stop.event.wait(PEER_STOP_GRACE_SECONDS):
            log.warning("%s: stopped at step %d (%s); exit %d", self.stop.name, self.step_index, where, OK)
            return OK
        # PEER_STOPPED (75, EX_TEMPFAIL), not FAILED: a Kubernetes Job ignores it (k8s/base/job.yaml's
        # podFailurePolicy), so only the stopped pod's own end is judged; an elastic torchrun re-forms the group on
        # any non-zero exit.
        log.warning(
            "a peer was signalled: stopped at step %d (%s); exit %d so the group re-forms",
            self.step_index,
            where,
            PEER_STOPPED,
        )
        return PEER_STOPPED
