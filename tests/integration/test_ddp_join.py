"""``with model.join():`` (uneven inputs) on our DDP, against PyTorch's, on real gloo ranks.

Rank r gets 2 + 2r batches, so the ranks run out one after the other; without join() the first to finish would
leave the others waiting in their next all-reduce forever. Asserted: the run ends (bounded by the world's timeout),
and the parameters equal PyTorch's DDP trained the same way, for both divisors (``divide_by_initial_world_size``),
with BatchNorm buffers, with ``find_unused_parameters``, with ``no_sync()`` accumulation and at world 3; every rank
ends with the same parameters; and the cases ours does not shadow are refused in one line.

    .venv/bin/python -m pytest tests/integration/test_ddp_join.py -q
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from app.parallel.ddp import DistributedDataParallel as DDP
from app.parallel.ddp.comm_hooks import allreduce_hook
from app.world import run_world


class Net(nn.Module):
    def __init__(self, batchnorm: bool, unused: bool):
        super().__init__()
        self.a = nn.Linear(6, 300)  # a large weight: lent its bucket slot (reducer._plan_lending)
        self.norm = nn.BatchNorm1d(300) if batchnorm else nn.Identity()
        self.b = nn.Linear(300, 3)
        self.spare = nn.Linear(3, 3) if unused else None  # never used in forward

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x))))


def batches(rank: int, world: int, lowest_last: bool = False):
    """2 + 2r batches for rank r; ``lowest_last``: the other way round, rank 0 has the most and joins last."""
    g = torch.Generator().manual_seed(rank)
    count = 2 + 2 * (world - 1 - rank if lowest_last else rank)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(count)]


def train(ddp, rank, world, divide, accumulate, spare_grads=None, lowest_last=False):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    with ddp.join(divide_by_initial_world_size=divide):
        for k, (x, y) in enumerate(batches(rank, world, lowest_last)):
            last = (k + 1) % accumulate == 0
            if last:
                F.mse_loss(ddp(x), y).backward()
                if spare_grads is not None and ddp.module.spare is not None:
                    spare_grads.append(ddp.module.spare.weight.grad)  # no rank uses it: None, joined ranks too
                opt.step()
                opt.zero_grad()
            else:
                with ddp.no_sync():
                    F.mse_loss(ddp(x), y).backward()
    return [t.detach().clone() for t in [*ddp.module.parameters(), *ddp.module.buffers()] if t.is_floating_point()]


def join_against_torch(rank, world, divide, batchnorm, unused, accumulate, lowest_last=False):
    torch.manual_seed(0)
    base = Net(batchnorm, unused)
    spare_grads = []
    ours = DDP(copy.deepcopy(base), find_unused_parameters=unused)
    ours = train(ours, rank, world, divide, accumulate, spare_grads, lowest_last)
    theirs = TorchDDP(copy.deepcopy(base), find_unused_parameters=unused)
    theirs = train(theirs, rank, world, divide, accumulate, lowest_last=lowest_last)
    assert all(g is None for g in spare_grads), "a layer no rank used got a gradient"
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs)), torch.cat([t.flatten() for t in ours])


@pytest.mark.parametrize(
    ("world", "divide", "batchnorm", "unused", "accumulate", "lowest_last"),
    [
        (2, True, False, False, 1, False),
        (2, False, False, False, 1, False),
        (2, True, True, False, 1, False),
        (3, False, True, True, 1, False),
        (3, True, False, False, 2, False),
        # Rank 0 joins last, the highest rank first: the final model must come from rank 0 (the last joiner), not
        # from the highest rank, which stopped stepping early.
        (3, True, True, False, 1, True),
    ],
    ids=[
        "world2",
        "divide-by-still-training",
        "batchnorm-buffers",
        "world3-unused-batchnorm",
        "world3-no_sync",
        "world3-rank0-joins-last",
    ],
)
def test_uneven_inputs_train_as_with_pytorchs_join(world, divide, batchnorm, unused, accumulate, lowest_last):
    results = run_world(join_against_torch, world, divide, batchnorm, unused, accumulate, lowest_last, timeout=240)
    for diff, _ in results:
        assert diff <= 1e-5
    assert all(torch.equal(results[0][1], state) for _, state in results)  # the last joiner's model, everywhere


def two_contexts(rank, world):
    # First divided by the ranks still training (down to 1 at the end), then by the world: the second join() must not
    # keep the first one's divisor.
    torch.manual_seed(0)
    base = Net(False, False)
    out = []
    for cls in (DDP, TorchDDP):
        ddp = cls(copy.deepcopy(base))
        train(ddp, rank, world, False, 1)
        out.append(train(ddp, rank, world, True, 1))
    return max((a - b).abs().max().item() for a, b in zip(*out))


def test_a_second_join_context_divides_by_its_own_rule():
    assert max(run_world(two_contexts, 2, timeout=240)) <= 1e-5


def refused(rank, world, case):
    skip = case == "skip_all_reduce_unused_params"
    ddp = DDP(
        Net(False, False),
        static_graph=case == "static_graph",
        find_unused_parameters=skip,
        skip_all_reduce_unused_params=skip,
    )
    if case == "hook":
        ddp.register_comm_hook(None, allreduce_hook)
    with ddp.join(enable=False):  # disabled: nothing to shadow, nothing refused (PyTorch's enable flag)
        pass
    try:
        ddp.join()
    except NotImplementedError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", ["hook", "static_graph", "skip_all_reduce_unused_params"])
def test_join_refuses_what_it_cannot_shadow_in_one_line(case):
    for message in run_world(refused, 2, case):
        assert message is not None and "\n" not in message
        assert ("comm hook" if case == "hook" else case) in message
