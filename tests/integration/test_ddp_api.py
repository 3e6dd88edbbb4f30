"""Our DistributedDataParallel takes PyTorch 2.13's constructor and its options do what PyTorch's do.

Every option is checked against ``torch.nn.parallel.DistributedDataParallel`` on the same real gloo ranks:
same arguments, same data, same results.
"""

from __future__ import annotations

import copy
import inspect
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from app.parallel.ddp import DistributedDataParallel as DDP
from app.parallel.ddp import reducer as reducer_module
from app.parallel.ddp.comm_hooks import allreduce_hook
from app.parallel.ddp.module import FIRST_BUCKET_BYTES
from app.parallel.probes import OursCommProbe, TorchCommProbe
from app.worker.models import DeepMLP, MiniMLP
from app.world import run_world

TOL = 1e-6
MiB = 1024 * 1024


class Branchy(nn.Module):
    """``never`` is never used; ``b`` only when asked: the shapes find_unused_parameters exists for."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)
        self.never = nn.Linear(16, 8)

    def forward(self, x, use_b: bool = False):
        h = torch.relu(self.trunk(x))
        return self.b(h) if use_b else self.a(h)


class Reversed(nn.Module):
    """Registers its layers in the opposite order to their use: reverse registration order is then the
    *worst* bucket order, the case static_graph's rebuild in arrival order is for."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def batch(step: int, size: int, features: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, features, generator=g), torch.randn(size, features, generator=g)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


# --------------------------------------------------------------------------------------------------------------------
# The signature itself: no process group needed
# --------------------------------------------------------------------------------------------------------------------
def test_constructor_signature_is_pytorchs_argument_for_argument():
    ours = inspect.signature(DDP.__init__).parameters
    theirs = inspect.signature(TorchDDP.__init__).parameters
    assert list(ours) == list(theirs)  # same names, same positional order
    assert {n: p.default for n, p in ours.items()} == {n: p.default for n, p in theirs.items()}


