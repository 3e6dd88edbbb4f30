"""``parallel=dp`` (``DataParallelStep``) and ``bench.dp_vs_ddp``: nn.DataParallel vs DDP on the same GPUs.

The step kind runs anywhere: without a GPU ``nn.DataParallel`` calls the module itself, so on the CPU it must train
exactly like the bare model, and (unlike the trainer it replaced) leave no DDP gradient hooks on the parameters.
The benchmark without 2 GPUs must refuse in one line (exit 2); with them it must measure both and show GPU 0 holding
more under DataParallel."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from app.world import run_world
from tests.trainer_run import run_module

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _train_three_steps(rank: int, world: int, parallel: str, wrapper: str) -> dict:
    from app.worker.config import TrainConfig
    from app.worker.dist import DistContext
    from app.worker.steps import build_step

    cfg = TrainConfig(parallel=parallel, wrapper=wrapper, device="cpu", dataset_size=256, micro_batch=16)
    ctx = DistContext(rank, rank, world, torch.device("cpu"), "gloo")
    step = build_step(cfg, ctx, grad_accum_steps=2, metrics=None)
    losses = [step.train_step(step.batches.next_micro_batches(), lambda bad: bad).loss for _ in range(3)]
    hooked = [n for n, p in step.model.named_parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]
    return {"losses": losses, "params": step.model_state.state_dict(), "hooked": hooked}


def test_data_parallel_step_trains_like_the_bare_model_with_no_ddp_hooks_left():
    # A world of one on the CPU: the DDP wrapper a dp run must not build would still register its hooks here.
    (dp,) = run_world(_train_three_steps, 1, "dp", "ours")
    (bare,) = run_world(_train_three_steps, 1, "ddp", "none")
    assert dp["hooked"] == [], f"parameters with gradient hooks under parallel=dp: {dp['hooked']}"
    assert dp["losses"] == bare["losses"]
    assert dp["losses"][-1] < dp["losses"][0]
    assert sorted(dp["params"]) == sorted(bare["params"])  # the bare model's keys: no "module." prefix
    for name, tensor in dp["params"].items():
        assert torch.equal(tensor, bare["params"][name]), name


def run_bench(*args: str) -> subprocess.CompletedProcess:
    """``python -m bench.dp_vs_ddp ARGS``, forked from the test template (torch imported there, CUDA not touched)."""
    return run_module("bench.dp_vs_ddp", *args, timeout=600, env=dict(os.environ))


@pytest.mark.skipif(GPUS >= 2, reason="this machine has 2+ GPUs: the refusal path does not apply")
def test_refuses_in_one_line_without_two_gpus():
    result = run_bench()
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"bench.dp_vs_ddp: error: needs >= 2 CUDA GPUs, found {GPUS}: DataParallel splits one process's batch over "
        f"GPUs (not run here); run with --help for the flags"
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
