"""The worker's stop on request (app.worker.control.StopSignal), with a real SIGTERM to a real process: what asked to
hear of it hears of it (the metrics' ``ddp_stop_requested``, which tells a stop on request from a crash in the
alerts) before the stop is forced.

    .venv/bin/python -m pytest tests/unit/test_control.py
"""

from __future__ import annotations

import subprocess
import sys

from tests.trainer_run import REPO, clean_env

# A process that installs the stop, asks to hear of it, and sends itself SIGTERM; it prints what it heard.
STOPPED = """
import os, signal, sys, threading
from app.worker.control import StopSignal
stop, heard = StopSignal(), threading.Event()
stop.on_request.append(heard.set)
stop.install()
os.kill(os.getpid(), signal.SIGTERM)
print(stop.event.wait(10), heard.wait(10), stop.name, flush=True)
"""


def test_a_sigterm_is_a_stop_request_that_every_listener_hears():
    env = {**clean_env(), "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", STOPPED], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "SIGTERM"]


def test_the_step_control_carries_the_stop_the_nonfinite_rank_and_a_join_request():
    """The one control all-reduce per step (a real gloo group of one): what a step learns from it. A non-finite loss
    on this rank names it (the highest such rank), a signalled stop and a newcomer's request (rank 0's poll) reach
    every rank; nothing of the kind: no stop, no rank (-1), no join."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from app.worker.control import StepControl, StopSignal

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        stop = StopSignal()
        control = StepControl(SimpleNamespace(rank=0, device=torch.device("cpu")), stop)
        assert (control.stop, control.bad_rank, control.join) == (False, -1, False)  # before any step
        assert control(False) is False
        assert (control.stop, control.bad_rank, control.join) == (False, -1, False)
        assert control(True) is True and control.bad_rank == 0 and not control.stop
        control.poll = lambda: 1
        assert control(False) is False and control.join and control.bad_rank == -1
        control.poll = lambda: 0
        stop.event.set()  # what the signal's thread does
        assert control(False) is False and control.stop and not control.join
    finally:
        dist.destroy_process_group()


def test_the_seconds_left_before_a_forced_exit_count_from_the_signal():
    import time

    from app.worker.control import StopSignal

    stop = StopSignal()
    assert stop.timeout_s == 10.0 and stop.seconds_left() == float("inf") and not stop.requested
    stop.timeout_s, stop.at = 30.0, time.monotonic() - 12.0
    stop.event.set()
    assert stop.requested and 17.0 < stop.seconds_left() <= 18.0


# A stop that cannot finish: the signal comes twice (Ctrl-C reaches the worker from the terminal and from torchrun),
# the loop never gets to stop; the process must still end, in one line, once stop_timeout_seconds have passed.
STUCK = """
import os, signal, sys, threading, time
from app.worker.control import StopSignal
stop, heard = StopSignal(), []
stop.timeout_s = 0.5
stop.on_request.append(lambda: heard.append(1) or print("heard", flush=True))
stop.install()
os.kill(os.getpid(), signal.SIGINT)
while not heard:
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGTERM)  # the second, once the first was heard
time.sleep(60)
"""


def test_a_stop_that_cannot_finish_is_forced_in_one_line_with_exit_1_and_a_second_signal_changes_nothing():
    env = {**clean_env(), "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", STUCK], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert result.stdout.split() == ["heard"]  # once, though the signal came twice
    assert result.stderr.strip().splitlines() == [
        "SIGINT: graceful stop did not finish within stop_timeout_seconds=0.5; exiting without a checkpoint"
    ]
