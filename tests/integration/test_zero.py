"""ZeRO stages 1 and 2 on real gloo ranks, against one process, our DDP and PyTorch's ZeroRedundancyOptimizer.

Every rank draws the same global batch per step and trains on its own equal slice (with gradient accumulation:
``accum`` equal micro-batches, the loss divided by ``accum``); a single-process reference trains on the whole batch.
Because every rank's loss is a mean over an equal slice, the mean of the ranks' gradients is the gradient of the
whole batch's mean loss, so the sharded run must walk the reference's path, up to float rounding.

The helpers here (``build``, ``train_stage``) are shared with ``test_fsdp.py`` (stage 3).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from app.diagnostics import collectives as recorded
from app.parallel.ddp import DistributedDataParallel as DDP
from app.parallel.zero import stage1
from app.parallel.zero.stage1 import ZeroRedundancyOptimizer, partition_by_size
from app.parallel.zero.stage2 import ShardedGradDataParallel
from app.parallel.zero.stage3 import FullyShardedDataParallel
from app.worker.models import MiniMLP, parameter_checksum
from app.world import run_world

# Measured (docs/sharding.md): over 4 AdamW steps at lr 1e-2, stages 1-3, worlds 2 and 4, with and without
# accumulation, the worst |dparam| against one process was 6.0e-8 (fp32 sums in another order), against our DDP and
# PyTorch's ZeRO 4.5e-8. 1e-6 leaves a wide margin and still
# catches a wrong average (a missing 1/N moves parameters by ~1e-2 after one AdamW step).
PARAM_TOL = 1e-6
LR = 1e-2
PER_RANK = 4


class TiedPair(nn.Module):
    """Two modules share one Parameter (``b.weight is a.weight``): one tensor, two uses, one gradient."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.b.weight = self.a.weight
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(torch.tanh(self.inp(x)))))))


class FrozenFirst(MiniMLP):
    def __init__(self):
        super().__init__(in_features=8, hidden=16, out_features=8)
        for p in self.net[0].parameters():
            p.requires_grad_(False)


def build(kind: str) -> nn.Module:
    return {"mlp": lambda: MiniMLP(in_features=8, hidden=16, out_features=8), "tied": TiedPair, "frozen": FrozenFirst}[
        kind
    ]()


def batch(step: int, size: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, 8, generator=g), torch.randn(size, 8, generator=g)


def wrap(stage: int, model: nn.Module, **kwargs):
    """(the module to call, its optimizer) for ZeRO ``stage``, AdamW at LR."""
    if stage == 1:
        ddp = DDP(model)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    if stage == 2:
        cap, overlap = kwargs.get("bucket_cap_mb", 0.001), kwargs.get("overlap_gather", False)
        wrapped = ShardedGradDataParallel(model, bucket_cap_mb=cap, overlap_gather=overlap)
        return wrapped, wrapped.build_optimizer(torch.optim.AdamW, lr=LR)
    options = {k: kwargs[k] for k in ("units", "compute_dtype", "prefetch", "reshard_after_forward") if k in kwargs}
    wrapped = FullyShardedDataParallel(model, **options)
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=LR)


