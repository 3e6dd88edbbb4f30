"""The built-in models (app.worker.models) as their docstrings describe them: MiniMLP's 3 layers, DeepMLP's stack
with no activation after its last layer, TinyTransformer's causal attention, tied head and small initial logits,
and the one parameter checksum ranks are compared with."""

from __future__ import annotations

import math

import torch
from torch import nn

from app.worker.models import (
    MODELS,
    DeepMLP,
    MiniMLP,
    TinyTransformer,
    count_parameter_tensors,
    parameter_checksum,
)


def test_mini_mlp_is_three_linear_layers_from_32_features_to_8_classes():
    model = MiniMLP()
    linears = [m for m in model.net if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(32, 64), (64, 64), (64, 8)]
    assert count_parameter_tensors(model) == 6
    assert [type(m) for m in model.net] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]
    assert model(torch.zeros(5, 32)).shape == (5, 8)
    assert MiniMLP(in_features=4, hidden=3, out_features=2)(torch.zeros(1, 4)).shape == (1, 2)


def test_deep_mlp_has_no_activation_after_its_last_layer():
    model = DeepMLP(width=8, depth=3)
    assert [type(m) for m in model.net] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]
    torch.manual_seed(0)
    out = model(torch.randn(64, 8))
    assert out.shape == (64, 8) and (out < 0).any()  # a final ReLU would clamp every output at 0
    assert count_parameter_tensors(DeepMLP()) == 48


def test_the_transformer_is_causal_each_position_sees_only_the_tokens_before_it():
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    tokens = torch.randint(0, 64, (2, 10))
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 64
    a, b = model(tokens), model(changed)
    assert a.shape == (2, 10, 64)
    torch.testing.assert_close(a[:, :6], b[:, :6])  # a later token changes no earlier logit
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_the_transformers_head_is_its_embedding_and_its_first_loss_is_near_ln_vocab():
    torch.manual_seed(0)
    model = TinyTransformer()
    assert model.head.weight is model.tok.weight  # tied: DDP sees one shared parameter
    assert len(model.blocks) == 6 and model.pos.num_embeddings == 64
    tokens = torch.randint(0, 64, (8, 32))
    loss = nn.functional.cross_entropy(model(tokens).reshape(-1, 64), tokens.reshape(-1))
    assert abs(loss.item() - math.log(64)) < 0.5  # N(0, 0.02) embeddings: small logits, not a loss near 35
    assert model.tok.weight.std().item() < 0.05 and model.pos.weight.std().item() < 0.05


def test_the_built_in_names_are_these_classes():
    assert {"mini_mlp": MiniMLP, "deep_mlp": DeepMLP, "tiny_transformer": TinyTransformer} == MODELS


def test_the_checksum_is_equal_for_equal_parameters_and_changes_with_any_one():
    torch.manual_seed(1)
    one = MiniMLP()
    two = MiniMLP()
    two.load_state_dict(one.state_dict())
    assert parameter_checksum(one) == parameter_checksum(two) and len(parameter_checksum(one)) == 64
    with torch.no_grad():
        two.net[4].bias[7] += 1e-6
    assert parameter_checksum(one) != parameter_checksum(two)
