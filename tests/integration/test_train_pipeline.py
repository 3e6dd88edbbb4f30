"""The worker's ``--parallel pipeline``: a 2-stage pipeline on real ranks trains the same model as one process.

What is proven: with one replica the pipeline reads the same global batch per step as a single-process
``--wrapper none`` run (the replica is the sampler's rank), its micro-batch losses average to the batch loss, and
AdamW is element-wise, so the merged whole-model parameters after N steps equal the single process's up to float
summation order (measured: max |diff| 4.5e-8 after 30 steps, parameters ~0.24; the tolerance is 1e-6). A resume
from the pipeline's checkpoint continues that same trajectory, under the 1F1B schedule.
"""

from __future__ import annotations

import signal
import subprocess

import pytest
import torch

from app.worker.checkpoint.files import list_checkpoints, load_checkpoint
from app.worker.models import MiniMLP
from tests.trainer_run import (
    describe,
    finish,
    finished,
    free_port,
    kill,
    run_process,
    run_ranks,
    start_ranks,
    wait_for_log,
    worker_args,
)

ATOL = 1e-6  # merged pipeline vs single process, max |diff| per parameter (measured 4.5e-8 after 30 steps)


def _model(directory, step: int) -> dict:
    return torch.load(directory / f"step-{step:08d}.pt", map_location="cpu", weights_only=True)["model"]


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _train_alone(tmp_path, steps: int):
    ckpt = tmp_path / "alone"
    result = run_process(*worker_args("pipeline_reference", steps=steps, checkpoint_dir=ckpt), timeout=300)
    assert result.returncode == 0, describe(result)
    return ckpt


def test_pipeline_equals_one_process_and_resumes(tmp_path):
    ckpt = tmp_path / "pipeline"
    first = run_ranks(*worker_args("pipeline", steps=20, checkpoint_dir=ckpt))
    assert first.returncode == 0, describe(first)
    done = finished(first.stdout)
    assert sorted(done) == [0, 1] and {d["step"] for d in done.values()} == {"20"}, describe(first)
    # Every rank prints the merged whole model's checksum.
    assert done[0]["checksum"] == done[1]["checksum"], describe(first)
    assert "2 stages x 1 replicas, gpipe schedule, 4 micro-batches of 8 samples" in first.stderr, describe(first)

    alone = _train_alone(tmp_path, 30)
    assert _max_diff(_model(ckpt, 20), _model(alone, 20)) < ATOL
    model = MiniMLP()
    model.load_state_dict(_model(ckpt, 20))  # the merged checkpoint loads into the bare model

    resumed = run_ranks(*worker_args("pipeline", pipeline_schedule="1f1b", steps=30, checkpoint_dir=ckpt))
    assert resumed.returncode == 0, describe(resumed)
    assert "resumed from" in resumed.stderr and "(step 20," in resumed.stderr, describe(resumed)
    assert {d["step"] for d in finished(resumed.stdout).values()} == {"30"}, describe(resumed)
    assert _max_diff(_model(ckpt, 30), _model(alone, 30)) < ATOL
    assert _loss(resumed.stderr, "loss_last") < _loss(first.stderr, "loss_first") - 0.1, describe(resumed)

    # ... and a data-parallel run refuses the pipeline's checkpoints in one line.
    ddp = run_process(*worker_args("pipeline_reference", steps=40, checkpoint_dir=ckpt), timeout=300)
    assert ddp.returncode == 2 and "2-stage pipeline's checkpoints" in ddp.stderr, describe(ddp)


def _loss(stderr: str, key: str) -> float:
    line = next(line for line in stderr.splitlines() if "summary:" in line)
    return float(line.split(f"{key}=")[1].split()[0])


# The worker's pipeline under fp16 (a ShardedGradScaler) vs one process under the same recipe: autocast rounds the
# micro-batches otherwise than the whole batch, and AdamW turns that into parameter differences (measured: max |diff|
# 2.1e-3 after 10 steps).
AUTOCAST_ATOL = 5e-3
RECIPE = {"autocast": "fp16", "grad_clip_norm": 0.5, "lr_schedule": "cosine", "warmup_steps": 3}


def test_the_pipeline_under_fp16_with_the_recipe_equals_one_process(tmp_path):
    ckpt, alone = tmp_path / "pipeline", tmp_path / "alone"
    first = run_ranks(*worker_args("pipeline", steps=10, checkpoint_dir=ckpt, **RECIPE))
    assert first.returncode == 0, describe(first)
    reference = run_process(*worker_args("pipeline_reference", steps=10, checkpoint_dir=alone, **RECIPE), timeout=300)
    assert reference.returncode == 0, describe(reference)
    assert _max_diff(_model(ckpt, 10), _model(alone, 10)) < AUTOCAST_ATOL
    saved = torch.load(ckpt / "step-00000010.pt", map_location="cpu", weights_only=True)
    assert saved["grad_scaler"]["scale"] == 2.0**16  # one scale, no step skipped: every stage saw finite gradients


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--parallel", "pipeline"), "a pipeline needs >= 2 stages"),
        (("--parallel", "pipeline", "--pipeline-stages", "4"), "pipeline_stages=4: mini_mlp has 3 layers"),
        (("--parallel", "pipeline", "--pipeline-microbatches", "5"), "pipeline_microbatches=5 does not divide"),
        (("--parallel", "pipeline", "--model", "tiny_transformer"), "model=tiny_transformer cannot be cut"),
        (("--parallel", "dp"), "parallel=dp needs CUDA with >= 2 GPUs"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, says):
    if "dp" in args and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has >= 2 GPUs: parallel=dp is valid here")
    result = run_process(*args, "--metrics-port", "0", timeout=300)
    assert result.returncode == 2, describe(result)
    assert says in result.stderr and result.stderr.strip().count("\n") == 0, describe(result)