def micro_step(wrapped, x, y, accum: int, i: int) -> None:
    """Backward of micro-batch ``i`` of ``accum``: inside ``no_sync()`` (if the wrapper has one) but the last."""
    last = i == accum - 1
    sync = wrapped.no_sync() if hasattr(wrapped, "no_sync") and not last else _nothing()
    with sync:
        (F.mse_loss(wrapped(x), y) / accum).backward()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def full_parameters(stage: int, wrapped, model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The bare model's parameters by name (stage 3: gathered, on rank 0 only; ``None`` elsewhere).

    Read through the wrapper, as its users do: stage 2's ``overlap_gather`` may still be gathering them."""
    if stage == 3:
        state = wrapped.full_state_dict()
        return state or None
    return {n.removeprefix("module."): p.detach().clone() for n, p in wrapped.named_parameters()}


def max_diff(ours: dict, module: nn.Module) -> float:
    return max((ours[n] - p.detach()).abs().max().item() for n, p in module.named_parameters())


def train_stage(rank, world, stage, kind, accum=1, steps=4, options=None, **wrap_kwargs):
    """Train ``stage`` next to one process, our DDP + AdamW and PyTorch's DDP + ZeroRedundancyOptimizer(AdamW);
    ``options``: the wrapper's settings (``overlap_gather``, ``prefetch``, ...), as ``wrap_kwargs``."""
    wrap_kwargs.update(options or {})
    torch.manual_seed(0)
    base = build(kind)
    reference, ddp_model, torch_model, model = (copy.deepcopy(base) for _ in range(4))
    if rank != 0:  # ranks start different: the wrapper's broadcast at construction must make them equal
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)
    wrapped, opt = wrap(stage, model, **wrap_kwargs)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR)
    ddp = DDP(ddp_model)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    theirs = nn.parallel.DistributedDataParallel(torch_model)
    theirs_opt = TorchZero(theirs.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    diffs = {"reference": [], "ddp": [], "torch": []}
    same_on_all_ranks = True
    for step in range(steps):
        x, y = batch(step, PER_RANK * accum * world)
        for w, o in ((wrapped, opt), (ddp, ddp_opt), (theirs, theirs_opt)):
            o.zero_grad()
            for i in range(accum):
                start = (rank * accum + i) * PER_RANK
                micro_step(w, x[start : start + PER_RANK], y[start : start + PER_RANK], accum, i)
            o.step()
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ours = full_parameters(stage, wrapped, model)
        if ours is not None:
            for name, other in (("reference", reference), ("ddp", ddp_model), ("torch", torch_model)):
                diffs[name].append(max_diff(ours, other))
        if stage != 3:
            digests = [None] * world
            dist.all_gather_object(digests, parameter_checksum(wrapped))  # through the wrapper: gathered
            same_on_all_ranks &= len(set(digests)) == 1
    return {"diffs": diffs, "same": same_on_all_ranks}


def assert_walks_with_everyone(results, stage):
    diffs = results[0]["diffs"]
    for name in ("reference", "ddp", "torch"):
        assert max(diffs[name]) <= PARAM_TOL, f"stage {stage} vs {name}: {diffs[name]}"
    assert all(r["same"] for r in results), "ranks' parameters differ"


@pytest.mark.parametrize(
    ("stage", "world", "kind", "accum"),
    [
        (1, 2, "mlp", 1),
        (1, 4, "tied", 2),
        (1, 4, "frozen", 1),
        (2, 2, "mlp", 1),
        (2, 4, "mlp", 2),
        (2, 2, "tied", 2),
        (2, 4, "frozen", 1),
    ],
)
def test_stage_walks_with_one_process_ddp_and_torch_zero(stage, world, kind, accum):
    results = run_world(train_stage, world, stage, kind, accum, timeout=300)
    assert_walks_with_everyone(results, stage)


@pytest.mark.parametrize(("world", "kind", "accum"), [(2, "mlp", 2), (4, "tied", 1), (2, "frozen", 1)])
def test_stage2_overlapping_its_all_gather_walks_with_everyone(world, kind, accum):
    """overlap_gather: the parameters read right after each step (through the wrapper) are the gathered ones."""
    results = run_world(train_stage, world, 2, kind, accum, 4, {"overlap_gather": True}, timeout=300)
    assert_walks_with_everyone(results, 2)


def stage1_in_small_buckets(rank, world):
    """Stage 1 with broadcast buckets of 1 KiB: every owner's partition goes in several broadcasts."""
    stage1.BROADCAST_BUCKET_BYTES = 1024
    sizes, send = [], recorded.broadcast

    def counting(tensor, name, *args, **kwargs):
        if name.startswith("ZeRO-1 parameters"):
            sizes.append(tensor.numel() * tensor.element_size())
        return send(tensor, name, *args, **kwargs)

    stage1.recorded.broadcast = counting
    result = train_stage(rank, world, 1, "mlp", steps=2)
    return result | {"sizes": sizes}


def test_stage1_broadcasts_in_buckets_of_bounded_size_and_still_walks_with_everyone():
    # The bucket bound is what keeps the step's copy of the parameters at two buckets instead of the whole model.
    results = run_world(stage1_in_small_buckets, 2, timeout=300)
    assert_walks_with_everyone(results, 1)
    params = sum(p.numel() for p in build("mlp").parameters())
    sizes = results[0]["sizes"]
    largest = max(p.numel() for p in build("mlp").parameters()) * 4
    assert max(sizes) <= max(1024, largest), sizes
    assert sum(sizes) == 2 * params * 4, "two steps must broadcast every parameter once each"
    assert len(sizes) > 2 * 2, f"{len(sizes)} broadcasts: as many as owners, not buckets"


# --------------------------------------------------------------------------------------------------------------------
# Stage 1: the partition, the state each rank holds, state dicts, refusals
# --------------------------------------------------------------------------------------------------------------------
class Uneven(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(i, j) for i, j in [(8, 64), (64, 3), (3, 40), (40, 40), (40, 5)])


def partition_vs_torch(rank, world):
    model = Uneven()
    params = list(model.parameters())
    ours = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR)
    theirs = TorchZero(params, optimizer_class=torch.optim.AdamW, lr=LR)
    index = {id(p): i for i, p in enumerate(params)}
    their_partition = [[index[id(p)] for g in groups for p in g["params"]] for groups in theirs._partition_parameters()]
    our_partition = [
        [index[id(p)] for g in groups for p in g] for groups in partition_by_size(ours.param_groups, world)
    ]
    # One step, then what each rank's optimizer allocated
    for p in params:
        p.grad = torch.ones_like(p)
    ours.step()
    state_numel = sum(v.numel() for s in ours.optim.state.values() for v in s.values() if v.dim() > 0)
    owned_numel = sum(p.numel() for p in ours.owned_parameters())
    return our_partition, their_partition, state_numel, owned_numel, sum(p.numel() for p in params)


