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
