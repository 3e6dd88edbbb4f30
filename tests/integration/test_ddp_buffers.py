"""Buffers (BatchNorm's running stats) under ``no_sync()`` accumulation: ours synced exactly when PyTorch's DDP is.

PyTorch's DDP broadcasts rank 0's buffers before a forward when the *previous* forward was a synchronising one
(``require_forward_param_sync``, set in its post-forward), and before the very first. With K micro-batches per step
that is the first micro-batch's forward, not the last's: the last one runs on the stats this rank accumulated over
the earlier micro-batches. Ours must do the same, or the two wrappers train different BatchNorm statistics (and,
through them, different parameters) from the same data.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from app.parallel.ddp import DistributedDataParallel as DDP
from app.world import run_world

K = 3  # micro-batches per optimizer step: K-1 under no_sync(), the last one synchronising
STEPS = 4


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))


def micro_batch(rank: int, step: int, micro: int):
    # Different data on every rank, scaled and shifted by rank, so the ranks' local BN stats really diverge.
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(8, 8, generator=g) * (rank + 1) + rank
    return x, torch.randn(8, 8, generator=g)


def state_of(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def accumulate_with_both_wrappers(rank, world, evaluate_between_steps):
    """K-micro-batch steps on ours and on PyTorch's DDP from the same start; both states after every step."""
    base = build_model()
    wrapped = {"ours": DDP(copy.deepcopy(base)), "torch": TorchDDP(copy.deepcopy(base))}
    opts = {name: torch.optim.SGD(w.parameters(), lr=0.1, momentum=0.9) for name, w in wrapped.items()}
    states = {name: [] for name in wrapped}
    eval_outputs = {name: [] for name in wrapped}
    running_means = []  # PyTorch's wrapper's, after each step: for the control
    for step in range(STEPS):
        for name, ddp in wrapped.items():
            ddp.train()
            opts[name].zero_grad()
            for micro in range(K):
                x, y = micro_batch(rank, step, micro)
                if micro < K - 1:
                    with ddp.no_sync():
                        (F.mse_loss(ddp(x), y) / K).backward()
                else:
                    (F.mse_loss(ddp(x), y) / K).backward()
            opts[name].step()
            if name == "torch":  # before any evaluation forward, which starts by syncing them
                running_means.append(ddp.module[1].running_mean.tolist())
            if evaluate_between_steps:
                # An evaluation forward without grad: PyTorch syncs buffers before it (the previous forward
                # synchronised) and then not before the next training forward (this one did not).
                ddp.eval()
                with torch.no_grad():
                    eval_outputs[name].append(ddp(micro_batch(rank, step, K)[0]))
            states[name].append(state_of(ddp.module))
    gathered = [None] * world
    dist.all_gather_object(gathered, running_means)
    return states, eval_outputs, gathered


@pytest.mark.parametrize("evaluate_between_steps", [False, True], ids=["train-only", "eval-forward-between-steps"])
def test_buffers_and_parameters_equal_pytorchs_under_no_sync_accumulation(evaluate_between_steps):
    for rank, (states, eval_outputs, running_means) in enumerate(
        run_world(accumulate_with_both_wrappers, 2, evaluate_between_steps)
    ):
        for step, (ours, theirs) in enumerate(zip(states["ours"], states["torch"])):
            # Bitwise: with 2 ranks, SUM-then-halve (ours) and halve-then-SUM (PyTorch) round identically, and the
            # buffers are the same local BatchNorm updates from the same broadcast starting point.
            unequal = [i for i, (a, b) in enumerate(zip(ours, theirs)) if not torch.equal(a, b)]
            assert not unequal, f"rank {rank}, after step {step}: tensors {unequal} differ from PyTorch's DDP"
        for ours, theirs in zip(eval_outputs["ours"], eval_outputs["torch"]):
            assert torch.equal(ours, theirs), f"rank {rank}: an evaluation forward differs from PyTorch's DDP"
        # Control: the ranks' running stats differ at the end of a step, so a broadcast at the wrong forward shows.
        assert running_means[0] != running_means[1]
