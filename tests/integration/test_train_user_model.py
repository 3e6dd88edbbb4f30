"""A user's own model, data and loss in the worker (``model``/``data``/``loss`` specs): trained on 2 ranks from the
environment (JSON keywords) and in one process from a YAML file (mapping keywords), it ends with the same
parameters; the checkpoint records the spec and its keywords, and a resume with other keywords is refused (exit 2).

The user's parts live in tests/models_user.py: ``SmallNet`` (no dropout, no BatchNorm), a map-style data set (read
sample by sample and stacked by GlobalBatches), ``torch.nn:CrossEntropyLoss`` (a class, instantiated with
``loss_kwargs``). float64 and a fixed ``effective_batch``: the world size changes only the order of float additions.
"""

from __future__ import annotations

import pytest

from app.worker.checkpoint.files import checkpoint_path, load_checkpoint
from tests.trainer_run import clean_env, describe, finished, run_process, run_ranks, torchrun

pytestmark = pytest.mark.timeout(600)
STEPS = 6
SETTINGS = {
    "steps": STEPS,
    "effective_batch": 24,
    "micro_batch": 8,
    "dtype": "float64",
    "checkpoint_every": STEPS,
    "metrics_port": 0,
    "log_every": 3,
}
YAML = """\
model: tests.models_user:SmallNet
model_kwargs: {hidden: 12}
data: tests.models_user:ClassificationDataset
data_kwargs:
  size: 96
loss: torch.nn:CrossEntropyLoss
loss_kwargs: {label_smoothing: 0.1}
"""
ENV = {
    "DDP_MODEL": "tests.models_user:SmallNet",
    "DDP_MODEL_KWARGS": '{"hidden": 12}',
    "DDP_DATA": "tests.models_user:ClassificationDataset",
    "DDP_DATA_KWARGS": '{"size": 96}',
    "DDP_LOSS": "torch.nn:CrossEntropyLoss",
    "DDP_LOSS_KWARGS": '{"label_smoothing": 0.1}',
}


def flags(**settings) -> list[str]:
    return [part for k, v in {**SETTINGS, **settings}.items() for part in (f"--{k.replace('_', '-')}", str(v))]


def test_a_user_model_trains_alike_on_two_ranks_and_one(tmp_path):
    env = clean_env(**{f"DDP_{k.upper()}": str(v) for k, v in SETTINGS.items()}, **ENV)
    two = torchrun("--checkpoint-dir", str(tmp_path / "two"), nproc=2, env=env, timeout=300)
    assert two.returncode == 0, describe(two)
    config = tmp_path / "user.yaml"
    config.write_text(YAML)
    one = run_process("--config", str(config), "--wrapper", "none", *flags(checkpoint_dir=tmp_path / "one"))
    assert one.returncode == 0, describe(one)
    assert [finished(two.stdout)[r]["step"] for r in (0, 1)] == [str(STEPS)] * 2

    saved = {name: load_checkpoint(checkpoint_path(tmp_path / name, STEPS)) for name in ("one", "two")}
    assert saved["one"]["model_name"] == 'tests.models_user:SmallNet {"hidden": 12}'
    assert saved["two"]["model_name"] == saved["one"]["model_name"]
    a, b = saved["one"]["model"], saved["two"]["model"]
    assert a["net.0.weight"].shape == (12, 32)  # model_kwargs reached the model
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff < 1e-12, f"max |Δparam| world 2 vs one process: {diff:.3g}"

    # The same directory, another model_kwargs: refused before training, in one line, exit 2.
    other = run_process(
        "--config", str(config), "--wrapper", "none", "--model-kwargs", '{"hidden": 10}',
        *flags(steps=STEPS + 2, checkpoint_dir=tmp_path / "one"),
    )  # fmt: skip
    assert other.returncode == 2, describe(other)
    assert 'holds tests.models_user:SmallNet {"hidden": 12} checkpoints' in other.stderr, describe(other)