@pytest.mark.parametrize(
    "name, value",
    [
        ("mixed_precision", object()),
        ("device_mesh", object()),
        ("delay_all_reduce_named_params", [("w", nn.Parameter(torch.zeros(1)))]),
        ("param_to_hook_all_reduce", nn.Parameter(torch.zeros(1))),
        ("bucket_cap_mb_list", [1, 25]),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(name, value):
    with pytest.raises(NotImplementedError, match=f"^DistributedDataParallel\\({name}=") as info:
        DDP(MiniMLP(), **{name: value})
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------------------------------
# Construction rules, ours and PyTorch's side by side
# --------------------------------------------------------------------------------------------------------------------
def construction_errors(rank, world):
    cases = {
        "cpu module with device_ids": dict(device_ids=[0]),
        "two device_ids": dict(device_ids=[0, 1]),
        "cpu module with output_device": dict(output_device=1),
    }
    found = {}
    for case, kwargs in cases.items():
        for name, cls in (("ours", DDP), ("torch", TorchDDP)):
            try:
                cls(MiniMLP(), **kwargs)
                found[case, name] = None
            except ValueError as e:
                found[case, name] = str(e)
    try:
        DDP(MiniMLP(), dim=1)
    except ValueError as e:
        found["dim", "ours"] = str(e)
    DDP(MiniMLP(), None, None, 0)  # PyTorch's positional order: device_ids, output_device, dim
    return found


def test_device_ids_output_device_and_dim_errors_match_pytorch():
    found = run_world(construction_errors, 2)[0]
    for case in ("cpu module with device_ids", "two device_ids", "cpu module with output_device"):
        assert found[case, "torch"] is not None, case  # PyTorch refuses it ...
        assert found[case, "ours"] is not None and "\n" not in found[case, "ours"], case  # ... and so do we
    assert "device_ids" in found["two device_ids", "ours"] and "single element" in found["two device_ids", "ours"]
    assert "DDP(model)" in found["cpu module with device_ids", "ours"]
    assert "dim=1" in found["dim", "ours"]


def buffers_and_init_sync(rank, world):
    """What each of broadcast_buffers / forward_sync_buffers / init_sync does to parameters and buffers at
    construction, ours next to PyTorch's."""
    out = {}
    settings = {
        "default": {},
        "broadcast_buffers=False": dict(broadcast_buffers=False),
        "forward_sync_buffers=False": dict(forward_sync_buffers=False),
        "init_sync=False": dict(init_sync=False),
    }
    for label, kwargs in settings.items():
        for name, cls in (("ours", DDP), ("torch", TorchDDP)):
            torch.manual_seed(rank)  # different weights and buffers on every rank
            model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
            model[1].running_mean.fill_(float(rank))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ddp = cls(model, **kwargs)
            gathered = [None] * world
            dist.all_gather_object(gathered, (model[0].weight.sum().item(), model[1].running_mean[0].item()))
            out[label, name] = {
                "params_equal": gathered[0][0] == gathered[1][0],
                "buffers_equal": gathered[0][1] == gathered[1][1],
                "future_warning": any(issubclass(w.category, FutureWarning) for w in caught),
                "forward_sync": ddp.forward_sync_buffers,
            }
    return out


def test_buffer_and_init_sync_arguments_mean_what_pytorchs_mean():
    out = run_world(buffers_and_init_sync, 2)[0]
    for label in ("default", "broadcast_buffers=False", "forward_sync_buffers=False", "init_sync=False"):
        assert out[label, "ours"] == out[label, "torch"], (label, out[label, "ours"], out[label, "torch"])
    # The table the comparison above stands on, spelled out (so a change on both sides is noticed too).
    assert out["broadcast_buffers=False", "ours"]["buffers_equal"] is False
    assert out["broadcast_buffers=False", "ours"]["future_warning"] is True
    assert out["forward_sync_buffers=False", "ours"]["buffers_equal"] is True
    assert out["init_sync=False", "ours"]["params_equal"] is False
    assert out["default", "ours"] == {"params_equal": True, "buffers_equal": True, "future_warning": False,
                                      "forward_sync": True}  # fmt: skip


def check_reduction_is_accepted(rank, world):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DDP(MiniMLP(), check_reduction=True)
    ddp(torch.randn(2, 32)).sum().backward()
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def test_check_reduction_is_accepted_and_ignored_with_a_warning():
    for messages in run_world(check_reduction_is_accepted, 2):
        assert any("check_reduction" in m for m in messages)


# --------------------------------------------------------------------------------------------------------------------
# gradient_as_bucket_view
# --------------------------------------------------------------------------------------------------------------------
def bucket_view_training(rank, world, set_to_none, accumulate, model_kind):
    """Train ours and PyTorch's, both with gradient_as_bucket_view=True, on the same batches; compare."""
    torch.manual_seed(0)
    base = Branchy() if model_kind == "branchy" else MiniMLP(in_features=8, hidden=16, out_features=8)
    unused = model_kind == "branchy"
    models = {name: copy.deepcopy(base) for name in ("ours", "torch")}
    wrapped = {
        name: cls(models[name], gradient_as_bucket_view=True, find_unused_parameters=unused, bucket_cap_mb=0.0005)
        for name, cls in (("ours", DDP), ("torch", TorchDDP))
    }
    opts = {n: torch.optim.SGD(w.parameters(), lr=0.1, momentum=0.9) for n, w in wrapped.items()}
    grad_ptrs = []
    for step in range(4):
        x, y = batch(step, 4 * world * 2)
        for name, ddp in wrapped.items():
            opts[name].zero_grad(set_to_none=set_to_none)
            chunks = [slice((2 * rank + i) * 4, (2 * rank + i + 1) * 4) for i in range(2)]
            use_b = unused and rank == 1 and step % 2 == 1
            if accumulate:
                with ddp.no_sync():
                    (F.mse_loss(ddp(x[chunks[0]], *([use_b] if unused else [])), y[chunks[0]]) / 2).backward()
                (F.mse_loss(ddp(x[chunks[1]], *([use_b] if unused else [])), y[chunks[1]]) / 2).backward()
            else:
                F.mse_loss(ddp(x[chunks[0]], *([use_b] if unused else [])), y[chunks[0]]).backward()
            opts[name].step()
        ours = wrapped["ours"]
        grad_ptrs.append([None if p.grad is None else p.grad.data_ptr() for p in models["ours"].parameters()])
    bucket_storages = {b.buffer().untyped_storage().data_ptr() for b in ours.reducer.buckets}
    grads_in_buckets = [
        p.grad is None or p.grad.untyped_storage().data_ptr() in bucket_storages for p in models["ours"].parameters()
    ]
    return {
        "diff": max_diff(models["ours"], models["torch"]),
        "grads_in_buckets": grads_in_buckets,
        "grad_bytes": ours.gradient_bytes(),
        "bucket_bytes": sum(ours.bucket_sizes),
        "stable_ptrs": grad_ptrs[-1] == grad_ptrs[-2],
        "never_grad_none": models["ours"].never.weight.grad is None if unused else None,
    }


@pytest.mark.parametrize(
    "set_to_none, accumulate, model_kind",
    [(True, False, "mlp"), (False, False, "mlp"), (True, True, "mlp"), (False, True, "branchy")],
    ids=["zero_grad-set_to_none", "zero_grad-keep", "no_sync-accumulation", "find_unused_parameters"],
)
def test_gradient_as_bucket_view_equals_pytorch_and_stores_each_gradient_once(set_to_none, accumulate, model_kind):
    for r in run_world(bucket_view_training, 2, set_to_none, accumulate, model_kind, timeout=120):
        assert r["diff"] <= TOL
        assert all(r["grads_in_buckets"]), r["grads_in_buckets"]  # p.grad is a slice of a bucket
        assert r["grad_bytes"] == r["bucket_bytes"]  # so gradients cost nothing beyond the buckets
        if not set_to_none:
            assert r["stable_ptrs"]  # kept between steps, p.grad stays the very same slot: nothing is copied
        if model_kind == "branchy":
            assert r["never_grad_none"]  # unused everywhere: left None, as PyTorch does


def memory_with_and_without_view(rank, world):
    out = {}
    for view in (False, True):
        ddp = DDP(MiniMLP(), gradient_as_bucket_view=view)
        ddp(torch.randn(4, 32)).sum().backward()
        out[view] = (ddp.gradient_bytes(), sum(ddp.bucket_sizes))
    return out


def test_without_bucket_view_gradients_are_stored_twice():
    out = run_world(memory_with_and_without_view, 2)[0]
    assert out[False][0] == 2 * out[False][1]
    assert out[True][0] == out[True][1]


# --------------------------------------------------------------------------------------------------------------------
# skip_all_reduce_unused_params
# --------------------------------------------------------------------------------------------------------------------
def skip_unused_training(rank, world, skip):
    """Branchy with find_unused_parameters, ``never`` alone in its bucket: what reaches the comm hook, how many
    used-flags all-reduces run, and the parameters against PyTorch's DDP with the same flags."""
    torch.manual_seed(0)
    base = Branchy()
    flags = {"find_unused_parameters": True, "skip_all_reduce_unused_params": skip, "bucket_cap_mb": 0.0005}
    models = {name: copy.deepcopy(base) for name in ("ours", "torch")}
    wrapped = {"ours": DDP(models["ours"], **flags), "torch": TorchDDP(models["torch"], **flags)}
    hooked = []

    def recording_hook(state, bucket):
        hooked.append(bucket.index())
        return allreduce_hook(state, bucket)

    wrapped["ours"].register_comm_hook(None, recording_hook)
    flag_reduces = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        if tensor.dtype == torch.int32:  # the used-flags all-reduce (gradients are float32)
            flag_reduces.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    opts = {n: torch.optim.SGD(w.parameters(), lr=0.1) for n, w in wrapped.items()}
    dist.all_reduce = counting_all_reduce
    try:
        for step in range(3):
            x, y = batch(step, 4 * world)
            for name, ddp in wrapped.items():
                opts[name].zero_grad()
                F.mse_loss(ddp(x[rank * 4 : (rank + 1) * 4]), y[rank * 4 : (rank + 1) * 4]).backward()
                opts[name].step()
    finally:
        dist.all_reduce = real_all_reduce
    buckets = len(wrapped["ours"].reducer.buckets)
    return {
        "diff": max_diff(models["ours"], models["torch"]),
        "hooked_per_step": len(hooked) / 3,
        "buckets": buckets,
        "flag_reduces": len(flag_reduces),
        "never_grad_none": models["ours"].never.weight.grad is None,
    }


@pytest.mark.parametrize("skip", [False, True], ids=["all-reduced", "skipped"])
def test_skip_all_reduce_unused_params_skips_what_it_says_and_trains_as_pytorchs(skip):
    for r in run_world(skip_unused_training, 2, skip):
        assert r["diff"] <= TOL, r
        assert r["never_grad_none"], r  # no rank used it: no gradient, either way
        if skip:  # no used-flags all-reduce, and the buckets of unused parameters only are not reduced at all
            assert r["flag_reduces"] == 0 and r["hooked_per_step"] < r["buckets"], r
        else:
            assert r["flag_reduces"] == 3 and r["hooked_per_step"] == r["buckets"], r


# --------------------------------------------------------------------------------------------------------------------
# static_graph
# --------------------------------------------------------------------------------------------------------------------
def static_graph_training(rank, world, model_kind, view=False):
    torch.manual_seed(0)
    base = Branchy() if model_kind == "branchy" else Reversed()
    features = 8 if model_kind == "branchy" else 32
    models = {name: copy.deepcopy(base) for name in ("ours", "torch")}
    wrapped = {
        name: cls(models[name], static_graph=True, bucket_cap_mb=0.005, gradient_as_bucket_view=view)
        for name, cls in (("ours", DDP), ("torch", TorchDDP))
    }
    ours = wrapped["ours"]
    launches = []
    grads_seen = []

    def recording_hook(state, bucket):
        launches.append((bucket.index(), len(grads_seen)))
        return allreduce_hook(state, bucket)

    ours.register_comm_hook(None, recording_hook)
    for p in models["ours"].parameters():
        p.register_post_accumulate_grad_hook(lambda p: grads_seen.append(1))
    opts = {n: torch.optim.SGD(w.parameters(), lr=0.1) for n, w in wrapped.items()}
    bucket_orders = [ours.bucket_layout()]  # as constructed: reverse registration order
    grads_in_buckets = []  # after each step: every p.grad a slot of the current buckets (with gradient_as_bucket_view)
    # Count the graph walks: the reducer calls the module-level function, so wrapping it sees every call. The
    # ranks' processes serve later tests too: the real function is put back whatever happens.
    walks = []
    real_walk = reducer_module.unused_parameters
    reducer_module.unused_parameters = lambda outputs, params: (walks.append(1), real_walk(outputs, params))[1]
    try:
        for step in range(4):
            x, y = batch(step, 4 * world, features)
            for name, ddp in wrapped.items():
                opts[name].zero_grad(set_to_none=not view)  # kept: p.grad must stay a slot of the rebuilt buckets
                F.mse_loss(ddp(x[rank * 4 : (rank + 1) * 4]), y[rank * 4 : (rank + 1) * 4]).backward()
                opts[name].step()
            bucket_orders.append(ours.bucket_layout())
            storages = {b.buffer().untyped_storage().data_ptr() for b in ours.reducer.buckets}
            grads_in_buckets.append(
                all(
                    p.grad is None or p.grad.untyped_storage().data_ptr() in storages
                    for p in models["ours"].parameters()
                )
            )
            grads_seen.clear()
            if step < 3:
                launches.clear()
    finally:
        reducer_module.unused_parameters = real_walk
    return {
        "diff": max_diff(models["ours"], models["torch"]),
        "grads_in_buckets": grads_in_buckets,
        "walks": len(walks),
        "bucket_orders": bucket_orders,
        "last_launches": launches,
        "n_used": sum(1 for _ in models["ours"].parameters()) - (2 if model_kind == "branchy" else 0),
        "never_grad_none": models["ours"].never.weight.grad is None if model_kind == "branchy" else None,
    }


def test_static_graph_with_unused_parameters_equals_pytorch_and_learns_them_without_a_graph_walk():
    for r in run_world(static_graph_training, 2, "branchy"):
        assert r["diff"] <= TOL
        # The first iteration learns the unused set from the hooks that fire (as PyTorch's); later ones reuse it.
        assert r["walks"] == 0
        assert r["never_grad_none"]


class Checkpointed(nn.Module):
    """A reentrant ``torch.utils.checkpoint`` around the middle layer (recomputed inside backward, where a walk of
    forward's graph cannot see it), and a layer forward never uses."""

    def __init__(self):
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 8)
        self.never = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.first(x))
        h = torch.utils.checkpoint.checkpoint(lambda z: torch.relu(self.middle(z)), h, use_reentrant=True)
        return self.last(h)


