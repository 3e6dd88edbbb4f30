"""``python -m app.check``: real gloo ranks against one process, for good models and for models broken in each of
the five ways it diagnoses (``tests/models_broken.py``); bad input exits 2 with one line before any rank starts.

Most cases call ``main(argv)`` in this process (the ranks are spawned for real either way): it saves a Python start
and a torch import per case on a shared 2-core machine. The first and the bad-input cases run the command itself
(``run_module``: ``python -m app.check`` forked from a template that has imported torch).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.check.cli import main
from tests.trainer_run import run_module

BROKEN = "tests.models_broken"
REPO = Path(__file__).resolve().parents[2]


def run_check(capsys, *args: str) -> tuple[int, str]:
    """``python -m app.check ARGS`` in this process, 3 steps, our DDP unless ``args`` say otherwise (the last wins)."""
    rc = main(["--steps", "3", "--wrapper", "ours", *args])
    return rc, capsys.readouterr().out


def causes(out: str) -> list[str]:
    """The head of each ``likely cause:`` line, e.g. ``randomness in forward``."""
    return [m.group(1) for m in re.finditer(r"^  likely cause: ([^:]+):", out, re.M)]


def table_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+-?\d+\.\d+\s", line)]


def test_a_good_model_passes_with_both_wrappers_and_accumulation():
    result = run_module(
        "app.check", "app.worker.models:MiniMLP", "--accum", "2", "--steps", "3", timeout=600, env=dict(os.environ)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = table_rows(result.stdout)
    assert len(rows) == 6  # 3 steps, ours then PyTorch's
    assert all(row[5] == "yes" and float(row[4]) <= 1e-5 for row in rows)
    assert "PASS (ours)" in result.stdout and "PASS (torch)" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("PASS: 2 ranks (ddp) vs one process, 3 steps")


def test_a_transformer_passes_on_token_input_inferred_from_its_embedding(capsys):
    rc, out = run_check(capsys, "tiny_transformer", "--model-kwargs", '{"layers": 2}', "--wrapper", "torch")
    assert rc == 0, out
    assert "token ids in [0, 64)" in out and "inferred from tok (Embedding)" in out
    assert causes(out) == []


def test_float32_noise_that_adamw_amplifies_is_told_from_a_real_difference(capsys):
    # At a tolerance below the measured float32 one, the transformer's attention projections differ: where their
    # exact gradient is zero, the computed one is rounding noise that AdamW normalises into an update.
    args = ("tiny_transformer", "--model-kwargs", '{"layers": 2}', "--wrapper", "ours")
    rc, out = run_check(capsys, *args, "--tolerance", "1e-5")
    assert rc == 1, out
    assert causes(out) == ["float32 rounding amplified by AdamW"]
    assert "attn.in_proj" in out and "--dtype float64" in out
    rc, out = run_check(capsys, *args, "--dtype", "float64")
    assert rc == 0, out


def test_data_from_a_spec_a_data_set_and_a_loss_class(capsys):
    rc, out = run_check(
        capsys,
        "tests.models_broken:WithDropout",
        "--eval",
        "--data",
        f"{BROKEN}:ClassificationDataset",
        "--loss",
        "torch.nn:CrossEntropyLoss",
        "--loss-kwargs",
        '{"label_smoothing": 0.1}',
    )
    assert rc == 0, out
    assert "ClassificationDataset data set" in out


def test_a_parameter_without_a_gradient_stops_the_ranks_and_is_named(capsys):
    rc, out = run_check(capsys, f"{BROKEN}:UnusedParameter", "--wrapper", "both")
    assert rc == 1, out
    assert "FAIL (ours): the ranks stopped: RuntimeError" in out
    assert "FAIL (torch): the ranks stopped: RuntimeError" in out
    assert causes(out) == ["parameters without a gradient"] * 2
    assert "unused_head.weight" in out and "find_unused_parameters=True" in out


def test_find_unused_parameters_is_the_fix_it_names(capsys):
    rc, out = run_check(
        capsys, f"{BROKEN}:UnusedParameter", "--find-unused-parameters", "--data", f"{BROKEN}:regression_data"
    )
    assert rc == 0, out


def test_batch_norm_buffers_differ_across_ranks(capsys):
    rc, out = run_check(capsys, f"{BROKEN}:WithBatchNorm")
    assert rc == 1, out
    assert "diverge from one process: net.0.bias (step 0)" in out
    assert causes(out) == ["buffers differ across ranks after step 0"]
    assert "BatchNorm1d net.1" in out and "SyncBatchNorm" in out and "broadcast_buffers" in out


def test_dropout_is_randomness_in_forward_and_eval_mode_compares(capsys):
    rc, out = run_check(capsys, f"{BROKEN}:WithDropout")
    assert rc == 1, out
    assert causes(out) == ["randomness in forward"]
    assert "--eval" in out
    rc, out = run_check(capsys, f"{BROKEN}:WithDropout", "--eval")
    assert rc == 0, out


def test_non_deterministic_ops_make_two_single_process_runs_differ(capsys):
    rc, out = run_check(capsys, f"{BROKEN}:NonDeterministic")
    assert rc == 1, out
    assert causes(out) == ["non-deterministic ops"]
    assert "use_deterministic_algorithms(True)" in out


def test_parameters_created_in_forward(capsys):
    rc, out = run_check(capsys, f"{BROKEN}:CreatesInForward")
    assert rc == 1, out
    assert causes(out) == ["parameters created in forward"]
    assert "late.weight, late.bias" in out and "differ across ranks: late.weight (step 0)" in out
    assert [row[5] for row in table_rows(out)] == ["NO"] * 3


def test_one_wrapper_differing_is_a_fail_and_exit_1(capsys):
    # Equal with ours, stopped with PyTorch's: the verdict is the worse of the two, never the better.
    args = (f"{BROKEN}:IdleSparseTable", "--wrapper", "both", "--optimizer", "sgd", "--steps", "2")
    rc, out = run_check(capsys, *args)
    assert rc == 1, out
    assert "PASS (ours)" in out and "FAIL (torch): the ranks stopped: RuntimeError" in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("FAIL: 2 ranks (ddp) vs one process, 2 steps (ours: equal; torch: stopped)"), last


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["app.worker.models.MiniMLP"], "expected 'package.module:callable' (no ':' in it)"),
        (["no_such_package.models:Net"], "module 'no_such_package.models' does not import"),
        (["app.worker.models:Nope"], "has no attribute 'Nope'"),
        (["mini_mlp", "--model-kwargs", '{"depth": 3}'], "unexpected keyword argument 'depth'"),
        ([f"{BROKEN}:not_a_model"], "returned a list, not a torch.nn.Module"),
        (["mini_mlp", "--data", f"{BROKEN}:regression_data", "--data-kwargs", '{"size": 10}'], "10 samples"),
        (["mini_mlp", "--model-kwargs", "[1]"], "--model-kwargs: expected a JSON object"),
        (["mini_mlp", "--ranks", "0"], "--ranks must be >= 1"),
        (["mini_mlp", "--autocast", "bf16", "--dtype", "float64"], "--autocast bf16 runs on float32 parameters"),
        (["mini_mlp", "--parallel", "zero3", "--dtype", "float64"], "zero3 keeps float32 master shards"),
        (["mini_mlp", "--parallel", "zero2", "--find-unused-parameters"], "--parallel zero2 has none"),
        (["mini_mlp", "--parallel", "dp"], "argument --parallel: invalid choice: 'dp'"),
        (["mini_mlp", "--parallel", "pipeline", "--wrapper", "torch"], "--parallel pipeline has none (each rank runs"),
        (["mini_mlp", "--parallel", "pipeline", "--find-unused-parameters"], "--parallel pipeline has none"),
        (["mini_mlp", "--parallel", "pipeline", "--ranks", "1"], "--parallel pipeline needs --ranks >= 2"),
        (["mini_mlp", "--pipeline-split", "net.2"], "--pipeline-split is for --parallel pipeline"),
        (
            [f"{BROKEN}:UnusedParameter", "--parallel", "pipeline"],
            "--parallel pipeline --ranks 2: UnusedParameter's forward is not its children in order (body, unused_head)",
        ),
        (
            ["tests.models_user:SmallNet", "--parallel", "pipeline", "--ranks", "3"],
            "3 stages but the model's sequence has 2 module(s) with parameters: use at most 2 stages",
        ),
        (
            ["tests.models_user:flat_mlp", "--parallel", "pipeline", "--pipeline-split", "1"],
            "--pipeline-split 1: stage 0 (0) has no parameters; move the cut",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line_before_any_rank(args, message, capsys):
    # In this process (a fork per case cost ~2 s of a shared core each); the command itself runs in the test below.
    try:
        rc = main(args)
    except SystemExit as e:  # argparse's errors exit from parse_args
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, out + err
    assert out == ""  # nothing printed: no table, no rank started
    assert len(err.strip().splitlines()) == 1, err
    assert message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["mini_mlp", "--parallel", "dp"], "argument --parallel: invalid choice: 'dp'"),  # argparse's own exit
        (["no_such_package.models:Net"], "module 'no_such_package.models' does not import"),  # a spec error
        (["mini_mlp", "--parallel", "pipeline", "--ranks", "1"], "--parallel pipeline needs --ranks >= 2"),
    ],
)
def test_the_command_exits_2_with_one_line_before_any_rank(args, message):
    result = run_module("app.check", *args, timeout=120, env=dict(os.environ))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr


RECIPE = ("--autocast", "bf16", "--grad-clip-norm", "0.5", "--lr-schedule", "cosine", "--warmup-steps", "1")
USER_MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width: int = 24):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.body(x) + 0.1 * x.sum(-1, keepdim=True))
"""


