"""The training loop: build → resume → (step → maybe checkpoint → log) until done or stopped.

``Trainer.run()`` only calls components, each owning one job:

- ``accumulation_step`` (app.parallel.accum): one optimizer step over this rank's share of the global batch;
- ``StepControl``: the one control all-reduce per step, carrying both the NaN/inf flag and the stop request;
- ``Checkpointer`` (app.worker.checkpoint): resume, cadence, RNG state, the final save;
- ``ProgressLog``: rank 0's progress lines and the summary, from typed ``StepRecord``s;
- ``TrainMetrics`` (app.worker.metrics): the ``/metrics`` endpoint.

``app.train.main`` builds the process group, the metrics and the stop signal, then runs ``Trainer(...).run()``.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from app.parallel import wrap_model
from app.parallel.accum import NonFiniteLossError, StepResult, accumulation_step
from app.parallel.probes import comm_probe
from app.worker.checkpoint import Checkpointer
from app.worker.config import TrainConfig
from app.worker.data import GlobalBatches, build_dataset, loss_function
from app.worker.dist import DistContext, WorldEnv
from app.worker.metrics import synchronize_for
from app.worker.models import MODELS, parameter_checksum

log = logging.getLogger("app.train")
# compose/k8s signal every container within milliseconds: wait this long before calling a stop a peer's alone.
PEER_STOP_GRACE_SECONDS = 3.0


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf on some rank; every rank stops before the optimizer step."""


@dataclass
class StepRecord:
    """What one finished step reports to the progress log."""

    step: int
    seconds: float  # wall time of the step on this rank
    comm_seconds: float  # all-reduce time inside it
    exposed_seconds: float | None  # communication the end of backward waited for (None: not measurable)
    loss: float  # this rank's mean loss
    samples: int  # samples of the step over all ranks (the global batch)


class ProgressLog:
    """Rank 0's progress line every ``log_every`` steps (and the first and last), averaging the steps since the last
    line; the run's summary at the end.

    Example::

        progress = ProgressLog(steps=200, log_every=10, first_step=1)
        progress.record(StepRecord(step=1, seconds=0.01, comm_seconds=0.002, exposed_seconds=0.001, loss=2.08,
                                   samples=128))
    """

    def __init__(self, steps: int, log_every: int, first_step: int):
        self.steps, self.log_every, self.first_step = steps, log_every, first_step
        self.window: list[StepRecord] = []
        self.all: list[StepRecord] = []

    def record(self, rec: StepRecord) -> bool:
        """Add one step; True when it closed a window (a progress line was logged)."""
        self.window.append(rec)
        self.all.append(rec)
        if not (rec.step == self.first_step or rec.step % self.log_every == 0 or rec.step == self.steps):
            return False
        w, n = self.window, len(self.window)
        seconds = sum(r.seconds for r in w)
        waits = [r.exposed_seconds for r in w if r.exposed_seconds is not None]  # None under PyTorch's DDP
        exposed = f"{sum(waits) / len(waits) * 1e3:.2f} ms" if waits else "n/a"
        log.info(
            "step %d/%d | loss %.4f | %.0f samples/s | step %.1f ms | comm %.2f ms (exposed %s)",
            rec.step,
            self.steps,
            sum(r.loss for r in w) / n,
            sum(r.samples for r in w) / seconds if seconds > 0 else 0.0,
            seconds / n * 1e3,
            sum(r.comm_seconds for r in w) / n * 1e3,
            exposed,
        )
        self.window = []
        return True

    def summary(self) -> None:
        if not self.all:
            return
        times = [r.seconds for r in self.all]
        log.info(
            "summary: steps=%d loss_first=%.4f loss_last=%.4f median_step_ms=%.3f mean_step_ms=%.3f",
            len(times),
            self.all[0].loss,
            self.all[-1].loss,
            statistics.median(times) * 1e3,
            statistics.fmean(times) * 1e3,
        )