def reentrant_checkpoint_training(rank, world):
    torch.manual_seed(0)
    base = Checkpointed()
    wrapped = [cls(copy.deepcopy(base), static_graph=True) for cls in (DDP, TorchDDP)]
    opts = [torch.optim.SGD(w.parameters(), lr=0.1, momentum=0.9) for w in wrapped]
    for step in range(4):
        x, y = batch(step, 4 * world, 8)
        for ddp, opt in zip(wrapped, opts):
            opt.zero_grad()
            F.mse_loss(ddp(x[rank * 4 : (rank + 1) * 4]), y[rank * 4 : (rank + 1) * 4]).backward()
            opt.step()
    ours, theirs = (w.module for w in wrapped)
    return max_diff(ours, theirs), ours.never.weight.grad is None


def test_static_graph_trains_a_reentrant_checkpoint_as_pytorchs():
    # PyTorch's documented way to combine DDP with a reentrant checkpoint. A graph walk from forward's output marked
    # the checkpointed layer unused, and its gradient then failed the backward.
    for diff, never_grad_none in run_world(reentrant_checkpoint_training, 2):
        assert diff <= TOL
        assert never_grad_none


def test_static_graph_rebuilds_buckets_in_arrival_order():
    # With gradient_as_bucket_view and zero_grad(set_to_none=False): each p.grad, a slot of the first buckets, must
    # move into the rebuilt ones, or it keeps the old buckets alive beside the new (every gradient stored twice).
    # The rebuild without views: test_static_graph_buckets_alike_on_ranks_whose_gradients_arrive_in_different_orders.
    r0, r1 = run_world(static_graph_training, 2, "reversed", True)
    assert r0["diff"] <= TOL and r1["diff"] <= TOL
    assert all(r0["grads_in_buckets"]), r0["grads_in_buckets"]  # each gradient stored once, from the rebuild on
    first, later = r0["bucket_orders"][0], r0["bucket_orders"][-1]
    assert first != later and r0["bucket_orders"][1:] == [later] * 4  # rebuilt once, after the first iteration
    assert r0["bucket_orders"] == r1["bucket_orders"]  # every rank buckets alike (rank 0's order)
    # Reversed uses layers in reverse registration order, so backward reaches layers[0] first: in arrival order
    # it is in bucket 0, and bucket 0 launches before the last gradient has arrived.
    assert later[0][:2] == [1, 0]
    launch_0_after = dict(r0["last_launches"])[0]
    assert launch_0_after < r0["n_used"], r0["last_launches"]


