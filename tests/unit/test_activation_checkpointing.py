"""Activation checkpointing (app.parallel.activation_checkpointing, ``activation_checkpointing`` in the worker).

What a user notices: ``units`` / ``every:N`` name the model's blocks (the items of its largest ModuleList or
Sequential, or the classes ``activation_checkpointing_units`` names), and the log says which; a checkpointed model
computes the very same gradients (bit for bit, float64) while keeping far fewer bytes for backward; names and
``state_dict`` keys do not change, so checkpoints load either way; a setting that names no module is one line
naming it and the fix, exit 2, before anything is written. Every kind's real runs: tests/integration/
test_activation_checkpointing.py; memory and time: ``make bench-activation-checkpointing``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.parallel.activation_checkpointing import candidate_units, checkpoint_modules, every_nth
from app.worker.config import ConfigError, TrainConfig
from app.worker.models import MiniMLP, TinyTransformer
from app.worker.workload import checkpointed_units
from tests.trainer_run import clean_env, run_module

BLOCKS = [f"blocks.{i}" for i in range(6)]


@pytest.mark.parametrize(
    ("model", "setting", "classes", "expected"),
    [
        ("tiny_transformer", "off", "", []),
        ("tiny_transformer", "units", "", BLOCKS),
        ("tiny_transformer", "every:2", "", ["blocks.1", "blocks.3", "blocks.5"]),
        ("tiny_transformer", "every:6", "", ["blocks.5"]),
        ("tiny_transformer", "units", "Sequential", [f"{b}.mlp" for b in BLOCKS]),
        ("mini_mlp", "units", "", ["net.0", "net.1", "net.2", "net.3", "net.4"]),
        ("mini_mlp", "units", "Linear", ["net.0", "net.2", "net.4"]),
        ("mini_mlp", "every:2", "Linear, ReLU", ["net.1", "net.3"]),
    ],
)
def test_each_setting_names_these_modules(model, setting, classes, expected):
    cfg = TrainConfig(model=model, activation_checkpointing=setting, activation_checkpointing_units=classes)
    built = {"mini_mlp": MiniMLP, "tiny_transformer": TinyTransformer}[model]()
    assert list(checkpointed_units(cfg, built)) == expected


def _grads_and_saved_bytes(model: nn.Module, tokens: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """The parameters' gradients after one backward, and the bytes autograd kept from forward for it (outside a
    checkpoint: inside one, the checkpoint's own hooks drop them)."""
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return [p.grad.clone() for p in model.parameters()], sum(saved)


def test_checkpointed_blocks_give_the_same_gradients_and_keep_a_fraction_of_the_bytes():
    torch.manual_seed(0)
    plain = TinyTransformer().double()
    checkpointed = copy.deepcopy(plain)
    checkpoint_modules(candidate_units(checkpointed, []).values())
    tokens = torch.randint(0, 64, (8, 33))
    plain_grads, plain_bytes = _grads_and_saved_bytes(plain, tokens)
    grads, kept = _grads_and_saved_bytes(checkpointed, tokens)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads, strict=True))
    assert kept < plain_bytes / 5  # measured: 0.37 of 5.9 MB, the blocks' inputs and what lies outside them
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert [type(b).__name__ for b in checkpointed.blocks] == ["Block"] * 6


def test_a_first_layer_whose_input_needs_no_gradient_still_learns():
    # Non-reentrant: a reentrant checkpoint of net.0 (its input, the data, needs no gradient) would return an
    # output cut from the graph, and net.0 would never get a gradient.
    torch.manual_seed(0)
    plain = MiniMLP().double()
    checkpointed = copy.deepcopy(plain)
    checkpoint_modules(every_nth(candidate_units(checkpointed, []), 1).values())
    x, y = torch.randn(16, 32, dtype=torch.float64), torch.randint(0, 8, (16,))
    for model in (plain, checkpointed):
        F.cross_entropy(model(x), y).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True))


class _NoList(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"activation_checkpointing": "sometimes"}, "activation_checkpointing='sometimes': must be off | units"),
        ({"activation_checkpointing": "every:0"}, "activation_checkpointing='every:0': must be off | units"),
        ({"activation_checkpointing_units": "Block"}, "activation_checkpointing_units='Block' is for activation"),
    ],
)
def test_a_malformed_setting_is_one_line_naming_it(kwargs, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        TrainConfig(model="tiny_transformer", **kwargs)


@pytest.mark.parametrize(
    ("model", "kwargs", "message"),
    [
        (
            TinyTransformer,
            {"activation_checkpointing": "every:7"},
            "activation_checkpointing=every:7: TinyTransformer has 6 units (blocks.0 .. blocks.5), so every 7th "
            "names none; choose N <= 6, or units",
        ),
        (
            TinyTransformer,
            {"activation_checkpointing": "units", "activation_checkpointing_units": "Block,Nope"},
            "activation_checkpointing_units='Block,Nope': Nope names no module class of TinyTransformer (it has Block,",
        ),
        (
            _NoList,
            {"activation_checkpointing": "units"},
            "activation_checkpointing=units: _NoList has no nn.ModuleList or nn.Sequential to take its units from; "
            "name its block classes in activation_checkpointing_units, or set activation_checkpointing=off",
        ),
    ],
)
def test_a_setting_that_names_no_module_is_one_line_naming_it_and_the_fix(model, kwargs, message):
    with pytest.raises(ConfigError) as e:
        checkpointed_units(TrainConfig(**kwargs), model())
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_worker_refuses_it_with_one_line_exit_2_and_writes_nothing(tmp_path):
    target = tmp_path / "ckpt"
    args = ["--model", "tiny_transformer", "--activation-checkpointing", "every:9", "--checkpoint-dir", str(target)]
    result = run_module("app.train", "--metrics-port", "0", "--wrapper", "none", *args, timeout=120, env=clean_env())
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "config error: activation_checkpointing=every:9: TinyTransformer has 6 units (blocks.0 .. blocks.5), so "
        "every 9th names none; choose N <= 6, or units"
    ]
    assert not target.exists() or not any(target.iterdir())
