"""Model parallelism on one host: the split (balance, uneven counts, bad counts) and step-by-step equality with the
unsplit model. On CPU the "devices" are stand-ins (all the same device), so equality is exact; with two GPUs the
same test compares cuda:0,cuda:1 against one GPU within a float tolerance."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.parallel.model_parallel import ModelParallel, balance_partition, merge_stage_state_dicts, split_model
from app.worker.models import DeepMLP, MiniMLP

GPU_TOLERANCE = 1e-5  # different devices may pick different kernels (summation order); CPU stand-ins are exact


def devices_for(n: int) -> list[str]:
    if torch.cuda.device_count() >= n:
        return [f"cuda:{i}" for i in range(n)]
    return ["cpu"] * n


def train_side_by_side(devices: list[str], steps: int = 5) -> list[float]:
    torch.manual_seed(0)
    model = DeepMLP(width=32, depth=8)
    reference = copy.deepcopy(model).to(devices[0])
    mp = ModelParallel(model, devices)
    opt = torch.optim.SGD(mp.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    gaps = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
        opt.zero_grad()
        F.mse_loss(mp(x.to(devices[0])), y.to(mp.output_device)).backward()  # labels where the output lands
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(reference(x.to(devices[0])), y.to(devices[0])).backward()
        ref_opt.step()
        full = mp.full_state_dict()
        gaps.append(max((full[k] - v.cpu()).abs().max().item() for k, v in reference.state_dict().items()))
    return gaps


def test_model_parallel_equals_one_device_step_by_step():
    devices = devices_for(2)
    gaps = train_side_by_side(devices + devices[-1:])  # 3 stages over 8 layers: 3 + 3 + 2
    tolerance = 0.0 if devices[0] == "cpu" else GPU_TOLERANCE
    assert len(gaps) == 5 and max(gaps) <= tolerance, gaps


def test_forward_moves_activations_and_counts_bytes():
    mp = ModelParallel(DeepMLP(width=32, depth=8), ["cpu", "cpu", "cpu"])
    out = mp(torch.randn(4, 32))
    assert out.device == mp.output_device
    assert mp.activation_bytes == 2 * 4 * 32 * 4  # two boundaries, a [4, 32] fp32 activation each
    assert [len(s) for s in mp.stages] == [6, 6, 3]  # Linear+ReLU pairs; the last stage ends with the bare Linear


def test_uneven_and_balanced_splits():
    assert balance_partition([1.0] * 8, 3) == [(0, 3), (3, 6), (6, 8)]  # remainder to the earlier stages
    assert balance_partition([1.0, 1.0, 1.0, 5.0], 2) == [(0, 3), (3, 4)]  # the heavy layer gets a stage alone
    # By parameter count: a wide first layer balances against the narrow rest.
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    assert [len(s) for s in split_model(model, 2)] == [1, 3]


def test_split_by_measured_time():
    stages = split_model(MiniMLP(), 2, balance="time", sample=torch.randn(64, 32))
    assert sum(len(s) for s in stages) == 5 and all(len(s) >= 1 for s in stages)


def test_more_stages_than_layers_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"^4 stages but MiniMLP has only 3 layers .*use at most 3 stages$"):
        ModelParallel(MiniMLP(), ["cpu"] * 4)


def test_unsplittable_model_names_the_fix():
    with pytest.raises(ValueError, match="express the model as one"):
        split_model(nn.Linear(2, 2), 2)


def test_merged_state_dict_loads_into_the_bare_model():
    torch.manual_seed(1)
    model = DeepMLP(width=16, depth=4)
    expected = copy.deepcopy(model.state_dict())
    stages = split_model(model, 3)
    bare = DeepMLP(width=16, depth=4)
    bare.load_state_dict(merge_stage_state_dicts([s.state_dict() for s in reversed(stages)]))
    assert all(torch.equal(bare.state_dict()[k], v) for k, v in expected.items())
    with pytest.raises(ValueError, match="appears in two stages"):
        merge_stage_state_dicts([stages[0].state_dict(), stages[0].state_dict()])


def test_the_output_lands_on_the_last_stages_device_which_output_device_names():
    # Three distinct devices without GPUs: the last stage on "meta" (shapes only). The labels go to
    # output_device; naming any other stage's device would put them beside a different device than the output.
    mp = ModelParallel(DeepMLP(width=8, depth=3), ["cpu", "cpu", "meta"])
    out = mp(torch.randn(4, 8))
    assert out.device == mp.output_device == torch.device("meta")


@pytest.mark.parametrize(
    "costs, stages, expected",
    [
        ([1.0] * 4, 2, [(0, 2), (2, 4)]),
        ([1.0] * 5, 2, [(0, 3), (3, 5)]),  # the remainder at the front
        ([1.0] * 7, 3, [(0, 3), (3, 6), (6, 7)]),  # earlier stages take what the optimum allows
        ([4.0, 1.0, 1.0, 1.0, 1.0], 2, [(0, 1), (1, 5)]),  # the heavy layer alone
    ],
)
def test_balance_partition_takes_layers_one_at_a_time_up_to_the_optimum(costs, stages, expected):
    assert balance_partition(costs, stages) == expected
