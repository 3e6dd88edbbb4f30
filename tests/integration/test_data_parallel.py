"""``bench.dp_vs_ddp``: nn.DataParallel vs DDP on the same GPUs. Without 2 GPUs it must refuse in one line (exit 2);
with them it must measure both and show GPU 0 holding more under DataParallel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.dp_vs_ddp", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(GPUS >= 2, reason="this machine has 2+ GPUs: the refusal path does not apply")
def test_refuses_in_one_line_without_two_gpus():
    result = run_bench()
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"bench.dp_vs_ddp: needs >= 2 CUDA GPUs, found {GPUS}: DataParallel splits one process's batch over GPUs "
        f"(not run here)"
    )


@pytest.mark.skipif(GPUS < 2, reason=f"needs >= 2 CUDA GPUs for nn.DataParallel; this machine has {GPUS}")
def test_measures_both_and_gpu0_holds_more_under_data_parallel(tmp_path):
    out = tmp_path / "dp.json"
    result = run_bench("--gpus", "2", "--width", "1024", "--steps", "5", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(out.read_text())
    assert doc["data_parallel"]["step_ms"] > 0 and doc["ddp"]["step_ms"] > 0
    # The gathered output, the loss and the reduced gradients all live on GPU 0 under DataParallel.
    assert doc["data_parallel"]["gpu0_extra_share"] > doc["ddp"]["gpu0_extra_share"]
