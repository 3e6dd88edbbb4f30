"""What the run tells a person: rank 0's progress lines and the summary, from one ``StepRecord`` per step.

Names, one per concept (used the same way throughout the worker):

- ``StepResult`` (app.parallel.accum) and ``PipelineStepResult`` (app.parallel.pipeline.stages): what one step's
  computation returned at the parallel layer;
- ``StepOutcome`` (app.worker.steps.base): what a step kind's ``train_step`` measured on this rank;
- ``StepRecord`` (here): a finished step as the progress log keeps it: its index, wall time, loss, samples;
- ``step_index``: the number of the optimizer step (1-based once trained; ``Trainer.step_index``).

Example::

    progress = ProgressLog(steps=200, log_every=10, first_step=1)
    progress.record(StepRecord(step_index=1, seconds=0.01, comm_seconds=0.002, exposed_seconds=0.001, loss=2.08,
                               samples=128))
    progress.summary()
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

log = logging.getLogger("app.train")


@dataclass
class StepRecord:
    """What one finished step reports to the progress log."""

    step_index: int
    seconds: float  # wall time of the step on this rank
    comm_seconds: float  # communication time inside it (all-reduce, or a pipeline's send/recv wait)
    exposed_seconds: float | None  # communication the end of backward waited for (None: not measurable)
    loss: float  # this rank's mean loss
    samples: int  # samples of the step over all ranks (the global batch)


class ProgressLog:
    """Rank 0's progress line every ``log_every`` steps (and the first and last), averaging the steps since the last
    line; the run's summary at the end."""

    def __init__(self, steps: int, log_every: int, first_step: int):
        self.steps, self.log_every, self.first_step = steps, log_every, first_step
        self.window: list[StepRecord] = []
        self.all: list[StepRecord] = []

    def record(self, rec: StepRecord) -> bool:
        """Add one step; True when it closed a window (a progress line was logged)."""
        self.window.append(rec)
        self.all.append(rec)
        i = rec.step_index
        if not (i == self.first_step or i % self.log_every == 0 or i == self.steps):
            return False
        w, n = self.window, len(self.window)
        seconds = sum(r.seconds for r in w)
        waits = [r.exposed_seconds for r in w if r.exposed_seconds is not None]  # None under PyTorch's DDP
        exposed = f"{sum(waits) / len(waits) * 1e3:.2f} ms" if waits else "n/a"
        log.info(
            "step %d/%d | loss %.4f | %.0f samples/s | step %.1f ms | comm %.2f ms (exposed %s)",
            i,
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