class RankOrdered(nn.Module):
    """Uses its layers in registration order on rank 0 and in reverse on rank 1: the same parameters, every one used,
    but each rank's gradients arrive in its own order (as they may when ranks take different code paths)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

    def forward(self, x, rank=None):
        rank = dist.get_rank() if rank is None else rank
        for layer in self.layers if rank == 0 else reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def static_graph_with_rank_orders(rank, world):
    """Three steps under static_graph with one layer per bucket; the parameters gathered from every rank, and those
    of one process taking each step on the mean of both ranks' losses."""
    torch.manual_seed(0)
    model = RankOrdered()
    exact = copy.deepcopy(model)
    ddp = DDP(model, static_graph=True, bucket_cap_mb=0.004)
    opt, exact_opt = torch.optim.SGD(ddp.parameters(), lr=0.5), torch.optim.SGD(exact.parameters(), lr=0.5)
    for step in range(3):
        x, y = batch(step, 4 * world, 32)
        opt.zero_grad()
        F.mse_loss(ddp(x[rank * 4 : (rank + 1) * 4]), y[rank * 4 : (rank + 1) * 4]).backward()
        opt.step()
        exact_opt.zero_grad()
        losses = [F.mse_loss(exact(x[r * 4 : (r + 1) * 4], rank=r), y[r * 4 : (r + 1) * 4]) for r in range(world)]
        (sum(losses) / world).backward()
        exact_opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return {
        "layout": ddp.bucket_layout(),
        "ranks_apart": max((g - gathered[0]).abs().max().item() for g in gathered),
        "vs_exact": max_diff(model, exact),
    }