class StepControl:
    """The one control all-reduce per step: did any rank see a non-finite loss, and was any rank told to stop?

    Called by ``accumulation_step`` before the optimizer step (as its ``agree_nonfinite``), so a NaN stops every rank
    before the parameters change, and every rank leaves the loop at the same step when one was signalled: the others
    would otherwise wait forever in the next collective.
    """

    def __init__(self, ctx: DistContext, stop):
        self.ctx, self.stop_signal = ctx, stop
        self.stop = False
        self.bad_rank = -1

    def __call__(self, nonfinite_here: bool) -> bool:
        flags = torch.tensor(
            [int(self.stop_signal.requested), self.ctx.rank + 1 if nonfinite_here else 0],
            dtype=torch.int32,  # int32: NCCL and gloo both reduce it
            device=self.ctx.device,
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, bad = flags.tolist()
        self.stop, self.bad_rank = bool(stop), bad - 1
        return self.bad_rank >= 0


class Trainer:
    """One rank's training run: the model, its optimizer, its share of the data, and the components above."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, world: WorldEnv, grad_accum_steps: int, stop, metrics):
        self.cfg, self.ctx, self.stop, self.metrics = cfg, ctx, stop, metrics
        self.global_batch = cfg.global_batch(ctx.world_size, grad_accum_steps)
        torch.manual_seed(cfg.seed)  # identical parameters on every rank, before any wrapper broadcasts them
        dtype = getattr(torch, cfg.dtype)
        self.model = MODELS[cfg.model]().to(ctx.device, dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        dataset = build_dataset(cfg.model, cfg.dataset_size, cfg.seed, cfg.seq_len)
        self.batches = GlobalBatches(
            dataset, self.global_batch, cfg.micro_batch, ctx.rank, ctx.world_size, cfg.seed, ctx.device, dtype
        )
        self.loss_fn = loss_function(cfg.model)
        self.checkpointer = self.build_checkpointer(self.model, self.optimizer)
        torch.manual_seed(cfg.seed + ctx.rank)  # per-rank randomness (dropout, ...) differs between ranks
        self.resumed = self.checkpointer.resume()
        self.step = self.resumed.step if self.resumed else 0
        self._observe_start(world)
        self.wrapped = wrap_model(self.model, cfg.wrapper, bucket_cap_mb=cfg.bucket_cap_mb)
        self.probe = comm_probe(self.wrapped)
        self.control = StepControl(ctx, stop)
        self.progress = ProgressLog(cfg.steps, cfg.log_every, self.step + 1)
        self.synchronize = synchronize_for(ctx.device)

    def build_checkpointer(self, model, optimizer) -> Checkpointer:
        """The run's checkpointer over ``model`` and ``optimizer`` (or objects with their state_dict interface)."""
        cfg = self.cfg
        return Checkpointer(
            cfg.checkpoint_dir,
            every=cfg.checkpoint_every,
            keep=cfg.keep_checkpoints,
            ctx=self.ctx,
            model=model,
            optimizer=optimizer,
            batches=self.batches,
            model_name=cfg.model,
            seed=cfg.seed,
            lr=cfg.lr,
            global_batch=self.global_batch,
        )

    def run(self) -> int:
        """Train up to ``steps``; 0 when finished or stopped on request, 1 when stopped for a peer."""
        cfg = self.cfg
        self._announce()
        while self.step < cfg.steps:
            record = self.train_step(self.step + 1)
            self.step = record.step
            if self.progress.record(record):
                self.checkpointer.note_progress(self.step)
            if self.checkpointer.should_save(self.step, final=self.step == cfg.steps or self.control.stop):
                self.save()
            if self.control.stop and self.step < cfg.steps:  # a signal during the last step: complete anyway
                return self._stopped()
        self._barrier()  # nobody reports FINISHED before rank 0's final checkpoint is on disk
        self.progress.summary()
        self._finished()
        return 0

    def train_step(self, step: int) -> StepRecord:
        """One optimizer step with its measurements; raises TrainingDiverged on a NaN/inf loss on any rank."""
        loss_fn = self.loss_fn
        if step == self.cfg.inject_nan_at_step and self.ctx.rank == self.ctx.world_size - 1:
            loss_fn = lambda out, y: self.loss_fn(out, y) * float("nan")  # noqa: E731 - the failure drill
        t0 = time.perf_counter()
        try:
            result: StepResult = accumulation_step(
                self.wrapped,
                self.optimizer,
                self.batches.next_micro_batches(),
                loss_fn,
                synchronize=self.synchronize,
                grad_scale=self.batches.grad_scale,
                agree_nonfinite=self.control,
            )
        except NonFiniteLossError:  # raised on every rank together, before any optimizer step
            raise TrainingDiverged(
                f"loss became NaN/inf at step {step} on rank {self.control.bad_rank}; every rank stopped "
                f"before the optimizer step. {self.checkpointer.last_good()} Lower lr or check the data"
            ) from None
        seconds = time.perf_counter() - t0
        comm = self.probe.take()
        self.metrics.observe_step(
            step_seconds=seconds,
            forward_seconds=result.forward_seconds,
            backward_seconds=result.backward_seconds,
            optimizer_seconds=result.optimizer_seconds,
            comm=comm,
            samples=result.samples,
            syncs=result.syncs,
            loss=result.loss,
            lr=self.cfg.lr,
        )
        self.metrics.observe_progress(step, self.cfg.steps)
        if self.resumed and self.resumed.wall_time and not self.progress.all:
            self.metrics.observe_reformation(time.time() - self.resumed.wall_time)
        return StepRecord(step, seconds, comm.seconds, comm.wait_seconds, result.loss, self.global_batch)

    def save(self) -> None:
        written = self.checkpointer.save(self.step)
        self.metrics.observe_checkpoint(self.step, written[1] if written else None)
        if written:
            log.info("checkpoint %s written in %.0f ms", written[0], written[1] * 1e3)

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
        self.metrics.observe_progress(self.step, self.cfg.steps)  # before the first step: where a resumed job is
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
        if r.global_batch is not None and r.global_batch != self.global_batch:
            log.warning(
                "the global batch changes from %d to %d samples per step with this world of %d; "
                "set effective_batch=%d to keep it at any world size",
                r.global_batch,
                self.global_batch,
                self.ctx.world_size,
                r.global_batch,
            )

    def _announce(self) -> None:
        cfg, ctx, b = self.cfg, self.ctx, self.batches
        if self.step >= cfg.steps:
            log.warning("checkpoint step %d >= steps=%d: nothing to train", self.step, cfg.steps)
        if len(b.sizes) * b.micro_batch * ctx.world_size == self.global_batch and len(set(b.sizes)) == 1:
            how = f"micro_batch {cfg.micro_batch} × grad_accum_steps {len(b.sizes)} × world_size {ctx.world_size}"
        else:
            how = (
                f"global batch split over world_size {ctx.world_size} "
                f"({self.global_batch // ctx.world_size}-{-(-self.global_batch // ctx.world_size)} per rank), "
                f"grad_accum_steps {len(b.sizes)} of micro_batch <= {cfg.micro_batch}"
            )
        log.info(
            "training %s from step %d to %d: %s = %d samples per step",
            cfg.model,
            self.step,
            cfg.steps,
            how,
            self.global_batch,
        )

    def _finished(self) -> None:
        # One write call for the whole line: torchrun runs workers unbuffered (-u), and print() would write the
        # text and the newline separately, letting two ranks' lines interleave on a shared stdout.
        sys.stdout.write(
            f"FINISHED rank={self.ctx.rank} world_size={self.ctx.world_size} step={self.step} "
            f"checksum={parameter_checksum(self.model)[:16]}\n"
        )
        sys.stdout.flush()

    def _barrier(self) -> None:
        dist.all_reduce(torch.zeros(1, device=self.ctx.device))

    def _stopped(self) -> int:
        self._barrier()
        where = f"checkpoint at step {self.step}" if self.cfg.checkpoint_dir else "no checkpoint_dir: progress lost"
        # A rank not signalled itself may just be a few ms behind its own signal (compose stops all containers).
        if self.stop.requested or self.stop.event.wait(PEER_STOP_GRACE_SECONDS):
            log.warning("%s: stopped at step %d (%s); exit 0", self.stop.name, self.step, where)
            return 0
        # 75 (EX_TEMPFAIL), not 1: a Kubernetes Job ignores it (k8s/base/job.yaml's podFailurePolicy), so only the
        # stopped pod's own end is judged; an elastic torchrun re-forms the group on any non-zero exit.
        log.warning("a peer was signalled: stopped at step %d (%s); exit 75 so the group re-forms", self.step, where)
        return 75
