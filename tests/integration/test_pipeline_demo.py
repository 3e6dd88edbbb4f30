"""`make pipeline` as a user runs it: real spawned ranks, the equivalence tables and a PASS verdict; bad flags exit 2
with one line."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.trainer_run import run_module


def run_demo(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m app.demos.pipeline_demo ARGS``: its process forked from the test template (torch imported once
    there); the ranks it starts are its own, as ever."""
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return run_module("app.demos.pipeline_demo", *args, timeout=timeout, env=env)


@pytest.mark.timeout(600)  # two worlds of fresh interpreters: minutes on a loaded 2-core machine
def test_demo_passes_step_by_step():
    result = run_demo("--steps", "2", "--batch", "8", "--micro-batches", "2", "--no-bubble", timeout=580)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"on cpu,cpu,cpu \(CPU stand-ins.*max \|dp\| vs one device 0\.00e\+00.*: ok", out)
    assert len(re.findall(r"^gpipe\s+\d", out, re.M)) == 2 and len(re.findall(r"^1f1b\s+\d", out, re.M)) == 2
    assert "DDP all-reduces per rank: [2, 2, 2, 2] for 2 steps" in out
    assert (
        out.strip()
        .splitlines()[-1]
        .startswith("PASS: model parallel equal to one device; GPipe, 1F1B, data x pipeline and tensor")
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch", "30", "--micro-batches", "4"], "--batch 30 does not split into 4 equal micro-batches"),
        (["--micro-batches", "1"], "1F1B on 2 stages needs at least 2"),
        (["--devices", "cpu," * 8 + "cpu"], "9 stages but the model has only 8 layers: use at most 8"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, message):
    result = run_demo(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