def test_a_checkpoint_of_another_layout_is_refused(tmp_path):
    alone = _train_alone(tmp_path, 10)  # a parallel=ddp checkpoint (one process)
    procs = start_ranks(*worker_args("pipeline", steps=20, checkpoint_dir=alone))
    outputs = finish(procs, timeout=300)
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 2, describe(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        errors = [line for line in err.splitlines() if "config error" in line]
        assert len(errors) == 1 and "written by parallel=ddp" in errors[0], err


def test_two_replicas_of_a_two_stage_pipeline_equal_one_process(tmp_path):
    """Data x pipeline in the worker: 4 ranks, each stage's gradients averaged over its 2 replicas by our DDP wrapper
    over a sub-group; each replica trains on half of the same 32-sample global batch (measured max |diff| 4.5e-8)."""
    ckpt = tmp_path / "pp2x2"
    result = run_ranks(
        *worker_args("pipeline", pipeline_stages=2, steps=10, checkpoint_dir=ckpt, micro_batch=16), world_size=4
    )
    assert result.returncode == 0, describe(result)
    assert "2 stages x 2 replicas" in result.stderr, describe(result)
    assert len({d["checksum"] for d in finished(result.stdout).values()}) == 1, describe(result)
    assert _max_diff(_model(ckpt, 10), _model(_train_alone(tmp_path, 10), 10)) < ATOL


def test_a_pipeline_without_replicas_serves_its_metrics_and_counts_no_gradient_sync(tmp_path):
    """With metrics on, each stage of a pure pipeline (no data-parallel replicas: nothing all-reduces its gradients)
    trains to the end and reports its steps and its bubble, and ``ddp_gradient_syncs_total`` stays 0 (a negative
    count would stop the run: a counter only goes up)."""
    from tests.integration.test_metrics import scrape_at_the_end

    scraped, err = scrape_at_the_end(free_port(2), parallel="pipeline", micro_batch=32, steps=3, log_every=3)
    assert "2 stages x 1 replicas" in err, err
    for rank, values in enumerate(scraped):
        assert values[f'ddp_pipeline_stage{{rank="{rank}"}}'] == rank, values
        assert values[f'ddp_optimizer_steps_total{{rank="{rank}"}}'] == 3, values
        assert values[f'ddp_gradient_syncs_total{{rank="{rank}"}}'] == 0, values
        # Each stage waits on the other for part of every step: its bubble is a share of the step, neither 0 nor 1.
        assert 0 < values[f'ddp_pipeline_bubble_ratio{{rank="{rank}"}}'] < 1, values


def test_sigterm_stops_every_stage_at_one_step_with_a_checkpoint(tmp_path):
    procs = start_ranks(*worker_args("until_stopped", parallel="pipeline", checkpoint_dir=tmp_path))
    try:
        wait_for_log(procs[0], "step 50/")
        for p in procs:
            p.send_signal(signal.SIGTERM)
        outs = finish(procs, timeout=60)
    finally:
        kill(procs)
    assert [p.returncode for p in procs] == [0, 0], outs
    ((step, path),) = list_checkpoints(tmp_path)
    for rank, (_, err) in enumerate(outs):
        assert f"[rank {rank}] WARNING SIGTERM: stopped at step {step} (checkpoint at step {step}); exit 0" in err, err
    MiniMLP().load_state_dict(load_checkpoint(path)["model"])


USER_MODEL = (
    "--data",
    "tests.models_user:ClassificationDataset",
    "--data-kwargs",
    '{"size": 64}',
    "--loss",
    "cross_entropy",
)


@pytest.mark.parametrize(
    ("model", "split", "says"),
    [
        (
            "tests.models_user:StackNet",
            "blocks.7",
            "pipeline_split='blocks.7' with model='tests.models_user:StackNet': "
            "'blocks.7' is not a module of the model's sequence (embed, blocks.0.0, blocks.0.1 .. head.1)",
        ),
        (
            "tests.models_user:flat_mlp",
            "1",
            "pipeline_split='1' with model='tests.models_user:flat_mlp': stage 0 (0) has no parameters; move the cut",
        ),
        (
            "tests.models_user:StackNet",
            "blocks.1,blocks.2",
            "pipeline_split='blocks.1,blocks.2' names 2 cut(s) for 2 stages",
        ),
        (
            "tests.models_user:ResidualNet",
            "",
            "parallel=pipeline with model='tests.models_user:ResidualNet': "
            "ResidualNet's forward is not its children in order (inner, head)",
        ),
    ],
    ids=["no-such-module", "stage-without-parameters", "cut-count", "not-a-sequence"],
)
def test_a_bad_split_of_a_user_model_is_one_line_exit_2_and_writes_nothing(tmp_path, model, split, says):
    """Every rank stops before the rendezvous with the same one line; the checkpoint directory is never made."""
    ckpt = tmp_path / "ckpt"
    args = worker_args("pipeline", micro_batch=8, checkpoint_dir=ckpt, model=model, pipeline_split=split)
    procs = start_ranks(*args, *USER_MODEL)
    for proc, (_, err) in zip(procs, finish(procs, timeout=300)):
        assert proc.returncode == 2 and err.strip().count("\n") == 0 and says in err, (proc.returncode, err)
    assert not ckpt.exists()
