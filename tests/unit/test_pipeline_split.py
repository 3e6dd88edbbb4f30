"""Where a model is cut into pipeline stages (app.parallel.pipeline.split), without process groups: the stages run
one after the other in one process must be the model, their state dicts must merge into the model's, and a split
that cannot work is one ``ValueError`` line naming the cause and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.parallel.model_parallel import split_model
from app.parallel.pipeline import SequenceStage, check_sequence, merge_state_dicts, model_sequence, stage_ranges
from app.parallel.pipeline.split import split_names
from app.worker.models import DeepMLP, MiniMLP
from tests.models_user import ResidualNet, StackNet, flat_mlp


def _stages(model: nn.Module, num_stages: int, split=None) -> list[SequenceStage]:
    sequence = model_sequence(model)
    return [SequenceStage(sequence[first:end]) for first, end in stage_ranges(sequence, num_stages, split)]


def test_a_split_model_run_stage_after_stage_is_the_model_and_its_stages_merge_into_it():
    torch.manual_seed(0)
    model, x = StackNet(hidden=12), torch.randn(4, 32)
    sequence = model_sequence(model)
    assert [name for name, _ in sequence][:3] == ["embed", "blocks.0.0", "blocks.0.1"]
    check_sequence(model, sequence, x)
    stages = _stages(model, 3, ["blocks.1", "blocks.2"])  # a container's name: its first item, blocks.1.0
    assert [s.stage_order[0] for s in stages] == ["embed", "blocks.1.0", "blocks.2.0"]
    out = x
    for stage in stages:
        out = stage(out)
    assert torch.equal(out, model(x))
    fresh = StackNet(hidden=12)
    fresh.load_state_dict(merge_state_dicts([s.state_dict() for s in stages]))  # the whole model's keys, no prefix
    assert torch.equal(fresh(x), model(x))


@pytest.mark.parametrize(("model", "num_stages"), [(MiniMLP(), 2), (MiniMLP(), 3), (DeepMLP(width=8, depth=7), 3)])
def test_the_balanced_split_is_split_models(model, num_stages):
    """No split given: the same stages as model parallelism's split by parameter count (mini_mlp's pipeline)."""
    ours = [sorted(s.state_dict()) for s in _stages(model, num_stages)]
    theirs = [sorted(f"net.{k}" for k in s.state_dict()) for s in split_model(model, num_stages)]
    assert ours == theirs


def test_the_balanced_split_keeps_a_leading_module_without_parameters_with_the_first_stage():
    assert stage_ranges(model_sequence(flat_mlp()), 2) == [(0, 3), (3, 4)]  # Flatten, Linear, Tanh | Linear


class _ScaledNet(nn.Module):
    """A parameter on the model itself: no stage could carry it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.b(self.a(x)) * self.scale


@pytest.mark.parametrize(
    ("model", "says"),
    [
        (ResidualNet(), "ResidualNet's forward is not its children in order (inner, head): the chain gives another"),
        (_ScaledNet(), "_ScaledNet's scale belongs to no module of its sequence (a, b); a stage carries only whole"),
        (nn.Sequential(nn.Linear(32, 8)), "Sequential has 1 child module(s) to cut between"),
    ],
)
def test_a_model_that_is_not_its_sequence_of_children_cannot_be_cut(model, says):
    with pytest.raises(ValueError) as e:
        check_sequence(model, model_sequence(model), torch.randn(2, 32))
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("num_stages", "split", "says"),
    [
        (2, ["9"], "'9' is not a module of the model's sequence (0, 1, 2, 3): name one of those"),
        (2, ["1"], "stage 0 (0) has no parameters; move the cut"),
        (2, ["3.weight"], "'3.weight' is inside 3, which a stage runs whole: cut at 3 or after it"),
        (2, ["0"], "'0' is where the model begins, so stage 0 would be empty"),
        (3, ["3", "1"], "the cuts 3, 1 are not in forward order"),
        (3, ["2"], "1 cut(s) for 3 stages: name the 2 module(s) where stages 2.. begin"),
        (3, None, "3 stages but the model's sequence has 2 module(s) with parameters: use at most 2 stages"),
    ],
)
def test_a_split_that_cannot_work_is_one_line(num_stages, split, says):
    with pytest.raises(ValueError) as e:
        stage_ranges(model_sequence(flat_mlp()), num_stages, split)
    assert says in str(e.value) and "\n" not in str(e.value)


class _Masked(nn.Module):
    """A child that needs more than the previous one's output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x), x)  # (an nn.Linear given two inputs: what a mask argument looks like to the chain)


def test_the_check_leaves_the_models_mode_as_it_was_and_names_a_child_that_needs_more():
    for training in (True, False):
        model = DeepMLP(width=8, depth=3).train(training)
        check_sequence(model, model_sequence(model), torch.randn(2, 8))
        assert model.training is training and all(m.training is training for m in model.modules())
    model = _Masked().train()
    with pytest.raises(ValueError, match=r"^_Masked is not the sequence of its children \(a, b\): calling them in "):
        check_sequence(model, model_sequence(model), torch.randn(2, 32))
    assert model.training


def test_a_split_is_named_back_by_where_its_stages_begin_and_a_long_sequence_is_shortened_in_a_message():
    sequence = model_sequence(DeepMLP(width=8, depth=5))  # net.0 .. net.8
    assert split_names(sequence, stage_ranges(sequence, 3, ["net.4", "net.6"])) == ["net.4", "net.6"]
    assert split_names(sequence, [(0, 9)]) == []
    with pytest.raises(ValueError, match=r"sequence \(net\.0, net\.1, net\.2 \.\. net\.8\): name one of those$"):
        stage_ranges(sequence, 2, ["net.9"])
