"""Where a trainer's start-up time goes: one line from rank 0 just before its first step.

``app.train`` marks each phase as it ends, and rank 0 logs them once, in the run's own log format::

    12:00:09 [rank 0] INFO start-up: process 0.41 s, torch import 5.12 s, workload check 0.21 s, ... = 7.30 s

``process`` is the time from this process's creation (the launcher's spawn of it) to the first mark: the interpreter's
own start and the torch-free imports. ``bench/startup.py`` reads the line from the containers' logs to break
``docker compose up`` -> first step into phases (docs/cluster.md); nothing else depends on its wording. Torch-free:
the clock starts before the seconds-long ``import torch`` it measures.
"""

from __future__ import annotations

import os
import sys
import time

from app import torch_patches


def process_age_s() -> float | None:
    """Seconds since this process was created (Linux: /proc), or None where that cannot be read."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            # Field 22 is the start time in clock ticks since boot; the fields after the command (in parentheses,
            # which may hold spaces) are split from the last ")".
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupClock:
    """Phase durations, each from the previous mark (the first from the process's creation).

    Example::

        clock = StartupClock()          # "process": the time until now since the process was created
        import torch
        clock.mark("torch import")
        log.info("%s", clock.line())    # start-up: process 0.41 s, torch import 5.12 s = 5.53 s
    """

    def __init__(self):
        age = process_age_s()
        self.phases: list[tuple[str, float]] = [("process", age)] if age is not None else []
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def line(self) -> str:
        parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases)
        return f"start-up: {parts} = {sum(s for _, s in self.phases):.2f} s"


# -- torch._dynamo, deferred ----------------------------------------------------------------------------------------
DEFER_DYNAMO_VARIABLE = "TRAINER_DEFER_DYNAMO"


def defer_dynamo_import(environ=os.environ, compiling: bool = False) -> bool:
    """Put a stand-in in torch._dynamo's place unless ``TRAINER_DEFER_DYNAMO=0``, the run compiles (``compiling``:
    the ``compile`` setting is on) or something has imported the real one already; True when it is in place. The
    import it saves is seconds of CPU per process that trains (the start-up line's ``torch._dynamo import``), paid at
    once by every rank of a world on the same cores. Without torch.compile, what torch.optim calls of torch._dynamo
    are no-ops, which the stand-in is; anything else brings the real one (``app.torch_patches.DeferredDynamo``).
    A run that compiles needs the real one from the start: ``disable`` is a no-op only while nothing compiles, and
    torch.optim's steps must stay out of the graphs the compiled units make."""
    if compiling or environ.get(DEFER_DYNAMO_VARIABLE, "1") == "0" or "torch._dynamo" in sys.modules:
        return False
    torch_patches.defer_dynamo()
    return True