def test_partition_is_pytorchs_and_each_rank_holds_only_its_state():
    results = run_world(partition_vs_torch, 4, timeout=120)
    ours, theirs, *_ = results[0]
    assert ours == theirs
    states = [r[2] for r in results]
    assert [r[2] for r in results] == [2 * r[3] for r in results]  # AdamW: exp_avg + exp_avg_sq of its own params
    assert sum(states) == 2 * results[0][4]  # together, exactly one copy of the whole state


def state_dict_round_trip(rank, world):
    torch.manual_seed(0)
    model, reference = build("mlp"), None
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    wrapped, opt = wrap(1, model)
    for step in range(2):
        x, y = batch(step, PER_RANK * world)
        opt.zero_grad()
        micro_step(
            wrapped, x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK], 1, 0
        )
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
    opt.consolidate_state_dict(to=0)
    full = opt.state_dict() if rank == 0 else None
    objs = [full]
    dist.broadcast_object_list(objs, src=0)
    full = objs[0]
    # Rank 0's whole state loads into a plain AdamW and equals the single-process optimizer's state.
    plain = torch.optim.AdamW(copy.deepcopy(reference).parameters(), lr=LR)
    plain.load_state_dict(full)
    worst_state = max(
        (plain.state[p][k] - ref_opt.state[q][k]).abs().max().item()
        for p, q in zip(plain.param_groups[0]["params"], ref_opt.param_groups[0]["params"])
        for k in ("exp_avg", "exp_avg_sq")
    )
    # A fresh ZeRO (another partition: 3 groups of parameters in another order would do too) takes it and goes on.
    resumed_model = copy.deepcopy(model)
    resumed, resumed_opt = wrap(1, resumed_model)
    resumed_opt.load_state_dict(full)
    for step in range(2, 4):
        x, y = batch(step, PER_RANK * world)
        for w, o in ((wrapped, opt), (resumed, resumed_opt)):
            o.zero_grad()
            micro_step(w, x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK], 1, 0)
            o.step()
    drift = max((p - q).abs().max().item() for p, q in zip(model.parameters(), resumed_model.parameters()))
    return worst_state, drift, rank != 0 and _raises_without_consolidate(opt)


def _raises_without_consolidate(opt) -> bool:
    try:
        opt.state_dict()
    except RuntimeError as e:
        return "consolidate_state_dict" in str(e)
    return False


