"""ZeRO stage 3 (our FullyShardedDataParallel) on real gloo ranks: against one process, our DDP, PyTorch's
ZeroRedundancyOptimizer and PyTorch's ``fully_shard`` (FSDP2), in fp32 and in bf16; what it keeps; its errors.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from app.parallel.ddp import DistributedDataParallel as DDP
from app.parallel.zero.stage3 import FullyShardedDataParallel
from app.worker.models import Block, TinyTransformer, parameter_checksum
from app.world import run_world
from tests.integration.test_zero import (
    LR,
    PARAM_TOL,
    PER_RANK,
    Skips,
    assert_walks_with_everyone,
    batch,
    build,
    train_stage,
    wrap,
)

# Measured (docs/sharding.md): bf16/fp16 compute against PyTorch's fully_shard with the same policy, 3 AdamW steps:
# worst |dparam| 0 (the same roundings: both gather low-precision copies of fp32 shards and reduce-scatter
# low-precision gradients). Against the fp32 single-process run the gap is 2e-2 after one step, 4.4e-2 after three:
# AdamW divides each gradient by its own RMS, so an element whose gradient is rounding noise moves by ~lr in a
# random direction. That comparison can only be bounded by what AdamW can move at all (2 lr per step, NaN fails).
# fp16 only: PyTorch divides by sqrt(N) before and after the fp16 reduce-scatter (an overflow guard); we sum in fp16
# and divide in fp32. Measured 3.5e-6 after 3 steps.
LOW_PRECISION_VS_TORCH_TOL = {"bfloat16": 1e-6, "float16": 1e-5}
# TinyTransformer (tied embedding/head, attention, LayerNorm) against our DDP, both AdamW: measured 0.0 on 2 ranks
# (a reduce-scatter adds the same two numbers per element as the all-reduce). Against one process it would be ~1e-4:
# AdamW divides each gradient by its own RMS, so an element whose gradient is rounding noise moves by ~lr.
TRANSFORMER_VS_DDP_TOL = PARAM_TOL


@pytest.mark.parametrize(
    ("world", "kind", "accum"),
    [(2, "mlp", 1), (4, "mlp", 2), (2, "tied", 1), (4, "tied", 2), (2, "frozen", 2), (4, "frozen", 1)],
)
def test_stage3_walks_with_one_process_ddp_and_torch_zero(world, kind, accum):
    results = run_world(train_stage, world, 3, kind, accum, timeout=300)
    assert_walks_with_everyone(results, 3)


@pytest.mark.parametrize(
    ("world", "kind", "options"),
    [(2, "mlp", {"prefetch": 1}), (4, "tied", {"prefetch": 2}), (2, "frozen", {"reshard_after_forward": False})],
)
def test_stage3_prefetching_walks_with_one_process_ddp_and_torch_zero(world, kind, options):
    results = run_world(train_stage, world, 3, kind, 2, 4, options, timeout=300)
    assert_walks_with_everyone(results, 3)


# --------------------------------------------------------------------------------------------------------------------
# Against PyTorch's fully_shard (FSDP2), fp32 and bf16
# --------------------------------------------------------------------------------------------------------------------
def vs_fully_shard(rank, world, kind, dtype_name, accum=1, steps=3, reduce_name="", options=None):
    """``reduce_name``: the gradients' reduce dtype (both sides); "" for the compute dtype, as PyTorch's default.
    ``options``: our wrapper's other settings (``prefetch``, ``reshard_after_forward``)."""
    dtype = getattr(torch, dtype_name) if dtype_name else None
    reduce_dtype = getattr(torch, reduce_name) if reduce_name else dtype
    torch.manual_seed(0)
    base = build(kind)
    ours_model, theirs_model, reference = (copy.deepcopy(base) for _ in range(3))
    ours = FullyShardedDataParallel(ours_model, compute_dtype=dtype, reduce_dtype=reduce_dtype, **(options or {}))
    opt = torch.optim.AdamW(ours.parameters(), lr=LR)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=reduce_dtype, output_dtype=torch.float32 if dtype else None
    )
    # Units as ours by default: each child of the root, then the root (which takes what is left). PyTorch refuses a
    # tied parameter in two groups, so children sharing one are left to the root (ours puts just the tied tensor
    # there: the layouts differ, the arithmetic does not).
    holders: dict[int, int] = {}
    for child in theirs_model.children():
        for p in child.parameters():
            holders[id(p)] = holders.get(id(p), 0) + 1
    for child in theirs_model.children():
        params = list(child.parameters())
        if any(p.requires_grad for p in params) and all(holders[id(p)] == 1 for p in params):
            fully_shard(child, mesh=mesh, mp_policy=policy)
    fully_shard(theirs_model, mesh=mesh, mp_policy=policy)
    theirs_opt = torch.optim.AdamW(theirs_model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR)
    vs_torch, vs_fp32 = [], []
    for step in range(steps):
        x, y = batch(step, PER_RANK * world * accum)
        for model, o in ((ours, opt), (theirs_model, theirs_opt)):
            o.zero_grad()
            for i in range(accum):  # both reduce-scatter every micro-batch and add into the sharded gradient
                mine = slice((rank * accum + i) * PER_RANK, (rank * accum + i + 1) * PER_RANK)
                (F.mse_loss(model(x[mine]), y[mine]) / accum).backward()
            o.step()
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        state = ours.full_state_dict()
        theirs_full = {n: _full(p) for n, p in theirs_model.named_parameters()}
        if rank == 0:
            vs_torch.append(max((state[n] - t).abs().max().item() for n, t in theirs_full.items()))
            vs_fp32.append(max((state[n] - p).abs().max().item() for n, p in reference.named_parameters()))
    return vs_torch, vs_fp32


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()


