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
