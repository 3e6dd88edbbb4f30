"""``app.parallel.model_parallel`` in one process, what tests/integration/test_model_parallel.py leaves out: one
stage (one device: the model whole), the layers a split is made of, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.parallel.model_parallel import (
    ModelParallel,
    balance_partition,
    group_layers,
    layer_costs,
    sequential_of,
    split_model,
)
from app.worker.models import DeepMLP


def test_one_stage_is_the_whole_model_and_no_stage_is_refused():
    assert balance_partition([3.0, 1.0, 2.0], 1) == [(0, 3)]
    with pytest.raises(ValueError, match=r"^stages must be >= 1, got 0$"):
        balance_partition([3.0, 1.0], 0)
    with pytest.raises(ValueError, match=r"^3 stages but the model has only 2 layers: use at most 2 stages$"):
        balance_partition([3.0, 1.0], 3)
    torch.manual_seed(0)
    model = DeepMLP(width=8, depth=3)
    x = torch.randn(2, 8)
    expected = model(x)
    mp = ModelParallel(model, ["cpu"])
    assert mp.stage_sizes() == [sum(p.numel() for p in model.parameters())]
    assert torch.equal(mp(x), expected) and mp.activation_bytes == 0  # no boundary crossed
    with pytest.raises(ValueError, match=r"^devices is empty: give one device per stage"):
        ModelParallel(model, [])


def test_a_layer_is_a_module_with_parameters_and_the_parameterless_ones_after_it():
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Dropout(), nn.Linear(2, 2), nn.Tanh())
    assert group_layers(seq) == [[0, 1, 2], [3, 4]]  # no stage starts with an activation
    assert layer_costs(seq, group_layers(seq), "params") == [6.0, 6.0]
    with pytest.raises(ValueError, match=r"^balance='flops': choose one of params, time$"):
        layer_costs(seq, group_layers(seq), "flops")
    with pytest.raises(ValueError, match=r"^balance='time' needs a sample input"):
        layer_costs(seq, group_layers(seq), "time")
    times = layer_costs(seq, group_layers(seq), "time", torch.randn(4, 2))
    assert len(times) == 2 and all(t > 0 for t in times)
    assert all(p.grad is None for p in seq.parameters())  # the timing leaves no gradient behind


def test_the_sequence_split_is_the_model_itself_or_its_net_and_stages_keep_the_models_indices():
    seq = nn.Sequential(nn.Linear(2, 2))
    assert sequential_of(seq) == (seq, "")
    model = DeepMLP(width=4, depth=2)
    assert sequential_of(model) == (model.net, "net.")
    stages = split_model(model, 2)
    assert [list(s._modules) for s in stages] == [["0", "1"], ["2"]]
    assert all(a is b for a, b in zip(stages[0], model.net))  # the model's own modules, not copies
    assert sorted(stages[1].state_dict()) == ["2.bias", "2.weight"]
