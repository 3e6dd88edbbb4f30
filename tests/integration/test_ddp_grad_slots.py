"""Large gradients handed their bucket slot as ``p.grad`` (no copy back), and only where no caller could tell.

Our reducer skips PyTorch's last pass over the gradients, the copy from the bucket back into ``p.grad``, by making
``p.grad`` of a large gradient whose ``p.grad`` was None a view of its bucket slot (``reducer._plan_lending``).
Each test trains ours and PyTorch's DDP side by side on real gloo ranks and asserts what a user would notice:
the same parameters and gradients, a gradient kept from an earlier step unchanged, ``p.grad`` kept by
``zero_grad(set_to_none=False)`` the same tensor from step to step, and the memory saved.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from app.parallel.ddp import DistributedDataParallel as DDP
from app.parallel.ddp.reducer import GROUP_NUMEL
from app.world import run_world

TOL = 1e-6
WIDTH = 300  # a 300 x 300 weight (90,000 elements) is large (lent), its bias and the head's weight are small


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 8))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, 8, generator=g)


def pair():
    """(ours, PyTorch's), same weights, each with its own SGD with momentum."""
    base = model()
    ours, theirs = DDP(copy.deepcopy(base)), TorchDDP(copy.deepcopy(base))
    return [(w, torch.optim.SGD(w.parameters(), lr=0.1, momentum=0.9)) for w in (ours, theirs)]


def step(wrapped, opt, step_no: int, rank: int, set_to_none: bool = True, accumulate: int = 1) -> None:
    opt.zero_grad(set_to_none=set_to_none)
    for micro in range(accumulate):
        x, y = batch(10 * step_no + micro, rank)
        if micro < accumulate - 1:
            with wrapped.no_sync():
                F.mse_loss(wrapped(x), y).backward()
        else:
            F.mse_loss(wrapped(x), y).backward()
    opt.step()


def max_diff(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a, b))