def test_state_dict_is_pytorchs_format_and_resumes_exactly():
    results = run_world(state_dict_round_trip, 2, timeout=120)
    worst_state, drift, _ = results[0]
    assert worst_state <= PARAM_TOL
    assert drift == 0.0  # same state, same data, same code: bit for bit
    assert results[1][2]  # rank 1 was never consolidated onto: a clear error


def test_refuses_lbfgs_with_one_line():
    params = [nn.Parameter(torch.zeros(3))]
    for make in (
        lambda: ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.LBFGS, lr=1.0),
        lambda: ShardedGradDataParallel.build_optimizer(None, torch.optim.LBFGS, lr=1.0),
    ):
        with pytest.raises(ValueError, match=r"^optimizer_class=LBFGS cannot be sharded") as info:
            make()
        assert "\n" not in str(info.value)


def test_constructor_is_pytorchs():
    ours = inspect.signature(ZeroRedundancyOptimizer.__init__).parameters
    theirs = inspect.signature(TorchZero.__init__).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]


# --------------------------------------------------------------------------------------------------------------------
# Stage 2: what backward communicates and keeps
# --------------------------------------------------------------------------------------------------------------------
def no_sync_and_grad_memory(rank, world):
    torch.manual_seed(0)
    model = build("mlp")
    wrapped, opt = wrap(2, model)
    x, y = batch(0, 2 * PER_RANK)
    before = dict(wrapped.comm_bytes)
    with wrapped.no_sync():
        (F.mse_loss(wrapped(x[:PER_RANK]), y[:PER_RANK]) / 2).backward()
    during = dict(wrapped.comm_bytes)
    full_grads = all(p.grad is not None for p in model.parameters())
    (F.mse_loss(wrapped(x[PER_RANK:]), y[PER_RANK:]) / 2).backward()
    after = dict(wrapped.comm_bytes)
    module_grads = [p.grad is None for p in model.parameters()]
    shard_numel = sum(s.grad.numel() for s in wrapped.shard_parameters())
    padded = sum(b // 4 for b in wrapped.bucket_sizes)
    return before, during, full_grads, after, module_grads, shard_numel, padded


def test_no_sync_sends_nothing_and_backward_keeps_one_nth_of_the_gradient():
    for rank, (before, during, full_grads, after, module_grads, shard_numel, padded) in enumerate(
        run_world(no_sync_and_grad_memory, 2, timeout=120)
    ):
        assert during == before, "no_sync() communicated"
        assert full_grads  # the micro-batch's gradient accumulated locally
        assert after["reduce_scatter"] > before["reduce_scatter"]
        assert all(module_grads), "full gradients kept after the synchronised backward"
        assert shard_numel == padded // 2, f"rank {rank} keeps {shard_numel} gradient elements of {padded}"


class Skips(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x)


def missing_gradient(rank, world):
    wrapped = ShardedGradDataParallel(Skips(), bucket_cap_mb=0.0001)
    try:
        wrapped(torch.randn(2, 8)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_a_parameter_without_gradient_is_a_clear_error_not_a_hang():
    message = run_world(missing_gradient, 2, timeout=60)[0]
    assert message is not None and "unused.weight" in message and "requires_grad=False" in message


class AtTheCap(nn.Module):
    """Three parameters; in backward order (reversed) the first holds one float32 less than 1 MiB, the second one."""

    def __init__(self):
        super().__init__()
        self.c = nn.Parameter(torch.zeros(8))
        self.b = nn.Parameter(torch.zeros(1))
        self.a = nn.Parameter(torch.zeros(2**18 - 1))


def zero2_bucket_sizes(rank, world):
    return ShardedGradDataParallel(AtTheCap(), bucket_cap_mb=1).bucket_sizes


def test_a_zero2_bucket_closes_once_it_holds_bucket_cap_mb_mebibytes():
    # a and b together are exactly 1 MiB (2**20 bytes): the first bucket, as in ddp.py; c alone, padded to the world.
    assert run_world(zero2_bucket_sizes, 2, timeout=60) == [[2**20, 8 * 4]] * 2


# --------------------------------------------------------------------------------------------------------------------
# What a user changes between steps: an LR scheduler, a hand-set group lr, several parameter groups
# --------------------------------------------------------------------------------------------------------------------
class UnevenChain(Uneven):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def two_groups(model: Uneven) -> list[dict]:
    """Two parameter groups with their own hyperparameters (what a user's no-decay split looks like)."""
    first = [p for layer in model.layers[:2] for p in layer.parameters()]
    rest = [p for layer in model.layers[2:] for p in layer.parameters()]
    return [{"params": first}, {"params": rest, "lr": LR / 2, "weight_decay": 0.1}]


def zero1_with_a_schedule_and_two_groups(rank, world):
    """ZeRO-1 next to one process, both with two groups, a LambdaLR and a hand-set lr; then the consolidated state."""
    torch.manual_seed(0)
    model = UnevenChain()
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(two_groups(model), optimizer_class=torch.optim.AdamW, lr=LR)
    ref_opt = torch.optim.AdamW(two_groups(reference), lr=LR)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 3 * s)) for o in (opt, ref_opt)]
    for step in range(4):
        x, y = batch(step, PER_RANK * world)
        y = y[:, :5]
        opt.zero_grad()
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        for s in schedules:
            s.step()
        if step == 1:  # by hand, as a user's warm-up code does: the next step must use it
            for o in (opt, ref_opt):
                o.param_groups[1]["lr"] = 5 * LR
    drift = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    opt.consolidate_state_dict(to=0)
    objs = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(objs, src=0)
    full = objs[0]
    # Rank 0's whole state, loaded into a plain AdamW over the same two groups, is the one-process optimizer's.
    plain_model = copy.deepcopy(reference)
    plain = torch.optim.AdamW(two_groups(plain_model), lr=LR)
    plain.load_state_dict(full)
    worst_state = max(
        (plain.state[p][k] - ref_opt.state[q][k]).abs().max().item()
        for p, q in zip(plain_model.parameters(), reference.parameters())
        for k in ("exp_avg", "exp_avg_sq")
    )
    groups = [{k: v for k, v in g.items() if k != "params"} for g in full["param_groups"]]
    ref_groups = [{k: v for k, v in g.items() if k != "params"} for g in ref_opt.state_dict()["param_groups"]]
    # ... and it steps on from there as the one-process optimizer does (AdamW reads betas, eps, ... from each group).
    x, y = batch(4, PER_RANK * world)
    for m, o in ((plain_model, plain), (reference, ref_opt)):
        o.zero_grad()
        F.mse_loss(m(x), y[:, :5]).backward()
        o.step()
    stepped_on = max((p - q).abs().max().item() for p, q in zip(plain_model.parameters(), reference.parameters()))
    return {"drift": drift, "worst_state": worst_state, "groups_equal": groups == ref_groups, "stepped_on": stepped_on}


