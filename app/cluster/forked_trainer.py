"""The trainer forked from its launcher, not started as a new interpreter: ``import torch`` once per container.

torchrun starts ``-m app.train`` as a new ``python -u -m app.train ...``, which imports torch a second time (its
agent has it already): seconds of CPU at every start and at every re-formed world ("trainer: torch import" in
bench/results/startup.json). ``fork_trainers(args)`` makes torch's agent fork its trainers instead, with torchrun's
own machinery for a Python function: ``--start-method=fork``, and the entrypoint of ``--run-path`` pointed at
``run_trainer``. A forked trainer is given what a new one was: the agent's environment plus its RANK, WORLD_SIZE, ...;
the trainer's arguments; default signal handlers until app.train installs its own; line-buffered output, as ``-u``;
and its exit code reaches the launchers as before (``app.cluster.elastic.exit_codes``).

Only ``-m app.train``, and only with a build of torch without CUDA or ROCm: a process that has touched a GPU cannot
be forked (counting the devices does), and another script may end its process in ways the agent's hand-over of the
return value cannot follow. Everything else, and ``LAUNCH_FORK=0``, starts a new interpreter, as torchrun.
A forked trainer is its launcher's child process, named ``app.train`` (ps, pgrep), with its launcher's command line.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from app import torch_patches
from app.worker.control import stop_requested

TRAINER = "app.train"


def runs_the_trainer(args) -> bool:
    """Whether torchrun's arguments start this project's trainer, ``-m app.train``."""
    return bool(args.module) and args.training_script == TRAINER


def fork_trainers(args, fork: bool = True) -> bool:
    """Have torchrun's ``run(args)`` fork ``-m app.train`` from this process (see the module's docstring); whether
    it will. ``fork``: the launcher's ``LAUNCH_FORK`` (app.worker.config.launch)."""
    if not fork or args.no_python or args.run_path:
        return False
    if not runs_the_trainer(args):
        return False
    if not forkable_torch():
        return False
    # With --run-path, torchrun's entrypoint is run_script_path(training_script, *its arguments), in the worker.
    torch_patches.set_run_script_path(run_trainer)
    args.run_path, args.start_method = True, "fork"
    return True


def forkable_torch() -> bool:
    """A build of torch without CUDA or ROCm: a process that touched a GPU cannot be forked (counting the devices
    does), so a GPU build starts each trainer as a new interpreter."""
    import torch

    return torch.version.cuda is None and torch.version.hip is None


def run_trainer(module: str, *argv: str) -> None:
    """``python -u -m app.train ARGV``, in this process forked from the agent. Returns for exit code 0 (the agent
    waits for the return value of every trainer); any other code ends the process with it."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)  # the agent's handlers, inherited, would raise its SignalException here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    # The agent's loggers went through the launcher's handler (app.cluster.launch); the trainer sets up its own.
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.handlers, elastic.propagate = [], True
    import torch

    torch_patches.set_thread_name(TRAINER)  # ps/top/pgrep name it app.train, not the agent's pt_elastic
    # A new interpreter's OpenMP reads OMP_NUM_THREADS when it loads; torchrun may have set it after this process's
    # parent loaded its own (one thread per rank where several share the machine).
    if (threads := os.environ.get("OMP_NUM_THREADS", "").strip()).isdigit():  # (not a nested list: "4,2")
        torch.set_num_threads(max(1, int(threads)))
    sys.argv = [module, *argv]
    from app import train

    code = train.main(list(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)  # as app.train leaves: no teardown of torch's module graph
    # Exit 0. Finished, the agent takes the return value, then lets this process end; stopped by the agent (a stop on
    # request, a world re-forming), it waits for the process to end and reads no value: end at once then.
    threading.Thread(target=_exit_once_stopped, name="stopped-by-the-agent", daemon=True).start()


def _exit_once_stopped() -> None:
    stop_requested.wait()
    os._exit(0)
