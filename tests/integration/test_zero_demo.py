"""`python -m app.demos.zero_demo` as a user runs it: torchrun, real ranks, a step table and a PASS verdict."""

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
    return subprocess.run(
        [str(TORCHRUN), "--standalone", f"--nproc-per-node={workers}", "-m", "app.demos.zero_demo", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_demo_passes_step_by_step(stage):
    result = run_demo("--stage", str(stage), "--steps", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if re.match(r"\s+\d+\s+\d", line)]
    assert len(rows) == 3
    assert all(line.split()[-1] == ("shard" if stage == 3 else "yes") for line in rows)
    verdict = result.stdout.strip().splitlines()[-1]
    assert verdict.startswith(f"PASS: 2 ranks with ZeRO stage {stage} equal the single-process reference for 3 steps")


def test_demo_rejects_bad_flags_with_exit_code_2():
    # Refused before any rank starts: no torchrun needed, and forked from the test template (no torch import).
    result = run_module(
        "app.demos.zero_demo", "--stage", "1", "--compute-dtype", "bf16", timeout=60, env=dict(os.environ)
    )
    assert result.returncode == 2
    assert "--compute-dtype bf16 needs --stage 3" in result.stderr
    assert "Traceback" not in result.stderr