@pytest.mark.parametrize(("world", "kind", "accum"), [(2, "mlp", 1), (4, "tied", 1), (2, "frozen", 2)])
def test_fp32_equals_pytorchs_fully_shard(world, kind, accum):
    vs_torch, vs_fp32 = run_world(vs_fully_shard, world, kind, None, accum, timeout=300)[0]
    assert max(vs_torch) <= PARAM_TOL, vs_torch
    assert max(vs_fp32) <= PARAM_TOL, vs_fp32


@pytest.mark.parametrize("options", [{"prefetch": 1}, {"prefetch": 2, "reshard_after_forward": False}], ids=str)
def test_prefetching_equals_pytorchs_fully_shard(options):
    """PyTorch's fully_shard prefetches one unit too; ours with prefetch and resharding on or off: the same steps."""
    vs_torch, vs_fp32 = run_world(vs_fully_shard, 2, "mlp", None, 2, 3, "", options, timeout=300)[0]
    assert max(vs_torch) <= PARAM_TOL, vs_torch
    assert max(vs_fp32) <= PARAM_TOL, vs_fp32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_compute_equals_pytorchs_fully_shard_with_the_same_policy(dtype):
    vs_torch, vs_fp32 = run_world(vs_fully_shard, 2, "mlp", dtype, timeout=300)[0]
    assert max(vs_torch) <= LOW_PRECISION_VS_TORCH_TOL[dtype], vs_torch
    assert max(vs_fp32) <= 2 * LR * 3, vs_fp32
    assert max(vs_fp32) > 0  # it did compute in low precision: fp32 would agree to ~1e-8


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_compute_with_fp32_reduction_equals_pytorchs_with_that_policy(dtype):
    # Ours by default: gathered and computed in bf16/fp16, the gradients reduce-scattered in fp32.
    vs_torch, vs_fp32 = run_world(vs_fully_shard, 2, "mlp", dtype, 1, 3, "float32", timeout=300)[0]
    assert max(vs_torch) <= LOW_PRECISION_VS_TORCH_TOL[dtype], vs_torch
    assert 0 < max(vs_fp32) <= 2 * LR * 3, vs_fp32


def no_sync_vs_synced(rank, world, accum=3):
    """The same step with every micro-batch reduce-scattered, and with all but the last inside no_sync()."""
    results = {}
    for mode in ("synced", "no_sync"):
        torch.manual_seed(0)
        ours = FullyShardedDataParallel(build("mlp"))
        opt = torch.optim.AdamW(ours.parameters(), lr=LR)
        x, y = batch(0, PER_RANK * world * accum)
        for i in range(accum):
            mine = slice((rank * accum + i) * PER_RANK, (rank * accum + i + 1) * PER_RANK)
            inside = mode == "no_sync" and i < accum - 1
            with ours.no_sync() if inside else contextlib.nullcontext():
                (F.mse_loss(ours(x[mine]), y[mine]) / accum).backward()
        opt.step()
        results[mode] = (ours.full_state_dict(), ours.comm_bytes["reduce_scatter"])
    return results


def test_no_sync_reduce_scatters_once_and_steps_as_every_micro_batch_reduced():
    results = run_world(no_sync_vs_synced, 2, timeout=300)[0]
    (synced, synced_bytes), (kept, kept_bytes) = results["synced"], results["no_sync"]
    assert max((synced[n] - kept[n]).abs().max().item() for n in synced) <= PARAM_TOL
    assert kept_bytes * 3 == synced_bytes, (kept_bytes, synced_bytes)  # one reduce-scatter of the sum, not three


