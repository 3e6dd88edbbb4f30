"""app.cluster.forked_trainer.run_trainer: what a trainer forked from its launcher is given that a new interpreter
would have had (default signal handlers, line-buffered output, its own logging, OMP_NUM_THREADS, its arguments) and
how its exit code reaches the agent. In a process of its own standing in for the forked child, with the agent's state
set up first; ``app.train.main`` reports what it was given instead of training (the real one: tests/integration)."""

from __future__ import annotations

import subprocess
import sys

from tests.trainer_run import REPO, clean_env

CHILD = """
import logging, os, signal, sys, threading
# What the launcher's agent leaves in the process it forks: its own handlers, a routed logger, block buffering.
signal.signal(signal.SIGTERM, lambda *_: print("the agent's handler", flush=True))
signal.signal(signal.SIGINT, signal.SIG_IGN)
elastic = logging.getLogger("torch.distributed.elastic")
elastic.handlers, elastic.propagate = [logging.NullHandler()], False

from app import train
from app.cluster.forked_trainer import run_trainer
from app.worker.control import stop_requested

def main(argv):
    import torch
    print("argv", sys.argv, argv)
    print("signals", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
          signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    print("buffering", sys.stdout.line_buffering, sys.stderr.line_buffering)
    print("logging", elastic.handlers, elastic.propagate)
    print("threads", torch.get_num_threads())
    return int(sys.argv[-1])

train.main = main
run_trainer("app.train", "--steps", "3", sys.argv[1])
print("returned", flush=True)
stop_requested.set()  # the agent stops it: the process ends 0 at once
threading.Event().wait(60)
"""


def run_child(code: str) -> subprocess.CompletedProcess:
    env = {**clean_env(), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "3"}
    return subprocess.run(
        [sys.executable, "-c", CHILD, code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_forked_trainer_is_given_what_a_new_interpreter_has_and_its_exit_code_is_the_processs():
    failed = run_child("7")
    assert failed.returncode == 7, failed.stderr
    lines = failed.stdout.splitlines()
    assert lines == [
        "argv ['app.train', '--steps', '3', '7'] ['--steps', '3', '7']",
        "signals True True",
        "buffering True True",
        "logging [] True",
        "threads 3",
    ], failed.stderr
    finished = run_child("0")
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.splitlines()[-1] == "returned"  # code 0: returned to the agent, ended once stopped
