"""`make demo` as a user runs it: torchrun's launcher, real ranks, a step table and a PASS verdict."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer_run import run_module

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def run_demo(*args: str, workers: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(TORCHRUN), "--standalone", f"--nproc-per-node={workers}", "-m", "app.demos.demo", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.parametrize("wrapper", ["ours", "torch"])
def test_demo_passes_step_by_step(wrapper):
    result = run_demo("--steps", "5", "--bucket-cap-mb", "0.01", "--wrapper", wrapper)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if re.match(r"\s+\d+\s+\d", line)]
    assert len(rows) == 5
    assert all(line.split()[5] == "yes" for line in rows)  # every rank's parameters hash the same, every step
    verdict = result.stdout.strip().splitlines()[-1]
    assert verdict.startswith("PASS: 2 ranks equal the single-process reference for 5 steps")


def test_demo_rejects_bad_steps_with_exit_code_2():
    # Refused before any rank starts: no torchrun needed, and forked from the test template (no torch import).
    result = run_module("app.demos.demo", "--steps", "0", timeout=60, env=dict(os.environ))
    assert result.returncode == 2
    assert "--steps must be >= 1" in result.stderr
    assert "Traceback" not in result.stderr
