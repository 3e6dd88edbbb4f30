"""Our DDP under ``torch.compile`` (app/parallel/compile.py) on real gloo ranks, its module compiled whole and cut at
the buckets (``compile_at_buckets``, what the worker does) or one unit at a time (``compile_units``): the buckets
still all-reduce while backward runs, and the parameters after a few steps equal PyTorch's DDP under compile and one
process.

Backend ``aot_eager`` (the graphs dynamo and AOTAutograd make, run eagerly): what is proven is how the graph is cut
and what it computes, in seconds; inductor's code generation is not what is under test (test_dropin.py runs it).

    .venv/bin/python -m pytest -q tests/integration/test_ddp_compile.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from app.parallel.compile import compile_at_buckets, compile_units
from app.parallel.ddp import DistributedDataParallel as OurDDP
from app.world import run_world

UNITS, WIDTH, STEPS, PER_RANK = 4, 64, 3, 8
# One bucket per unit: a unit holds 2 × (64 × 64 + 64) fp32 = 33,280 bytes, and a bucket closes at >= 20 KiB.
BUCKET_CAP_MB = 0.02
TOL = 1e-5  # float32, three SGD steps: the runs differ by summation order only (all-reduce vs one batch)


def stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)) for _ in range(UNITS))
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (both ranks' halves): rank r trains on rows r × PER_RANK..."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2 * PER_RANK, WIDTH, generator=g), torch.randn(2 * PER_RANK, WIDTH, generator=g)


def train(model: nn.Module, forward, rank: int | None, launches: list[str]) -> tuple[list[float], list[int], str]:
    """STEPS steps of SGD through ``forward``; per step, the all-reduces launched before backward reached the input
    (``launches`` is filled by the wrapper's comm hook), and the output's autograd node. ``rank`` None: one process
    on the whole batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    early, last_node = [], None
    for step in range(STEPS):
        x, y = batch(step)
        if rank is not None:
            x, y = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
        x.requires_grad_(True)  # its gradient is the last thing backward computes: the end of the units' backward
        launches.clear()
        x.register_hook(lambda g: launches.append("input"))
        opt.zero_grad()
        out = forward(x)
        last_node = type(out.grad_fn).__name__  # CompiledFunctionBackward: the last unit did compile
        F.mse_loss(out, y).backward()
        early.append(launches.index("input") if "input" in launches else len(launches))
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(), early, last_node


def counting(launches: list[str]):
    """A comm hook that notes each bucket's launch, then averages it as the built-in one does (both wrappers)."""

    def hook(state, bucket):
        launches.append(f"bucket {bucket.index()}")
        fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    return hook


def compiled_runs(rank: int, world: int) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    out = {}
    for name in ("ours at buckets", "ours per unit", "ours whole", "torch"):
        model, launches = stack(), []
        if name == "ours per unit":
            compile_units(model, backend="aot_eager")  # each of the 4 units on its own
        elif name == "ours whole":
            compile_units([model], backend="aot_eager")  # the model as one unit: one backward node
        # torch's DDPOptimizer refuses buckets under its 1 MiB first bucket: this model is one bucket there.
        wrapper = TorchDDP(model, bucket_cap_mb=1) if name == "torch" else OurDDP(model, bucket_cap_mb=BUCKET_CAP_MB)
        wrapper.register_comm_hook(None, counting(launches))
        if name == "ours at buckets":
            compile_at_buckets(wrapper, backend="aot_eager")  # the model whole, cut where each bucket closes
        # PyTorch's DDP compiled the way its docs say: the wrapper whole, split at its buckets by the DDPOptimizer.
        forward = torch.compile(wrapper, backend="aot_eager") if name == "torch" else wrapper
        out[name] = train(model, forward, rank, launches)
    return out


def test_ours_compiled_at_buckets_and_per_unit_overlap_and_equal_torchs_compiled_ddp_and_one_process():
    ranks = run_world(compiled_runs, 2, timeout=600)
    reference = stack()
    single = train(reference, reference, None, [])[0]
    for out in ranks:
        params, early, node = out["ours per unit"]
        nodes = {k: v[2] for k, v in out.items() if k != "torch"}
        assert set(nodes.values()) == {"CompiledFunctionBackward"}, nodes
        # Units 3, 2, 1's buckets launched while unit 0's backward had yet to run: the overlap eager mode has,
        # whether each unit is a graph or the model is one graph cut where each of its buckets closes.
        assert early == out["ours at buckets"][1] == [UNITS - 1] * STEPS, (early, out["ours at buckets"][1])
        assert max(abs(a - b) for a, b in zip(out["ours at buckets"][0], out["torch"][0])) <= TOL
        # The same counting sees none when the model is compiled whole: every gradient comes out at the end.
        assert out["ours whole"][1] == [0] * STEPS, out["ours whole"][1]
        assert max(abs(a - b) for a, b in zip(params, out["torch"][0])) <= TOL
        assert max(abs(a - b) for a, b in zip(params, single)) <= TOL
        assert max(abs(a - b) for a, b in zip(params, out["ours whole"][0])) <= TOL
        print("launches before the input's gradient, per step:", {k: v[1] for k, v in out.items()})
    for name in ("ours at buckets", "ours per unit"):
        assert ranks[0][name][0] == ranks[1][name][0], name  # the ranks agree bit for bit