def in_a_bucket(ddp: DDP, t: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() in {b.buffer().untyped_storage().data_ptr() for b in ddp.reducer.buckets}


def lent_training(rank, world, set_to_none, accumulate):
    (ours, opt_ours), (theirs, opt_theirs) = pair()
    identities, buffers = [], []
    for s in range(4):
        for wrapped, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            step(wrapped, opt, s, rank, set_to_none, accumulate)
        identities.append([id(p.grad) for p in ours.parameters()])
        buffers.append([b.buffer().data_ptr() for b in ours.reducer.buckets])
    big = ours.module[0].weight
    return {
        "params": max_diff(ours.parameters(), theirs.parameters()),
        "grads": max_diff([p.grad for p in ours.parameters()], [p.grad for p in theirs.parameters()]),
        "big_in_bucket": in_a_bucket(ours, big.grad),
        "small_in_bucket": [in_a_bucket(ours, p.grad) for p in ours.parameters() if p.numel() <= GROUP_NUMEL],
        "same_tensors": identities[-1] == identities[-2] == identities[-3],
        "same_buckets": buffers[0] == buffers[-1],
        "grad_bytes": ours.gradient_bytes(),
        "bucket_bytes": sum(ours.bucket_sizes),
    }


@pytest.mark.parametrize(
    "set_to_none, accumulate",
    [(True, 1), (False, 1), (True, 3)],
    ids=["zero_grad-set_to_none", "zero_grad-keep", "no_sync-accumulation"],
)
def test_training_equals_pytorchs_whether_a_slot_is_lent_kept_or_copied(set_to_none, accumulate):
    for r in run_world(lent_training, 2, set_to_none, accumulate):
        assert r["params"] <= TOL and r["grads"] <= TOL, r
        assert not any(r["small_in_bucket"])  # small gradients keep their own tensor (copied back)
        assert r["same_buckets"]  # nobody else held a bucket: it was never replaced by a new one
        if accumulate == 1:
            # p.grad was None (or its slot) at every synchronising backward: the large gradient lives in its bucket
            assert r["big_in_bucket"]
            assert r["grad_bytes"] < 1.5 * r["bucket_bytes"]  # stored once, not twice (bucket + p.grad)
        else:
            # accumulated under no_sync() in a tensor of its own: averaged into that tensor, as with PyTorch
            assert not r["big_in_bucket"]
        if not set_to_none:
            assert r["same_tensors"]  # zero_grad(set_to_none=False) keeps p.grad the same tensor, as PyTorch's


def kept_gradient(rank, world, keep):
    """The caller keeps step 1's gradient (the tensor itself, or a detached alias of it), then steps again."""
    (ours, opt_ours), (theirs, opt_theirs) = pair()
    step(ours, opt_ours, 0, rank)
    grad = ours.module[0].weight.grad
    held, values = (grad if keep == "tensor" else grad.detach()), grad.clone()
    del grad  # one reference kept, no more: the reducer must see exactly that one
    step(ours, opt_ours, 1, rank)
    grad_after = ours.module[0].weight.grad.clone()
    unchanged = torch.equal(held, values)
    del held  # nobody holds step 1's bucket any more: later steps may lend slots again
    step(ours, opt_ours, 2, rank)
    for s in range(3):
        step(theirs, opt_theirs, s, rank)
    return {
        "unchanged": unchanged,
        "changed_meanwhile": not torch.equal(grad_after, values),
        "params": max_diff(ours.parameters(), theirs.parameters()),
        "big_in_bucket_again": in_a_bucket(ours, ours.module[0].weight.grad),
    }


@pytest.mark.parametrize("keep", ["tensor", "detached alias"])
def test_a_gradient_kept_from_an_earlier_step_keeps_its_values(keep):
    for r in run_world(kept_gradient, 2, keep):
        assert r["changed_meanwhile"]  # the next step's gradient differs, so an overwrite would show
        assert r["unchanged"], r
        assert r["params"] <= TOL
        assert r["big_in_bucket_again"]  # once let go, the slot is lent again


def one_gradient_set_to_none(rank, world):
    """The caller clears one large gradient by hand and keeps the others between steps (a mix of lent and kept)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 8))
    ours, theirs = DDP(copy.deepcopy(base), bucket_cap_mb=25), TorchDDP(copy.deepcopy(base), bucket_cap_mb=25)
    for s in range(4):
        for wrapped in (ours, theirs):
            wrapped.zero_grad(set_to_none=False)
            wrapped.module[2].weight.grad = None
            x, y = batch(s, rank)
            F.mse_loss(wrapped(x), y).backward()
    return max_diff([p.grad for p in ours.parameters()], [p.grad for p in theirs.parameters()])


def test_lent_kept_and_copied_gradients_in_one_bucket_equal_pytorchs():
    assert max(run_world(one_gradient_set_to_none, 2)) <= TOL


class Branches(nn.Module):
    """Large layers on both branches: ``wide`` (lent when used) is skipped on some ranks at some steps."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(WIDTH, WIDTH)
        self.wide = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x, use_wide: bool = True):
        h = torch.tanh(self.trunk(x))
        return self.head(torch.tanh(self.wide(h)) if use_wide else h)


def options_training(rank, world, options):
    torch.manual_seed(0)
    base = Branches()
    ours, theirs = DDP(copy.deepcopy(base), **options), TorchDDP(copy.deepcopy(base), **options)
    opts = [torch.optim.SGD(w.parameters(), lr=0.1, momentum=0.9) for w in (ours, theirs)]
    worst = 0.0
    for s in range(5):
        x, y = batch(s, rank)
        use_wide = not options.get("find_unused_parameters") or (s + rank) % 3 != 0  # unused here, used there
        for wrapped, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            F.mse_loss(wrapped(x, use_wide), y).backward()
            opt.step()
        grads = [(p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters())]
        assert all((a is None) == (b is None) for a, b in grads)  # None where PyTorch leaves None
        worst = max([worst] + [(a - b).abs().max().item() for a, b in grads if a is not None])
    return worst, max_diff(ours.parameters(), theirs.parameters()), in_a_bucket(ours, ours.module.trunk.weight.grad)


@pytest.mark.parametrize(
    "options", [{"find_unused_parameters": True}, {"static_graph": True}], ids=["find_unused", "static_graph"]
)
def test_lent_slots_with_unused_parameters_and_static_graphs_equal_pytorchs(options):
    for grads, params, lent in run_world(options_training, 3, options):
        assert grads <= TOL and params <= TOL
        assert lent  # the large trunk's gradient is its bucket slot