def test_a_user_model_outside_the_repo_passes_under_zero3_with_the_recipe_and_accumulation(tmp_path):
    # As a user runs it: from their own directory, their module beside them, not in this repository.
    (tmp_path / "mymodel.py").write_text(USER_MODEL)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "app.check", "mymodel:Net", "--parallel", "zero3", *RECIPE, "--accum", "2"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "parallel zero3; recipe: autocast bf16, clip 0.5, lr schedule 1 warm-up + cosine" in result.stdout
    assert "PASS (ours): max |dp|" in result.stdout and "tolerance 1e-02" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("PASS: 2 ranks (zero3) vs one process, 5 steps")


PIPELINE_USER_MODEL = """
from torch import nn


class Net(nn.Module):
    def __init__(self, width: int = 24):
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.GELU(), nn.Linear(width, width)) for _ in range(3))
        self.head = nn.Sequential(nn.GELU(), nn.Linear(width, 4))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
"""
PIPELINE_RECIPE = ("--grad-clip-norm", "1.0", "--lr-schedule", "cosine", "--warmup-steps", "2", "--accum", "2")


def test_a_user_model_outside_the_repo_passes_as_a_pipeline_with_the_recipe_and_accumulation(tmp_path):
    (tmp_path / "mymodel.py").write_text(PIPELINE_USER_MODEL)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "app.check", "mymodel:Net", "--parallel", "pipeline", "--ranks", "2"]
    command += ["--autocast", "bf16", *PIPELINE_RECIPE]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "parallel pipeline (2 stages, stages 2.. begin at blocks.1.1; gpipe, 4 micro-batches of 8" in result.stdout
    assert "recipe: autocast bf16, clip 1, lr schedule 2 warm-up + cosine" in result.stdout
    assert "PASS (pipeline): max |dp|" in result.stdout and "tolerance 1e-02" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("PASS: 2 ranks (pipeline) vs one process, 5 steps")


