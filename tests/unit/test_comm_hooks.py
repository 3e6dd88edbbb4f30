"""``app.parallel.ddp.comm_hooks`` on 2 real gloo ranks, each hook called as a DDP calls it, on a bucket: the plain
average, the compressed one on a full-precision bucket (PyTorch's DDP hands those, and ours with
``gradient_as_bucket_view``) and on our compressed bucket (``Exchange``), and PyTorch's DDP taking our hooks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.parallel.ddp.buckets import GradBucket
from app.parallel.ddp.comm_hooks import HOOKS, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from app.world import run_world

VALUES = [[1.0, 2.0, 3.0, 1000.0, -7.0], [3.0, 5.0, -3.0, 1001.0, 0.5]]  # rank 0's and rank 1's gradients


def bucket(rank: int, wire_dtype=None) -> GradBucket:
    b = GradBucket(0, [nn.Parameter(torch.zeros(5))], [0], is_last=True, wire_dtype=wire_dtype)
    b.buffer().copy_(torch.tensor(VALUES[rank]))
    return b


def hooks_on_buckets(rank: int, world: int) -> dict:
    out = {"allreduce": allreduce_hook(None, bucket(rank)).wait().clone()}
    for name, hook in (("fp16", fp16_compress_hook), ("bf16", bf16_compress_hook)):
        full = bucket(rank)
        got = hook(None, full).wait()
        out[name] = (got.dtype, got.clone(), got.data_ptr() == full.buffer().data_ptr())
        compressed = bucket(rank, hook.wire_dtype)
        out[f"{name} compressed"] = hook(None, compressed).wait().clone()
    # PyTorch's DDP takes our hooks as its own (their return annotation is the type it checks).
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, bf16_compress_hook)
    x = torch.full((2, 4), float(rank + 1))
    F.mse_loss(ddp(x), torch.zeros(2, 1)).backward()
    out["torch"] = model.weight.grad.clone()
    local = nn.Linear(4, 1)
    local.load_state_dict(model.state_dict())
    F.mse_loss(local(x), torch.zeros(2, 1)).backward()
    out["local"] = local.weight.grad.clone()
    return out


def test_each_hook_averages_a_bucket_over_the_ranks_as_a_ddp_calls_it():
    ranks = run_world(hooks_on_buckets, 2)
    exact = torch.tensor(VALUES).mean(0)
    for r in ranks:
        assert torch.equal(r["allreduce"], exact)  # the sum divided by the world size, exactly
        for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            got_dtype, got, in_place = r[name]
            # A full-precision bucket: cast, divided, summed on the wire, written back into the bucket's buffer.
            halves = sum(torch.tensor(v).to(dtype).div_(2) for v in VALUES)
            assert got_dtype == torch.float32 and in_place and torch.equal(got, halves.float()), name
            # Our compressed bucket (each gradient already in the wire dtype): averaged in fp32, rounded once.
            wire = torch.tensor(VALUES).to(dtype).float().mean(0).to(dtype)
            assert torch.equal(r[f"{name} compressed"], wire), name
    assert torch.equal(ranks[0]["torch"], ranks[1]["torch"])
    average = (ranks[0]["local"] + ranks[1]["local"]) / 2
    assert torch.allclose(ranks[0]["torch"], average, rtol=1e-2)


def test_the_hooks_are_named_for_their_wire_dtype_and_listed_by_their_setting():
    assert fp16_compress_hook.__name__ == "float16_compress_hook" and fp16_compress_hook.wire_dtype == torch.float16
    assert bf16_compress_hook.__name__ == "bfloat16_compress_hook" and bf16_compress_hook.wire_dtype == torch.bfloat16
    assert "torch.bfloat16" in bf16_compress_hook.__doc__ and not hasattr(allreduce_hook, "wire_dtype")
    assert {"allreduce": allreduce_hook, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook} == HOOKS
