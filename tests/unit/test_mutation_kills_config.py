"""Config cases that generated mutants showed missing (`make mutants`, tools/mutation_triage.yaml).

.venv/bin/python -m pytest tests/unit/test_mutation_kills_config.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A worker under torchrun reads the elastic range from torchrun's own command line (its parent's), where --nnodes
# may be written as one word (--nnodes=2:4) or two (--nnodes 2:4). The parent here stands in for torchrun.
CHILD = (
    "from app.worker.config import WorldEnv; "
    "w = WorldEnv.from_environ({'TORCHELASTIC_RUN_ID': 'r', 'RANK': '0', 'WORLD_SIZE': '4', 'LOCAL_WORLD_SIZE': '2'}); "
    "print(w.min_world_size, w.max_world_size)"
)
PARENT = "import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', sys.argv[1]]).returncode)"


@pytest.mark.parametrize("flag", [["--nnodes=2:4"], ["--nnodes", "2:4"]], ids=["one-word", "two-words"])
def test_the_elastic_range_is_read_from_torchruns_nnodes_in_either_spelling(flag):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", PARENT, CHILD, *flag], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["4", "8"], "2..4 nodes of 2 ranks each: a world of 4 to 8 ranks"


@pytest.mark.parametrize("microbatches, ok", [(4, True), (8, True), (32, True), (5, False), (3, False)])
def test_pipeline_micro_batches_are_accepted_exactly_when_they_divide_the_micro_batch(microbatches, ok):
    from app.worker.config import ConfigError, TrainConfig

    def make():
        return TrainConfig(parallel="pipeline", micro_batch=32, pipeline_microbatches=microbatches)

    if ok:
        assert make().pipeline_microbatches == microbatches
    else:
        with pytest.raises(ConfigError, match=f"pipeline_microbatches={microbatches} does not divide micro_batch=32"):
            make()


@pytest.mark.parametrize("steps, ok", [(None, True), (1, True), (2, False), (4, False)])
def test_the_pipeline_refuses_gradient_accumulation_of_more_than_one_step(steps, ok):
    """With parallel=pipeline its micro-batches are the accumulation: grad_accum_steps 2 or more is refused."""
    from app.worker.config import ConfigError, TrainConfig

    def make():
        return TrainConfig(parallel="pipeline", micro_batch=32, grad_accum_steps=steps)

    if ok:
        assert make().grad_accum_steps == steps
    else:
        with pytest.raises(ConfigError, match=f"grad_accum_steps={steps}: with parallel=pipeline"):
            make()