def test_static_graph_buckets_alike_on_ranks_whose_gradients_arrive_in_different_orders():
    r0, r1 = run_world(static_graph_with_rank_orders, 2)
    assert len(r0["layout"]) == 4, r0  # one layer a bucket: an order that differs between ranks would matter
    assert r0["layout"] == r1["layout"]  # rank 0's arrival order, on every rank
    assert r0["ranks_apart"] == 0.0 and r1["ranks_apart"] == 0.0  # the replicas stay identical
    assert r0["vs_exact"] <= TOL and r1["vs_exact"] <= TOL  # and each step is the mean of both ranks' gradients


# --------------------------------------------------------------------------------------------------------------------
# What a comm hook is told: the last bucket of each step, with several buckets
# --------------------------------------------------------------------------------------------------------------------
def last_bucket_flags(rank, world):
    """Per step, each bucket's (index, is_last()) as a comm hook sees them, under ours and PyTorch's DDP."""
    flags = {}
    for name, cls in (("ours", DDP), ("torch", TorchDDP)):
        torch.manual_seed(0)
        ddp = cls(MiniMLP(in_features=16, hidden=32, out_features=16), bucket_cap_mb=0.002)  # a bucket per layer
        seen = flags[name] = []

        def recording(state, bucket, seen=seen):
            if bucket.index() == 0:
                seen.append([])
            seen[-1].append((bucket.index(), bucket.is_last()))
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, recording)
        for _ in range(3):
            ddp(torch.randn(4, 16)).sum().backward()
    return flags


