"""Stopping a run: the signal that asks for a stop, and the one per-step all-reduce that makes every rank agree.

- ``StopSignal``: SIGTERM/SIGINT → a flag the loop reads at step boundaries (and a forced exit if the graceful stop
  cannot finish within ``stop_timeout_seconds``). Torch-free: ``app.train.main`` installs it before importing torch.
- ``StepControl``: the one control all-reduce per step, carrying both the NaN/inf flag and the stop request, so a NaN
  stops every rank before the optimizer step and every rank leaves the loop at the same step.

Both are used by ``app.worker.trainer.Trainer``; see ``app.train`` for the exit codes a stop ends with.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from app.exit_codes import FAILED

# Process-wide: set once any StopSignal of this process has had its signal. A trainer forked by its launcher
# (app.cluster.forked_trainer) reads it to leave at once when its agent is the one stopping it.
stop_requested = threading.Event()


class StopSignal:
    """SIGTERM/SIGINT → a flag that the training loop reads at step boundaries.

    A Python signal handler runs only in the main thread between bytecodes, never while it is blocked inside a gloo
    collective: so the signals are blocked in every thread and one thread waits for them with ``sigwait``.
    """

    SIGNALS = {signal.SIGTERM, signal.SIGINT}

    def __init__(self) -> None:
        self.event = threading.Event()
        self.name = ""
        self.timeout_s = 10.0
        self.at = 0.0  # time.monotonic() of the signal
        self.on_request: list = []  # called (in the signal's thread) when the signal comes, before the stop

    def install(self) -> None:
        # Must run before any other thread starts: threads inherit the mask, and one with the signal unblocked would
        # take the default action (terminate) without a checkpoint.
        signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        threading.Thread(target=self._wait, name="stop-signal", daemon=True).start()

    def _wait(self) -> None:
        while True:
            signum = signal.sigwait(self.SIGNALS)
            if self.event.is_set():
                continue  # Ctrl-C reaches the worker twice (terminal + torchrun): only the timer forces an exit
            self.name = signal.Signals(signum).name
            self.at = time.monotonic()
            self.event.set()
            stop_requested.set()
            for callback in self.on_request:
                callback()
            threading.Thread(target=self._force_exit, name="stop-timeout", daemon=True).start()

    def _force_exit(self) -> None:
        time.sleep(self.timeout_s)
        print(
            f"{self.name}: graceful stop did not finish within stop_timeout_seconds={self.timeout_s:g}; "
            f"exiting without a checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(FAILED)

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def seconds_left(self) -> float:
        """Seconds until the forced exit (``timeout_s`` after the signal); inf before any signal."""
        return self.timeout_s - (time.monotonic() - self.at) if self.requested else float("inf")


class StepControl:
    """The one control all-reduce per step: did any rank see a non-finite loss, and was any rank told to stop?

    A step kind (app.worker.steps) calls it before the optimizer step (``accumulation_step``'s ``agree_nonfinite``),
    so a NaN stops every rank before the parameters change, and every rank leaves the loop at the same step when one
    was signalled: the others would otherwise wait forever in the next collective.

    Attributes (after a call): ``stop``, whether any rank was signalled; ``bad_rank``, the highest rank that saw a
    non-finite loss (-1: none); ``join``, whether a rank's ``poll()`` said a newcomer asks in (heal=in_place: rank 0
    asks the store, app.worker.heal), so every rank takes it in after the same step.
    """

    def __init__(self, ctx, stop: StopSignal):
        self.ctx, self.stop_signal = ctx, stop
        self.stop = self.join = False
        self.bad_rank = -1
        self.poll = lambda: 0

    def __call__(self, nonfinite_here: bool) -> bool:
        # Imported here, not at the top: this module must load before torch (see the module docstring).
        import torch
        import torch.distributed as dist

        from app.diagnostics import collectives as recorded

        flags = torch.tensor(
            [int(self.stop_signal.requested), self.ctx.rank + 1 if nonfinite_here else 0, self.poll()],
            dtype=torch.int32,  # int32: NCCL and gloo both reduce it
            device=self.ctx.device,
        )
        recorded.all_reduce(flags, "step control (stop, NaN)", op=dist.ReduceOp.MAX)
        stop, bad, join = flags.tolist()
        self.stop, self.bad_rank, self.join = bool(stop), bad - 1, bool(join)
        return self.bad_rank >= 0