def test_zero1_follows_an_lr_scheduler_a_hand_set_lr_and_two_groups_into_its_state_dict():
    for r in run_world(zero1_with_a_schedule_and_two_groups, 2, timeout=120):
        assert r["drift"] <= PARAM_TOL, r  # the lr each group was given, every step, on every rank's partition
        assert r["worst_state"] <= PARAM_TOL, r  # each group's state under its own parameters' indices
        assert r["groups_equal"], r  # each group's lr (the last one the scheduler set), weight decay, betas, ...
        assert r["stepped_on"] <= PARAM_TOL, r  # the same state and hyperparameters: the same next step


def zero2_two_synchronised_backwards(rank, world):
    """Two backwards outside no_sync() before one step add up, as p.grad does in plain PyTorch."""
    torch.manual_seed(0)
    model = build("mlp")
    reference = copy.deepcopy(model)
    wrapped, opt = wrap(2, model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    for step in range(3):
        x, y = batch(step, 2 * PER_RANK * world)
        opt.zero_grad()
        ref_opt.zero_grad()
        for i in range(2):
            half = slice(i * PER_RANK * world, (i + 1) * PER_RANK * world)
            start = i * PER_RANK * world + rank * PER_RANK
            (F.mse_loss(wrapped(x[start : start + PER_RANK]), y[start : start + PER_RANK]) / 2).backward()
            (F.mse_loss(reference(x[half]), y[half]) / 2).backward()
        opt.step()
        ref_opt.step()
    return max_diff(full_parameters(2, wrapped, model), reference)


def test_zero2_adds_up_two_synchronised_backwards_before_one_step():
    assert max(run_world(zero2_two_synchronised_backwards, 2, timeout=120)) <= PARAM_TOL


def zero1_closure_with_more_ranks_than_parameters(rank, world):
    """Linear(8, 8) has 2 parameters and the world 4 ranks: two partitions are empty. step(closure) returns the
    closure's loss and walks with one process, a scheduler included."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)]
    losses = []
    for step in range(3):
        x, y = batch(step, PER_RANK * world)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

        def closure(m=ddp, x=x[mine], y=y[mine], o=opt):
            o.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            return loss

        def ref_closure(x=x, y=y):
            ref_opt.zero_grad()
            loss = F.mse_loss(reference(x), y)
            loss.backward()
            return loss

        losses.append((opt.step(closure).item(), F.mse_loss(reference(x[mine]), y[mine]).item()))
        ref_opt.step(ref_closure)
        for s in schedules:
            s.step()
    drift = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    return {"drift": drift, "losses": losses, "owned": len(opt.owned_parameters())}


def test_zero1_steps_with_a_closure_and_with_more_ranks_than_parameters():
    results = run_world(zero1_closure_with_more_ranks_than_parameters, 4, timeout=120)
    assert sorted(r["owned"] for r in results) == [0, 0, 1, 1]  # two ranks step nothing and still take part
    for r in results:
        assert r["drift"] <= PARAM_TOL, r
        for returned, before_the_step in r["losses"]:
            assert returned == pytest.approx(before_the_step, rel=1e-6), r  # the closure's loss, from this rank's data


def zero1_loads_a_state_of_another_dtype(rank, world):
    """A float64 run's consolidated state, loaded into a float32 ZeRO-1: each rank's part takes its parameters'
    dtype (as torch.optim's load does) and is the optimizer's own, not the caller's dict, which later steps leave
    as it was."""
    torch.manual_seed(0)
    model64 = UnevenChain().double()
    ddp64 = DDP(model64)
    opt64 = ZeroRedundancyOptimizer(ddp64.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    x, y = batch(0, PER_RANK * world)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    F.mse_loss(ddp64(x[mine].double()), y[mine, :5].double()).backward()
    opt64.step()
    opt64.consolidate_state_dict(to=0)
    objs = [opt64.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(objs, src=0)
    full = objs[0]
    kept = copy.deepcopy(full)
    model = copy.deepcopy(model64).float()
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    opt.load_state_dict(full)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    ref_opt.load_state_dict(copy.deepcopy(full))
    dtypes = {v.dtype for s in opt.optim.state.values() for k, v in s.items() if k != "step"}
    for step in range(1, 3):
        x, y = batch(step, PER_RANK * world)
        opt.zero_grad()
        F.mse_loss(ddp(x[mine]), y[mine, :5]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y[:, :5]).backward()
        ref_opt.step()
    untouched = all(
        torch.equal(full["state"][i][k], kept["state"][i][k]) for i in full["state"] for k in full["state"][i]
    )
    drift = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    owned = {id(p) for p in opt.owned_parameters()}
    only_owned = all(id(p) in owned for p in opt.optim.state)  # ZeRO-1's saving, kept after a load
    # Loaded back into the float64 run: "step" keeps its own dtype (float32), as torch.optim keeps it, rather than
    # taking its parameters' like the moments do.
    opt64.load_state_dict(full)
    steps = sorted({str(s["step"].dtype) for s in opt64.optim.state.values()})
    return {
        "dtypes": sorted(map(str, dtypes)),
        "untouched": untouched,
        "drift": drift,
        "only_owned": only_owned,
        "steps": steps,
    }


def test_zero1_loads_a_float64_state_into_float32_parameters_as_its_own_copy():
    for r in run_world(zero1_loads_a_state_of_another_dtype, 2, timeout=120):
        assert r["dtypes"] in ([], ["torch.float32"]), r  # (a rank may own no state)
        assert r["only_owned"], "after a load a rank steps, and keeps state for, other ranks' parameters"
        assert r["untouched"], r  # the loaded dict is not the optimizer's state: steps do not write into it
        assert r["drift"] <= PARAM_TOL, r  # and it steps on as a plain AdamW loaded with the same state
        assert r["steps"] in ([], [str(torch.float32)]), r  # "step" in its own dtype, not the parameters'


class Work:
    """A reduce-scatter in flight, as InFlight sees a gloo work: done or not, and whether a wait() blocked on it."""

    def __init__(self):
        self.done = self.blocked = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.blocked = self.blocked or not self.done
        self.done = True


def test_zero2_keeps_up_to_its_limit_of_reduce_scatters_in_flight_and_waits_only_beyond_it():
    # Blocking on more than the oldest beyond the limit would stall backward on communication it could overlap;
    # on fewer, more whole-bucket gradients would stay alive than stage 2 promises to keep.
    from app.parallel.zero.stage2 import InFlight

    works = [Work() for _ in range(4)]
    flight = InFlight(limit=2)
    for i, w in enumerate(works[:3]):
        flight.add(w, f"chunk {i}")
    assert [w.blocked for w in works[:3]] == [True, False, False]  # three launched: only the oldest waited for
    works[1].done = True  # finished on its own: dropped at the next launch, nobody waits for it
    flight.add(works[3], "chunk 3")
    assert [w.blocked for w in works] == [True, False, False, False]
    assert flight.results() == ["chunk 0", "chunk 1", "chunk 2", "chunk 3"]  # in launch order, after the rest
    assert all(w.done for w in works)


def test_zero2_keeps_of_a_finished_work_only_what_its_done_function_returns():
    # On gloo a bucket is all-reduced in place and only this rank's chunk kept: the flat gradient must go with the
    # work, and the chunk must be read only once the work is done (before, it holds unsummed values).
    import weakref

    from app.parallel.zero.stage2 import InFlight

    works, seen = [Work(), Work()], []
    flight = InFlight(limit=1)
    flat = torch.arange(4.0)
    gone = weakref.ref(flat)
    flight.add(works[0], flat, lambda f: seen.append(works[0].done) or f[:2].clone())
    del flat
    flight.add(works[1], torch.arange(4.0) + 4, lambda f: seen.append(works[1].done) or f[2:].clone())
    assert seen == [True] and gone() is None  # the oldest, beyond the limit: waited for, cut, its flat freed
    assert [t.tolist() for t in flight.results()] == [[0.0, 1.0], [6.0, 7.0]] and seen == [True, True]


@pytest.mark.parametrize("option", ["parameters_as_bucket_view", "overlap_with_ddp"])
def test_zero1_refuses_each_of_torchs_options_it_does_not_implement_on_its_own(option):
    # Either one alone would otherwise be accepted and silently not done.
    with pytest.raises(NotImplementedError, match="parameters_as_bucket_view/overlap_with_ddp=True"):
        ZeroRedundancyOptimizer(MiniMLP().parameters(), torch.optim.SGD, lr=0.1, **{option: True})


def clip_shards(rank: int, world: int, max_norm: float) -> tuple[float, list[float], list[float]]:
    from app.parallel.zero.stage2 import clip_sharded_grad_norm_

    full = torch.arange(1.0, 9.0) / 10  # the whole gradient, norm ~1.43; each rank holds half of it
    shard = torch.zeros(4, requires_grad=True)
    shard.grad = full[rank * 4 : rank * 4 + 4].clone()
    norm = clip_sharded_grad_norm_([shard], max_norm)
    expected = torch.nn.Parameter(torch.zeros(8))
    expected.grad = full.clone()
    torch.nn.utils.clip_grad_norm_([expected], max_norm)
    return float(norm), shard.grad.tolist(), expected.grad[rank * 4 : rank * 4 + 4].tolist()


@pytest.mark.parametrize("max_norm", [0.5, 10.0], ids=["above-the-limit", "within-it"])
def test_sharded_clipping_scales_down_as_torchs_and_never_up(max_norm):
    # A gradient within max_norm is left as it is (the scale is capped at 1), one above it is scaled to max_norm.
    for norm, got, expected in run_world(clip_shards, 2, max_norm):
        assert norm == pytest.approx(float(torch.linalg.vector_norm(torch.arange(1.0, 9.0) / 10)))
        assert got == pytest.approx(expected, rel=1e-5)