# A user model in the pipeline: StackNet (embed, blocks.0..2, head; tests/models_user.py) cut where blocks.1 begins.
# float32 (a pipeline's only dtype): the micro-batches' sums run in another order than one process's accumulation
# (measured max |Δparam| 3e-8 after 6 steps at world 2 and 4), and AdamW divides by sqrt(v), so the gap grows with
# the steps; 1e-6, as tests/integration/test_train_pipeline.py, is far below what one missed micro-batch or
# replica sync leaves (about lr = 3e-3 per parameter and step).
PIPELINE_ATOL = 1e-6
PIPELINE = {
    "model": "tests.models_user:StackNet",
    "model_kwargs": '{"hidden": 12}',
    "data": "tests.models_user:ClassificationDataset",
    "data_kwargs": '{"size": 96}',
    "loss": "torch.nn:CrossEntropyLoss",
    "steps": STEPS,
    "effective_batch": 24,  # accumulation: 4 micro-batches per replica in the pipeline, 3 of <= 8 in one process
    # The recipe: a warm-up into a cosine decay, and clipping below the gradient's norm, so that every step clips.
    "lr_schedule": "cosine",
    "warmup_steps": 2,
    "grad_clip_norm": 0.05,
    "micro_batch": 8,
    "checkpoint_every": STEPS,
    "metrics_port": 0,
    "log_every": 3,
}


def _pipeline_flags(**settings) -> list[str]:
    return [part for k, v in {**PIPELINE, **settings}.items() for part in (f"--{k.replace('_', '-')}", str(v))]


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_user_model_cut_into_a_pipeline_trains_as_one_process(tmp_path, world_size):
    """2 stages cut at blocks.1 (world 4: two replicas of them), equal to one process within PIPELINE_ATOL."""
    piped = run_ranks(
        *_pipeline_flags(
            parallel="pipeline", pipeline_stages=2, pipeline_split="blocks.1", checkpoint_dir=tmp_path / "pp"
        ),
        world_size=world_size,
    )
    assert piped.returncode == 0, describe(piped)
    assert "stages 2.. begin at blocks.1" in piped.stderr, describe(piped)
    one = run_process(*_pipeline_flags(wrapper="none", checkpoint_dir=tmp_path / "one"))
    assert one.returncode == 0, describe(one)
    a, b = (load_checkpoint(checkpoint_path(tmp_path / name, STEPS))["model"] for name in ("one", "pp"))
    assert sorted(a) == sorted(b) and a["blocks.1.1.weight"].shape == (12, 12)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff < PIPELINE_ATOL, f"max |Δparam| pipeline (world {world_size}) vs one process: {diff:.3g}"


def test_a_user_model_pipeline_resumed_mid_warm_up_continues_as_one_process(tmp_path):
    """Stopped at step 3 of a 3-step warm-up and resumed under 1F1B, the schedule (checkpointed with the stages)
    continues where it was: the parameters at step 6 equal one process's straight run within PIPELINE_ATOL."""
    common = {"lr_schedule": "constant", "warmup_steps": 3, "checkpoint_every": 3}
    pipeline = {"parallel": "pipeline", "pipeline_split": "blocks.1", "checkpoint_dir": tmp_path / "pp", **common}
    first = run_ranks(*_pipeline_flags(**pipeline, steps=3))
    assert first.returncode == 0, describe(first)
    resumed = run_ranks(*_pipeline_flags(**pipeline, pipeline_schedule="1f1b", steps=6))
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, describe(resumed)
    one = run_process(*_pipeline_flags(wrapper="none", checkpoint_dir=tmp_path / "one", **common, steps=6))
    assert one.returncode == 0, describe(one)
    a, b = (load_checkpoint(checkpoint_path(tmp_path / name, 6)) for name in ("one", "pp"))
    diff = max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])
    assert diff < PIPELINE_ATOL, f"max |Δparam| resumed pipeline vs one process: {diff:.3g}"
    assert b["lr_scheduler"]["last_epoch"] == 6