# The pipeline against one process under the same recipe, at a tolerance below the check's 1e-2. Measured max |dp| on
# tests.models_user:StackNet: up to 1.0e-3 in bf16 (AdamW turning a near-zero gradient into an lr-sized step), 1.1e-7
# in float32 at 4 ranks: float32 to the default 2e-4, autocast to 5e-3.
@pytest.mark.parametrize(
    ("autocast", "ranks", "tolerance"),
    [("none", 4, "2e-4"), ("bf16", 2, "5e-3"), ("fp16", 2, "5e-3"), ("fp16", 4, "5e-3")],
)
def test_the_pipeline_under_autocast_equals_one_process(capsys, autocast, ranks, tolerance):
    args = ("--parallel", "pipeline", "--ranks", str(ranks), "--autocast", autocast, *PIPELINE_RECIPE)
    rc, out = main_check(capsys, "tests.models_user:StackNet", *args, "--tolerance", tolerance)
    assert rc == 0, out
    assert f"PASS: {ranks} ranks (pipeline) vs one process, 3 steps (pipeline: equal)" in out


def main_check(capsys, *args: str) -> tuple[int, str]:
    """``run_check`` without a ``--wrapper``: the pipeline refuses one."""
    rc = main(["--steps", "3", *args])
    return rc, capsys.readouterr().out