# --------------------------------------------------------------------------------------------------------------------
# A real model: TinyTransformer, one unit per Block, tied embedding and head
# --------------------------------------------------------------------------------------------------------------------
def transformer_vs_ddp(rank, world, by_class=True, steps=3):
    torch.manual_seed(0)
    base = TinyTransformer(layers=2)
    ours_model, ddp_model = copy.deepcopy(base), copy.deepcopy(base)
    ours = FullyShardedDataParallel(ours_model, units=[Block] if by_class else None)
    opt = torch.optim.AdamW(ours.parameters(), lr=LR)
    ddp = DDP(ddp_model)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    worst, freed_after_forward = 0.0, True
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 64, (2 * world, 16), generator=g)
        mine = tokens[rank * 2 : (rank + 1) * 2]
        for model, o in ((ours, opt), (ddp, ddp_opt)):
            o.zero_grad()
            out = model(mine)
            if model is ours:  # between forward and backward every Block holds 0 bytes of gathered parameters
                freed_after_forward &= all(u.full.untyped_storage().nbytes() == 0 for u in ours.units if u.name)
            F.cross_entropy(out.reshape(-1, 64), mine.roll(-1, 1).reshape(-1)).backward()
            o.step()
        state = ours.full_state_dict()
        if rank == 0:
            worst = max(worst, max((state[n] - p).abs().max().item() for n, p in ddp_model.named_parameters()))
    units = [(u.name, u.flat_shard.total, u.shard.numel()) for u in ours.units]
    # The bare model takes the full state dict as it is (strict): the same keys, tied ones included.
    loaded = None
    if rank == 0:
        bare = TinyTransformer(layers=2)
        loaded = bare.load_state_dict(state, strict=True)
        loaded = (
            str(loaded),
            bare.head.weight is bare.tok.weight,
            (bare.tok.weight - state["tok.weight"]).abs().max().item(),
        )
    return worst, freed_after_forward, units, loaded


@pytest.mark.parametrize(
    ("by_class", "expected_units"),
    [(True, ["", "blocks.0", "blocks.1"]), (False, ["", "pos", "blocks.0", "blocks.1", "norm"])],
)
def test_transformer_with_tied_head_equals_ddp(by_class, expected_units):
    """units=[Block], or the default: each child of the root, a ModuleList's items one by one. Either way the tied
    tok/head weight is in two units' reach, so it goes to the root unit."""
    results = run_world(transformer_vs_ddp, 2, by_class, timeout=300)
    worst, freed, units, loaded = results[0]
    assert worst <= TRANSFORMER_VS_DDP_TOL, worst
    assert all(r[1] for r in results), "a unit stayed gathered after its forward"
    assert [n for n, _, _ in units] == expected_units
    assert all(shard == -(-total // 2) for _, total, shard in units)  # each rank keeps half of each unit
    assert loaded == ("<All keys matched successfully>", True, 0.0)


def _checksums(rank: int, world: int, kind: str) -> tuple[str, str | None]:
    """After one step: the sharded model's streamed checksum (every rank) and the gathered whole model's (rank 0)."""
    model = build(kind) if kind != "transformer" else TinyTransformer(layers=2)
    wrapped, opt = wrap(3, copy.deepcopy(model), units=[Block] if kind == "transformer" else None)
    x = torch.randint(0, 64, (2, 16)) if kind == "transformer" else batch(0, PER_RANK)[0]
    wrapped(x).float().pow(2).mean().backward()
    opt.step()
    state = wrapped.full_state_dict()
    whole = None
    if rank == 0:
        model.load_state_dict(state)
        whole = parameter_checksum(model)
    return wrapped.parameter_checksum(), whole


@pytest.mark.parametrize("kind", ["mlp", "tied", "frozen", "transformer"])
def test_the_streamed_checksum_is_the_whole_models_on_every_rank(kind):
    """FINISHED's checksum under zero3, one unit at a time: the bytes and order of the whole model's (tied weights
    in the root unit, frozen ones never sharded, units the parameter order visits out of turn)."""
    results = run_world(_checksums, 2, kind, timeout=300)
    assert results[0][0] == results[1][0] == results[0][1], results


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------
def test_units_naming_no_module_are_a_one_line_error():
    with pytest.raises(ValueError, match=r"names no submodule of MiniMLP") as info:
        FullyShardedDataParallel(build("mlp"), units=[Block])
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"'blocks\.9' names no submodule"):
        FullyShardedDataParallel(build("mlp"), units=["blocks.9"])


def _unused_params(rank, world):
    wrapped = FullyShardedDataParallel(Skips())
    try:
        wrapped(torch.randn(2, 8)).sum().backward()  # forward never calls the unit `unused`
    except RuntimeError as e:
        return str(e)
    return None


def test_a_unit_without_gradient_is_a_clear_error_not_a_hang():
    message = run_world(_unused_params, 2, timeout=60)[0]
    assert message is not None and "units unused did not get every parameter's gradient" in message
