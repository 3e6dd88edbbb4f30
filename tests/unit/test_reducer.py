"""``app.parallel.ddp.reducer`` on 2 real gloo ranks: what the reducer tells and promises besides the averaged
gradient (tests/integration/test_ddp*.py compare that with PyTorch's): its buckets and their bytes in launch order,
the divisor ``join()`` sets, the stats the metrics read, the flight recorder's record of each bucket, and the one
line a loss that uses a parameter outside forward gets."""

from __future__ import annotations

import torch
from torch import nn

from app.diagnostics.recorder import RECORDER
from app.parallel.ddp import DistributedDataParallel
from app.parallel.ddp.comm_hooks import fp16_compress_hook
from app.parallel.ddp.reducer import GROUP_NUMEL, Reducer
from app.world import run_world


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 8)  # 32 + 8 elements
        self.second = nn.Linear(8, 2)  # 16 + 2
        self.extra = nn.Linear(2, 2)  # not reached by forward

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def reducer_promises(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    out: dict = {}
    # Buckets of at most 100 bytes: bucket 0 is the last parameters registered (their gradients come first).
    ddp = DistributedDataParallel(Net(), bucket_cap_mb=100 / 2**20, find_unused_parameters=True)
    reducer: Reducer = ddp.reducer
    out["layout"] = ddp.bucket_layout()
    out["sizes"] = ddp.bucket_sizes
    out["buckets"] = [type(reducer.buckets).__name__, [b.index() for b in reducer.buckets]]
    out["last"] = [b.is_last() for b in reducer.buckets]
    x = torch.full((2, 4), float(rank + 1))  # a different input on each rank
    out["armed"] = [reducer.expect_autograd_hooks]
    with ddp.no_sync():
        ddp(x).sum().backward()  # accumulated locally: nothing sent, nothing counted
    out["armed"].append(reducer.expect_autograd_hooks)
    out["stats_after_no_sync"] = (ddp.stats.sync_calls, ddp.stats.buckets_reduced, ddp.stats.bytes_reduced)
    ddp.zero_grad(set_to_none=True)
    loss = ddp(x).sum()
    out["armed"].append(reducer.expect_autograd_hooks)
    seq = RECORDER.recorded
    loss.backward()
    out["armed"].append(reducer.expect_autograd_hooks)
    # The bucket all-reduces of that backward, as the flight recorder holds them (the doctor reads these).
    out["recorded"] = [(e[1], e[3], e[5], e[7] is not None) for e in RECORDER.entries()[-(RECORDER.recorded - seq) :]]
    out["stats"] = (ddp.stats.sync_calls, ddp.stats.buckets_reduced, ddp.stats.bytes_reduced)
    out["averaged"] = ddp.module.second.bias.grad.clone()
    # join()'s divisor: the ranks' gradients summed (divided by 1) from the next backward on.
    reducer.set_divisor(1)
    ddp.zero_grad(set_to_none=True)
    ddp(x).sum().backward()
    out["summed"] = ddp.module.second.bias.grad.clone()
    out["extra_grad"] = ddp.module.extra.weight.grad  # no rank used it: None, as with PyTorch
    # A loss that uses a parameter forward did not reach: one line naming it and the fix.
    reducer.set_divisor(world)
    try:
        (ddp(x).sum() + ddp.module.extra.weight.sum()).backward()
        out["outside"] = "no error"
    except RuntimeError as e:
        out["outside"] = str(e)
    # A compressed bucket still reports its full-precision bytes (what the logs and metrics show).
    torch.manual_seed(0)
    compressed = DistributedDataParallel(Net(), bucket_cap_mb=100 / 2**20, find_unused_parameters=True)
    assert not compressed.reducer.has_comm_hook
    compressed.register_comm_hook(None, fp16_compress_hook)
    out["compressed"] = (compressed.reducer.has_comm_hook, compressed.bucket_sizes)
    return out


def test_the_reducers_buckets_stats_divisor_and_refusal_are_what_it_promises():
    ranks = run_world(reducer_promises, 2)
    for rank, r in enumerate(ranks):
        # Parameters 0..5: first.weight (32), first.bias (8), second.weight (16), second.bias (2), extra (4, 2).
        # Reverse registration order, a bucket closing once it holds >= 100 bytes.
        assert r["layout"] == [[5, 4, 3, 2, 1], [0]], rank
        assert r["sizes"] == [(2 + 4 + 2 + 16 + 8) * 4, 32 * 4], rank
        assert r["buckets"] == ["tuple", [0, 1]] and r["last"] == [False, True], rank
        # Armed by a synchronising forward only, disarmed when its backward ends.
        assert r["armed"] == [False, False, True, False], rank
        assert r["stats_after_no_sync"] == (0, 0, 0), rank
        assert r["stats"] == (1, 2, (32 + 32) * 4), rank
        buckets = [e for e in r["recorded"] if e[2].startswith("DDP bucket")]
        assert buckets == [("all_reduce", 32 * 4, "DDP bucket 0", True), ("all_reduce", 32 * 4, "DDP bucket 1", True)]
        # d(sum)/d(second.bias) is the batch size (2) on every rank: the average is 2, the sum over 2 ranks 4.
        assert torch.equal(r["averaged"], torch.full((2,), 2.0)), rank
        assert torch.equal(r["summed"], torch.full((2,), 4.0)), rank
        assert r["extra_grad"] is None
        assert r["outside"].startswith("parameter 'extra.weight' got a gradient although forward's output does not")
        assert "route every use through forward" in r["outside"] and "\n" not in r["outside"]
        assert r["compressed"] == (True, r["sizes"]), rank
    assert GROUP_NUMEL == 64 * 1024