def test_batch_norm_fails_under_the_pipeline_and_is_named(capsys):
    # Each micro-batch normalised with its own statistics, running stats updated per micro-batch: whatever the
    # tolerance, the buffers tell (the counter of batches is exact).
    for extra in ((), ("--autocast", "bf16", "--tolerance", "1")):
        rc, out = main_check(capsys, f"{BROKEN}:WithBatchNorm", "--parallel", "pipeline", "--steps", "2", *extra)
        assert rc == 1, out
        assert causes(out) == ["BatchNorm under the pipeline"], out
        assert "BatchNorm1d net.1" in out and "net.1.num_batches_tracked (step 0)" in out and "--eval" in out
    rc, out = main_check(capsys, f"{BROKEN}:WithBatchNorm", "--parallel", "pipeline", "--steps", "2", "--eval")
    assert rc == 0, out


def test_a_parameter_without_a_gradient_trains_as_in_one_process_under_the_pipeline(capsys):
    # No gradient is reduced across the stages: each stage's AdamW skips it, as one process's does. DDP stops on it.
    rc, out = main_check(capsys, f"{BROKEN}:UnusedInSequence", "--parallel", "pipeline", "--accum", "2")
    assert rc == 0, out
    rc, out = run_check(capsys, f"{BROKEN}:UnusedInSequence", "--steps", "1")
    assert rc == 1 and causes(out) == ["parameters without a gradient"] and "net.0.spare.weight" in out, out


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2"])
def test_every_kind_passes_with_bf16_clipping_a_schedule_and_accumulation(capsys, kind):
    rc, out = run_check(capsys, "tests.models_user:SmallNet", "--parallel", kind, *RECIPE, "--accum", "2")
    assert rc == 0, out
    assert f"PASS: 2 ranks ({kind}) vs one process" in out


@pytest.mark.parametrize("kind", ["zero1", "zero2", "zero3"])
def test_every_kind_names_batch_norm_and_a_parameter_without_a_gradient(capsys, kind):
    rc, out = run_check(capsys, f"{BROKEN}:WithBatchNorm", "--parallel", kind, "--steps", "1")
    assert rc == 1, out
    assert causes(out) == ["buffers differ across ranks after step 0"], out
    rc, out = run_check(capsys, f"{BROKEN}:UnusedParameter", "--parallel", kind, "--steps", "1")
    assert rc == 1 and "the ranks stopped" in out, out
    assert causes(out) == ["parameters without a gradient"], out
    fix = "find_unused_parameters=True" if kind == "zero1" else "freeze them (requires_grad=False)"
    assert fix in out, out


def test_batch_norm_fails_under_autocast_whatever_the_tolerance(capsys):
    # Under bf16 the tolerance is as wide as BatchNorm's effect on the parameters: its buffers still tell.
    rc, out = run_check(capsys, f"{BROKEN}:WithBatchNorm", "--autocast", "bf16", "--tolerance", "1")
    assert rc == 1, out
    assert causes(out) == ["buffers differ across ranks after step 0"], out
