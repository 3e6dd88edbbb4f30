"""16-bit gradients on the wire with our wrapper: the average is taken in fp32 and rounded once, the same on every rank.

With a compression hook (``app.parallel.ddp.comm_hooks``) our wrapper casts each gradient into a 16-bit bucket, and on
CPU the hook averages it by direct exchange (``Exchange``): each rank averages its part of the bucket in fp32 and
rounds once. So the gradient every rank ends with is the exact average of the 16-bit gradients, rounded once to
16 bits (at world 2 exactly; beyond, within one rounding). Real gloo ranks, at world sizes 2 and 3 (parts of
unequal size, parts left empty by a one-element bucket), with several buckets and with unused parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app.parallel.ddp import DistributedDataParallel as DDP
from app.parallel.ddp.comm_hooks import bf16_compress_hook, fp16_compress_hook
from app.world import run_world

HOOKS = {torch.bfloat16: bf16_compress_hook, torch.float16: fp16_compress_hook}


class Model(nn.Module):
    """Two layers, a one-element parameter (a bucket smaller than the world) and an optional unused branch."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 40)
        self.b = nn.Linear(40, 5)
        self.gain = nn.Parameter(torch.ones(1))
        self.spare = nn.Linear(40, 5)

    def forward(self, x, use_spare: bool = True):
        h = torch.tanh(self.a(x))
        return self.gain * (self.b(h) + (self.spare(h) if use_spare else 0))


def local_gradients(model: nn.Module, x, y, use_spare: bool) -> list[torch.Tensor]:
    plain = copy.deepcopy(model)
    F.mse_loss(plain(x, use_spare), y).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in plain.parameters()]


def compressed_average(rank, world, dtype, find_unused):
    torch.manual_seed(0)
    base = Model()
    # 64-byte buckets: every parameter a bucket of its own, several exchanges in flight at once
    ddp = DDP(copy.deepcopy(base), bucket_cap_mb=64 / 2**20, find_unused_parameters=find_unused)
    ddp.register_comm_hook(None, HOOKS[dtype])
    worst_ulps, max_rel_to_fp32, same_everywhere = 0.0, 0.0, True
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(6, 16, generator=g), torch.randn(6, 5, generator=g)
        use_spare = not find_unused or (step + rank) % 2 == 0  # with find_unused: unused on some ranks, some steps
        ddp.zero_grad(set_to_none=True)
        F.mse_loss(ddp(x, use_spare), y).backward()
        mine = local_gradients(ddp.module, x, y, use_spare)
        for p, local in zip(ddp.module.parameters(), mine):
            everyone = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(everyone, local)
            wire = torch.stack([t.to(dtype).double() for t in everyone])  # what each rank put on the wire
            expected = wire.mean(0).to(dtype).double()  # their exact average, rounded once
            exact = torch.stack(everyone).double().mean(0)
            got = torch.zeros_like(exact) if p.grad is None else p.grad.double()
            ulp = expected.abs().clamp_min(1e-30) * torch.finfo(dtype).eps
            worst_ulps = max(worst_ulps, ((got - expected).abs() / ulp).max().item())
            max_rel_to_fp32 = max(max_rel_to_fp32, ((got - exact).abs().max() / exact.abs().max()).item())
            gathered = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(gathered, got)
            same_everywhere &= all(torch.equal(t, got) for t in gathered)
    return worst_ulps, max_rel_to_fp32, same_everywhere


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_average_is_rounded_once_and_the_same_on_every_rank(world, dtype):
    for worst_ulps, rel, same in run_world(compressed_average, world, dtype, False):
        assert same  # every rank holds bit-for-bit the same averaged gradient
        # world 2: the exact average of the two 16-bit values, rounded once. World 3: the sum is exact in fp32,
        # multiplied by 1/3 in fp32 then rounded to 16 bits: within one unit in the last place.
        assert worst_ulps <= (0.0 if world == 2 else 1.0), worst_ulps
        assert rel <= (8e-3 if dtype == torch.bfloat16 else 1e-3), rel  # against the fp32 average


def test_exchanges_keep_their_order_beside_the_unused_parameters_all_reduce():
    # find_unused_parameters adds one all-reduce at the end of backward, between the exchanges' two halves
    for worst_ulps, rel, same in run_world(compressed_average, 3, torch.bfloat16, True):
        assert same and worst_ulps <= 1.0 and rel <= 8e-3