def test_a_comm_hook_is_told_the_last_bucket_of_each_step_as_by_pytorch():
    # Hooks that keep per-step state (PyTorch's PowerSGD counts its iterations this way) read is_last().
    for flags in run_world(last_bucket_flags, 2):
        assert flags["ours"] == [[(0, False), (1, False), (2, True)]] * 3
        assert flags["ours"][1:] == flags["torch"][1:]  # PyTorch buckets by arrival from its second iteration on


# --------------------------------------------------------------------------------------------------------------------
# First bucket cap on a model over 1 MiB
# --------------------------------------------------------------------------------------------------------------------
def bucket_layouts(rank, world, bucket_cap_mb):
    """Bucket sizes of ours and of PyTorch's DDP (after its rebuild at the first backward) on the same model."""
    torch.manual_seed(0)
    model = DeepMLP(width=256, depth=12)  # 12 × 257 KiB ≈ 3 MiB of gradients
    layouts = {}
    for name, cls in (("ours", DDP), ("torch", TorchDDP)):
        ddp = cls(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb)
        for _ in range(2):  # PyTorch buckets by arrival order from the second iteration on
            ddp(torch.randn(2, 256)).sum().backward()
        if name == "ours":
            layouts[name] = list(ddp.bucket_sizes)
        else:  # PyTorch's Reducer lists its current buckets (a private API: this test reads, never relies on it)
            layouts[name] = [b.buffer().nbytes for b in ddp.reducer._get_zeros_like_grad_buckets()]
    sizes = [p.numel() * 4 for p in model.parameters()]
    return layouts, sum(sizes), max(sizes)


# 1028 / 1024 MiB: exactly four layers (4 × 257 KiB), so a bucket that reaches its cap exactly must close there.
@pytest.mark.parametrize("bucket_cap_mb", [None, 2, 0.5, 1028 / 1024])
def test_buckets_are_cut_like_pytorchs(bucket_cap_mb):
    layouts, total, largest = run_world(bucket_layouts, 2, bucket_cap_mb)[0]
    assert total > 2 * MiB
    assert layouts["ours"] == layouts["torch"], layouts
    sizes = layouts["ours"]
    assert sum(sizes) == total
    if bucket_cap_mb is None:  # the default: a small first bucket (1 MiB, overshot by its last parameter)
        assert FIRST_BUCKET_BYTES <= sizes[0] < 2 * FIRST_BUCKET_BYTES
        assert max(sizes[1:]) > 2 * FIRST_BUCKET_BYTES  # later buckets really are bigger: the first cap is its own rule
    else:  # an explicit cap holds for every bucket, the first included: each overshoots by less than a parameter
        assert all(int(bucket_cap_mb * MiB) <= s < int(bucket_cap_mb * MiB) + largest for s in sizes[:-1])


