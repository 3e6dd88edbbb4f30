"""One rank of ``bench.memory_bench``: ``app.train``'s ``main()``, with this process's memory recorded by phase.

    MEMORY_BENCH_OUT=/tmp/m torchrun --standalone --nproc-per-node=2 -m bench.memory_rank --parallel zero3 ...

The flags are the worker's own (``python -m app.train --help``). What is measured is this process, the trainer
rank torchrun starts (not torchrun's agent, nor anything it forks): its peak resident set, ``VmHWM`` in
``/proc/self/status`` (the same figure as ``getrusage(RUSAGE_SELF).ru_maxrss``). The worker's own functions are
wrapped, not changed: each wrapped call starts a *phase*, and at every phase boundary the rank reads VmHWM. VmHWM
only rises, so the phase during which it reached its final value is where the peak occurred, exactly, whatever the
sampling misses. A thread also samples VmRSS every ``MEMORY_BENCH_SAMPLE_S`` (0.1 s) for the curve over time.

At exit each rank writes ``$MEMORY_BENCH_OUT/rank-<r>.json``: its peak, the phases with VmHWM and VmRSS at their
ends, and the samples.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path


def status_bytes(key: str) -> int:
    """``VmRSS``/``VmHWM``/... of this process, in bytes (0 where /proc is not there)."""
    from bench.ddp_bench import _proc_status  # the benches' one reader of /proc/self/status

    return _proc_status(key) or 0


class PhaseLog:
    """The phase this rank is in, VmHWM/VmRSS at the end of each, and VmRSS sampled over time."""

    def __init__(self, sample_s: float):
        self.t0 = time.monotonic()
        self.current = "start-up"  # imports, config, before anything the bench wraps
        self.phases: list[dict] = []
        self.samples: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(sample_s,), daemon=True)
        self._thread.start()

    def _sample(self, every: float) -> None:
        while not self._stop.wait(every):
            self.samples.append((round(time.monotonic() - self.t0, 3), status_bytes("VmRSS"), self.current))

    def enter(self, name: str) -> None:
        now = round(time.monotonic() - self.t0, 3)
        self.phases.append(
            {
                "phase": self.current,
                "end_s": now,
                "hwm_bytes": status_bytes("VmHWM"),
                "rss_bytes": status_bytes("VmRSS"),
            }
        )
        self.current = name

    def result(self) -> dict:
        self.enter("exit")
        self._stop.set()
        hwm = status_bytes("VmHWM")
        first = next((p for p in self.phases if p["hwm_bytes"] >= hwm), self.phases[-1])
        return {
            "peak_bytes": hwm,
            "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_phase": first["phase"],
            "phases": self.phases,
            "samples": self.samples,
        }


def _wrap(owner, attr: str, log: PhaseLog, name) -> None:
    """Make ``owner.attr`` start phase ``name(*args)`` (a string or a function of the call's arguments)."""
    fn = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        log.enter(name(*args) if callable(name) else name)
        try:
            return fn(*args, **kwargs)
        finally:
            log.enter("between")

    setattr(owner, attr, wrapped)


def install(log: PhaseLog) -> None:
    """Wrap the worker's phases: the workload check, the model build, resume, each step, the save, the checksum."""
    from app.worker import steps, workload
    from app.worker.checkpoint.checkpointer import Checkpointer
    from app.worker.trainer import Trainer

    _wrap(workload, "check_workload", log, "workload check")  # app.train imports it at call time: the wrapper
    _wrap(steps, "build_step", log, "construction")
    _wrap(Checkpointer, "resume", log, "resume")
    _wrap(Trainer, "run_step", log, lambda _self, i: "first step" if i == _self.first_step else "later steps")
    _wrap(Trainer, "save", log, "checkpoint save")
    _wrap(Trainer, "_finished", log, "end checksum")
    init = Trainer.__init__

    def remember_first(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.first_step = self.step_index + 1

    Trainer.__init__ = remember_first


def main() -> None:
    log = PhaseLog(float(os.environ.get("MEMORY_BENCH_SAMPLE_S", "0.1")))
    from app import train
    from app.worker.dist import exit_process

    install(log)
    code = train.main(sys.argv[1:])
    out = Path(os.environ["MEMORY_BENCH_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "exit_code": code, **log.result()}))
    exit_process(code)


if __name__ == "__main__":
    main()
