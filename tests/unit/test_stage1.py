"""ZeRO stage 1's promises (app/parallel/zero/stage1.py) that need no training run: the partition rule, the runs a
broadcast or a checkpoint file is cut into, what the constructor refuses, and a loaded state dict's hyperparameters
(every one of them, in every group, and the step they give). The walks against one process and PyTorch are in
tests/integration/test_zero.py.

    .venv/bin/python -m pytest tests/unit/test_stage1.py
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from app.parallel.zero.stage1 import ZeroRedundancyOptimizer, partition_by_size, refuse_unshardable, runs_within
from app.world import run_world


def _sizes(partition) -> list[list[list[int]]]:
    return [[[p.numel() for p in group] for group in groups] for groups in partition]


def test_the_partition_gives_the_largest_first_each_to_the_emptiest_rank_and_ties_to_the_lowest():
    groups = [{"params": [torch.zeros(n) for n in (3, 10, 3, 7)]}, {"params": [torch.zeros(n) for n in (4, 4)]}]
    # 10 -> rank 0; 7 -> 1; 3 -> 1 (7 < 10); 3 -> rank 0 or 1 at 10 each: the lowest, 0. The second group goes on
    # from those sizes (13, 10): 4 -> rank 1 (14), then 4 -> rank 0 (13 < 14).
    assert _sizes(partition_by_size(groups, 2)) == [[[10, 3], [4]], [[7, 3], [4]]]
    # Equal sizes keep their order: the first of two equal parameters goes to the lower rank.
    a, b = torch.zeros(5), torch.zeros(5)
    assert partition_by_size([{"params": [a, b]}], 2) == [[[a]], [[b]]]
    # More ranks than parameters: the extra ranks hold an empty list for each group.
    assert _sizes(partition_by_size(groups[1:], 3)) == [[[4]], [[4]], [[]]]


def test_runs_are_cut_before_the_item_that_would_pass_the_limit_and_a_larger_item_is_a_run_alone():
    items = [torch.zeros(n) for n in (2, 2, 1, 8, 3, 1)]  # float32: 4 bytes an element
    runs = list(runs_within(items, 16))
    assert [[t.numel() for t in run] for run in runs] == [[2, 2], [1], [8], [3, 1]]
    assert [[n for n in run] for run in runs_within([1, 2, 3, 4], 5, nbytes=lambda n: n)] == [[1, 2], [3], [4]]
    assert [[n for n in run] for run in runs_within([5, 5], 5, nbytes=lambda n: n)] == [[5], [5]]  # exactly full
    assert list(runs_within([], 5)) == []


@pytest.mark.parametrize(
    ("optimizer_class", "says"),
    [
        (torch.optim.LBFGS, "optimizer_class=LBFGS cannot be sharded"),
        (
            torch.optim.AdamW([nn.Parameter(torch.zeros(1))]),
            "optimizer_class=an instance of AdamW: pass a torch.optim.Optimizer subclass (the class)",
        ),
        (nn.Linear, "optimizer_class=Linear: pass a torch.optim.Optimizer subclass (the class)"),
    ],
)
def test_an_optimizer_that_cannot_run_on_a_partition_is_one_line(optimizer_class, says):
    with pytest.raises(ValueError) as info:
        refuse_unshardable(optimizer_class)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_an_optimizer_that_can_run_on_a_partition_passes():
    for cls in (torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad):
        refuse_unshardable(cls)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _groups(model: nn.Module) -> list[dict]:
    return [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 0.2}]


def _step(model: nn.Module, opt, seed: int) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


SAVED = {"lr": 0.03, "weight_decay": 0.25, "betas": (0.7, 0.8), "eps": 1e-5, "maximize": True}


def load_a_plain_state(rank, world):
    """A plain AdamW's state dict, its groups' every hyperparameter changed, loaded into a ZeRO-1 AdamW built with
    others; then one step each."""
    plain_model = _model()
    plain = torch.optim.AdamW(_groups(plain_model), lr=0.1)
    _step(plain_model, plain, 0)
    for i, group in enumerate(plain.param_groups):
        group.update(SAVED, lr=SAVED["lr"] * (i + 1))
    saved = copy.deepcopy(plain.state_dict())
    model = copy.deepcopy(plain_model)
    zero = ZeroRedundancyOptimizer(_groups(model), optimizer_class=torch.optim.AdamW, lr=0.1, weight_decay=0.0)
    zero.load_state_dict(saved)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups]
    local = [{k: v for k, v in g.items() if k != "params"} for g in zero.optim.param_groups]
    _step(plain_model, plain, 1)
    _step(model, zero, 1)
    drift = max((p - q).abs().max().item() for p, q in zip(plain_model.parameters(), model.parameters()))
    expected = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    return hyper == expected, local == expected, drift


def test_a_loaded_state_dict_brings_every_hyperparameter_of_every_group_and_steps_as_the_plain_optimizer():
    # weight_decay, betas, eps, maximize and each group's lr: what the saved run trained with, not what the
    # resumed run's constructor said (a resume that kept the constructor's would silently train another recipe).
    for groups_loaded, partition_loaded, drift in run_world(load_a_plain_state, 2):
        assert groups_loaded and partition_loaded
        assert drift <= 1e-7, drift


def group_count_mismatch(rank, world):
    model = _model()
    zero = ZeroRedundancyOptimizer(_groups(model), optimizer_class=torch.optim.AdamW, lr=0.1)
    one_group = torch.optim.AdamW(model.parameters(), lr=0.1).state_dict()
    try:
        zero.load_state_dict(one_group)
    except ValueError as e:
        return str(e)
    return None


def test_a_state_dict_with_another_number_of_groups_is_refused_in_one_line():
    for message in run_world(group_count_mismatch, 2):
        assert message == (
            "state_dict has 1 parameter groups, this optimizer 2: it was saved from a different model or optimizer"
        )


def owners(rank, world):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))  # sizes 64, 8, 16, 2
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in zero.owned_parameters()], {n: zero.owner_of(p) for n, p in model.named_parameters()}


def test_each_rank_owns_its_partition_and_every_rank_names_the_same_owner_of_each_parameter():
    (mine0, owner0), (mine1, owner1) = run_world(owners, 2)
    # 64 -> rank 0; 16 -> 1; 8 -> 1; 2 -> 1 (24 < 64)
    assert mine0 == ["0.weight"] and mine1 == ["1.weight", "0.bias", "1.bias"]
    assert owner0 == owner1 == {"0.weight": 0, "0.bias": 1, "1.weight": 1, "1.bias": 1}


def broadcasts_in_flight(rank, world):
    """One step with 64-byte broadcast buckets; at each launch, how many broadcasts are launched and not yet
    waited for (each holds a flat copy of its bucket)."""
    from app.parallel.zero import stage1

    alive, most = [], []
    plain_broadcast, plain_cap = stage1.recorded.broadcast, stage1.BROADCAST_BUCKET_BYTES

    class Tracked:
        def __init__(self, work):
            self.work = work
            alive.append(self)

        def wait(self):
            self.work.wait()
            alive.remove(self)

    def launch(*args, **kwargs):
        work = Tracked(plain_broadcast(*args, **kwargs))
        most.append(len(alive))
        return work

    stage1.recorded.broadcast, stage1.BROADCAST_BUCKET_BYTES = launch, 64
    try:
        model = _model()
        reference = copy.deepcopy(model)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        plain = torch.optim.SGD(reference.parameters(), lr=0.1)
        _step(model, zero, 0)
        _step(reference, plain, 0)
    finally:
        stage1.recorded.broadcast, stage1.BROADCAST_BUCKET_BYTES = plain_broadcast, plain_cap
    equal = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    return most, alive, equal


def test_the_step_keeps_at_most_two_broadcast_buckets_in_flight_and_every_parameter_arrives():
    # Two flats alive at once whatever the model's size: one per bucket would hold a second copy of the model.
    for most, left, equal in run_world(broadcasts_in_flight, 2):
        assert len(most) == 4 and max(most) == 2 and most[0] == 1, most  # 4 parameters of 12 to 96 bytes, a bucket each
        assert left == [] and equal


def consolidated_onto(rank, world, to):
    model = _model()
    reference = copy.deepcopy(model)
    zero = ZeroRedundancyOptimizer(_groups(model), optimizer_class=torch.optim.AdamW, lr=0.1)
    plain = torch.optim.AdamW(_groups(reference), lr=0.1)
    for step in range(2):
        _step(model, zero, step)
        _step(reference, plain, step)
    if to is None:
        zero.consolidate_state_dict()
    else:
        zero.consolidate_state_dict(to=to)
    try:
        whole = zero.state_dict()
    except RuntimeError as e:
        return str(e)
    want = plain.state_dict()
    same_state = sorted(whole["state"]) == sorted(want["state"]) and all(
        torch.allclose(whole["state"][i][k], want["state"][i][k], atol=1e-7)
        for i in want["state"]
        for k in want["state"][i]
    )
    return same_state, whole["param_groups"] == want["param_groups"]


@pytest.mark.parametrize("to", [None, 0, 1])
def test_the_whole_state_is_consolidated_onto_the_rank_asked_in_pytorchs_format_and_elsewhere_is_an_error(to):
    # The rank consolidated onto gets the plain optimizer's state dict (state by index, each group's hyperparameters
    # and parameter indices); every other rank's state_dict() says what to call first. Default: rank 0.
    results = run_world(consolidated_onto, 2, to)
    onto = to or 0
    assert results[onto] == (True, True), results
    assert results[1 - onto] == (
        "ZeroRedundancyOptimizer.state_dict(): call consolidate_state_dict(to=rank) on every rank first, "
        "then state_dict() on that rank"
    )