# --------------------------------------------------------------------------------------------------------------------
# PyTorch's own PowerSGD hook, unchanged, on our wrapper
# --------------------------------------------------------------------------------------------------------------------
def powersgd_vs_torch(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    torch.manual_seed(0)
    base = MiniMLP(in_features=16, hidden=32, out_features=16)
    models = {name: copy.deepcopy(base) for name in ("ours", "torch")}
    wrapped = {name: cls(models[name], bucket_cap_mb=25) for name, cls in (("ours", DDP), ("torch", TorchDDP))}
    for ddp in wrapped.values():  # one bucket (the model is far below 1 MiB): the bucketing is identical
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5
        )
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    opts = {n: torch.optim.SGD(w.parameters(), lr=0.05) for n, w in wrapped.items()}
    exact = copy.deepcopy(base)
    exact_opt = torch.optim.SGD(exact.parameters(), lr=0.05)
    for step in range(6):
        x, y = batch(step, 4 * world, 16)
        for name, ddp in wrapped.items():
            opts[name].zero_grad()
            F.mse_loss(ddp(x[rank * 4 : (rank + 1) * 4]), y[rank * 4 : (rank + 1) * 4]).backward()
            opts[name].step()
        exact_opt.zero_grad()
        F.mse_loss(exact(x), y).backward()
        exact_opt.step()
    return max_diff(models["ours"], models["torch"]), max_diff(models["ours"], exact), len(wrapped["ours"].bucket_sizes)


def test_pytorchs_powersgd_hook_runs_on_ours_and_matches_pytorchs_ddp():
    for vs_torch, vs_exact, buckets in run_world(powersgd_vs_torch, 2):
        assert buckets == 1
        assert vs_torch <= 1e-5
        assert vs_exact > 1e-4  # rank-1 compression really was applied (else the match would prove little)


# --------------------------------------------------------------------------------------------------------------------
# The timing contract: a known delay before the all-reduce shows in the reported latency
# --------------------------------------------------------------------------------------------------------------------
DELAY_S = 0.3


def delayed_rank_timings(rank, world):
    """Rank 1 stalls DELAY_S at the start of its backward: rank 0's first all-reduce must wait for it, and both
    wrappers' numbers on rank 0 must say so."""
    out = {}
    for name in ("ours", "torch"):
        torch.manual_seed(0)
        model = MiniMLP()
        ddp = DDP(model) if name == "ours" else TorchDDP(model)
        probe = OursCommProbe(ddp) if name == "ours" else TorchCommProbe(ddp)
        for step in range(2):
            loss = ddp(torch.randn(4, 32)).sum()
            if rank == 1 and step == 1:
                loss.register_hook(lambda g: (time.sleep(DELAY_S), g)[1])
            dist.barrier()
            loss.backward()
            sample = probe.take()
        out[name] = sample
    return out


def delayed_hook_timings(rank, world):
    """A comm hook that sleeps DELAY_S before the all-reduce: the latency of that bucket includes the sleep."""
    ddp = DDP(MiniMLP())

    def slow_hook(state, bucket):
        time.sleep(DELAY_S)
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, slow_hook)
    ddp(torch.randn(4, 32)).sum().backward()
    return ddp.stats.last_bucket_seconds, ddp.stats.last_comm_span_seconds


def test_a_known_delay_before_the_all_reduce_shows_in_the_reported_latency():
    seconds, span = run_world(delayed_hook_timings, 2)[0]
    assert seconds[0] >= DELAY_S and span >= DELAY_S
    out = run_world(delayed_rank_timings, 2)[0]
    ours, theirs = out["ours"], out["torch"]
    assert max(ours.bucket_seconds) >= 0.8 * DELAY_S, ours
    assert ours.span_seconds >= 0.8 * DELAY_S and ours.wait_seconds >= 0.5 * DELAY_S, ours
    assert max(theirs.bucket_seconds) >= 0.8 * DELAY_S, theirs
    assert theirs.span_seconds >= 0.8 * DELAY_S and theirs.wait_seconds is None, theirs


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu-check runs for real there")
def test_gpu_check_without_cuda_says_so_in_one_line():
    import os
    import subprocess
    import sys
    from pathlib import Path

    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ), cwd=root)
    assert result.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, result.stdout[-2000:]  # make gpu-check fails
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and "no CUDA device" in skipped[0], result.stdout[-2000:]
    assert " passed" not in result.stdout and " failed" not in result.stdout, result.stdout[-2000:]


def test_wrapper_none_is_the_bare_module_without_a_process_group():
    from app.parallel import wrap_model

    model = MiniMLP()
    assert wrap_model(model, "none") is model  # world size 1: nothing to synchronise, no group needed


def test_a_wrapper_name_that_is_none_of_the_three_is_refused_naming_them():
    from app.parallel import wrap_model

    with pytest.raises(ValueError, match=r"^wrapper='horovod': choose one of ours, torch, none$"):
        wrap_model(MiniMLP(), "horovod")
