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
from tests.trainer_run import clean_env, describe, finished, run_process, torchrun

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
