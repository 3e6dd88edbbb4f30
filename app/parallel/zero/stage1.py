"""ZeRO stage 1 from scratch: each rank keeps the optimizer state of 1/N of the parameters, not of all of them.

Plain data parallelism (``app.parallel.ddp``) keeps, on every rank, the parameters, their gradients and the optimizer's
state; with AdamW the state is two fp32 tensors per parameter (``exp_avg``, ``exp_avg_sq``), twice the parameters
themselves. Every rank computes the same update from the same averaged gradient, so all N copies of that state are
the same numbers. Stage 1 of ZeRO (Rajbhandari et al., 2020) keeps one copy, split over the ranks:

    1. the parameters are partitioned over the ranks, balanced by size (largest first, each to the rank holding
       the fewest elements so far: PyTorch's greedy rule), once, at construction;
    2. backward is unchanged (DDP averages the full gradient on every rank);
    3. ``step()`` runs the wrapped optimizer class on *this rank's partition only*: only its state is allocated;
    4. each owner broadcasts its freshly updated parameters, so every rank again holds all of them.

    rank 0: AdamW(partition 0).step() ─► broadcast(partition 0, src=0) ─┐
    rank 1: AdamW(partition 1).step() ─► broadcast(partition 1, src=1) ─┼─► every rank: all parameters updated
    ...                                                                  ┘

The constructor is ``torch.distributed.optim.ZeroRedundancyOptimizer``'s: swap the import and the code runs::

    model = DistributedDataParallel(MiniMLP())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    loss_fn(model(x), y).backward()
    opt.step()                      # every rank's parameters equal again, each rank stepped 1/N of them
    opt.consolidate_state_dict(0)   # then opt.state_dict() on rank 0: the whole state, PyTorch's format

Stage 2 (gradients sharded too) is ``stage2.py``, stage 3 (parameters too) ``stage3.py``; sharded checkpoints
``checkpoint.py``; the proof ``tests/integration/test_zero.py``; the walk-through ``docs/sharding.md``.
Try it: ``torchrun --standalone --nproc-per-node=2 -m app.demos.zero_demo --stage 1``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from app.diagnostics import collectives as recorded

# Optimizers that cannot step a subset of the parameters on its own: LBFGS re-evaluates the whole model through a
# closure and keeps one flat history over *all* parameters, so 1/N of it is not a smaller LBFGS.
_NOT_SHARDABLE = (torch.optim.LBFGS,)
# The most bytes one broadcast of updated parameters carries: DDP's bucket cap, large enough that a small model
# still goes in one broadcast per owner, small enough that the two in flight cost little beside the model.
BROADCAST_BUCKET_BYTES = 25 * 2**20


def refuse_unshardable(optimizer_class: type) -> None:
    """Raise a one-line ValueError if ``optimizer_class`` cannot be run on a partition of the parameters."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        # An instance's repr is its every group over several lines: its class's name keeps the error one line.
        given = getattr(optimizer_class, "__name__", f"an instance of {type(optimizer_class).__name__}")
        raise ValueError(f"optimizer_class={given}: pass a torch.optim.Optimizer subclass (the class)")
    if issubclass(optimizer_class, _NOT_SHARDABLE):
        raise ValueError(
            f"optimizer_class={optimizer_class.__name__} cannot be sharded: it needs every parameter at once "
            f"(one flat history and a closure over the whole model); use it without ZeRO, or pick e.g. AdamW"
        )


def partition_by_size(param_groups: list[dict], world_size: int) -> list[list[list[torch.Tensor]]]:
    """``[rank][group] -> parameters``: largest first, each to the rank with the fewest elements so far.

    The running sizes carry over from one group to the next, as in PyTorch, so the ranks stay balanced overall.
    Ties go to the lowest rank, so every rank computes the same partition without talking.
    """
    sizes = [0] * world_size
    partition = [[[] for _ in param_groups] for _ in range(world_size)]
    for g, group in enumerate(param_groups):
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):  # stable: equal sizes keep order
            rank = sizes.index(min(sizes))
            partition[rank][g].append(p)
            sizes[rank] += p.numel()
    return partition


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer_class`` so that each rank keeps the state of, and steps, only its partition.

    The signature is ``torch.distributed.optim.ZeroRedundancyOptimizer``'s (torch 2.13).

    Args:
        params: parameters or parameter groups, as for any ``torch.optim`` optimizer; identical on every rank.
        optimizer_class: the ``torch.optim.Optimizer`` subclass to run on this rank's partition (``AdamW``,
            ``SGD``, ...). ``LBFGS`` is refused: it needs the whole parameter set.
        process_group: the group the parameters are replicated over; ``None`` is the default (world) group.
        parameters_as_bucket_view, overlap_with_ddp: PyTorch's performance options; only ``False`` is accepted.
        **defaults: the optimizer's arguments (``lr=...``), passed to ``optimizer_class``.

    ``param_groups`` holds *all* parameters with their hyperparameters (what an LR scheduler changes);
    ``optim`` is the local optimizer over this rank's partition, as in PyTorch; ``zero_grad`` clears every
    gradient (all ranks compute all of them).
    """

    def __init__(
        self,
        params,
        optimizer_class: type[torch.optim.Optimizer],
        process_group: Any | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ):
        refuse_unshardable(optimizer_class)
        if parameters_as_bucket_view or overlap_with_ddp:
            raise NotImplementedError(
                "ZeroRedundancyOptimizer(parameters_as_bucket_view/overlap_with_ddp=True) is not implemented by "
                "app.parallel.zero.stage1; leave them False or use torch.distributed.optim.ZeroRedundancyOptimizer"
            )
        super().__init__(params, defaults)  # builds self.param_groups over all parameters
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._optimizer_class = optimizer_class
        self._partition = partition_by_size(self.param_groups, self.world_size)
        # Owner's *global* rank for each parameter: broadcast's src is a global rank even inside a subgroup.
        self._owner_global_rank = [
            dist.get_global_rank(process_group, r) if process_group is not None else r for r in range(self.world_size)
        ]
        self._owner_of = {id(p): r for r in range(self.world_size) for ps in self._partition[r] for p in ps}
        mine = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": ps}
            for group, ps in zip(self.param_groups, self._partition[self.rank])
        ]
        # The only optimizer state this rank ever allocates: that of its own partition. An empty partition (more
        # ranks than parameters) still gets a group, so group indices match across ranks and the scheduler's lr
        # reaches it.
        self.optim = optimizer_class(mine, **defaults)
        # The class's own defaults (AdamW's betas, eps, weight_decay, ...) into the groups, as PyTorch's ZeRO does:
        # state_dict() saves these groups, and a plain optimizer that loads them steps with what they hold.
        for group, local in zip(self.param_groups, self.optim.param_groups):
            group.update({k: v for k, v in local.items() if k != "params" and k not in group})
        self._all_params = [p for group in self.param_groups for p in group["params"]]
        self._consolidated: dict | None = None

    # -- training ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """Step this rank's partition, then broadcast each partition from its owner; returns the loss if given.

        A ``closure`` is run once, on every rank, before the step (it recomputes the loss and gradients).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Hyperparameters live in self.param_groups (a scheduler edits them there): copy them to the local groups.
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update({k: v for k, v in group.items() if k != "params"})
        self.optim.step(**kwargs)
        self.broadcast_partitions()
        return loss

    def broadcast_partitions(self) -> None:
        """Every rank sends its updated parameters and receives the others': flat broadcasts of at most
        ``BROADCAST_BUCKET_BYTES`` each, owner after owner.

        At most two flats are alive at once, so the copy this costs is two buckets whatever the model's size:
        one flat per owner would hold a second copy of the whole model at world 2 (two owners of half each).
        """
        pending: list[tuple] = []
        for r in range(self.world_size):
            src, group = self._owner_global_rank[r], self.process_group
            for params in runs_within([p for ps in self._partition[r] for p in ps], BROADCAST_BUCKET_BYTES):
                # Flat: one broadcast per bucket instead of one per parameter (the latency floor).
                flat = torch.cat([p.reshape(-1) for p in params]) if r == self.rank else _empty_like_flat(params)
                work = recorded.broadcast(flat, f"ZeRO-1 parameters of rank {r}", src=src, group=group, async_op=True)
                pending.append((work, params, flat))
                if len(pending) > 1:
                    _unflatten(*pending.pop(0))
        for item in pending:
            _unflatten(*item)

    # -- what this rank holds (the bench and the sharded checkpoint read these) ---------------------------------
    def owned_parameters(self) -> list[torch.Tensor]:
        """The parameters this rank steps (its partition), in partition order."""
        return [p for ps in self._partition[self.rank] for p in ps]

    def owner_of(self, param: torch.Tensor) -> int:
        """The rank (in ``process_group``) that steps ``param``."""
        return self._owner_of[id(param)]

    # -- state dicts ---------------------------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state onto rank ``to`` (in the group), so ``state_dict()`` works there.

        As in PyTorch, this holds the whole state on one rank: for a checkpoint that never does, use
        ``app.parallel.zero.checkpoint``.
        """
        index = {id(p): i for i, p in enumerate(self._all_params)}
        local = {index[id(p)]: self.optim.state[p] for p in self.owned_parameters() if self.optim.state.get(p)}
        gathered = [None] * self.world_size if self.rank == to else None
        dst = self._owner_global_rank[to]
        dist.gather_object(local, gathered, dst=dst, group=self.process_group)
        self._consolidated = None if gathered is None else {k: v for part in gathered for k, v in part.items()}

    def state_dict(self) -> dict:
        """The whole optimizer's state in PyTorch's format (``state`` by parameter index, ``param_groups``).

        Only on the rank that ``consolidate_state_dict`` gathered onto; elsewhere a RuntimeError, as in PyTorch.
        """
        if self._consolidated is None:
            raise RuntimeError(
                "ZeroRedundancyOptimizer.state_dict(): call consolidate_state_dict(to=rank) on every rank first, "
                "then state_dict() on that rank"
            )
        groups, start = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + n))}
            )
            start += n
        return {"state": dict(sorted(self._consolidated.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (from ``state_dict()``, or a plain optimizer's): each rank keeps its partition's part."""
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(state_dict['param_groups'])} parameter groups, this optimizer "
                f"{len(self.param_groups)}: it was saved from a different model or optimizer"
            )
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        owned = {id(p) for p in self.owned_parameters()}
        for index, p in enumerate(self._all_params):
            saved = state_dict["state"].get(index, state_dict["state"].get(str(index)))
            if saved is not None and id(p) in owned:
                self.optim.state[p] = {k: _to_like(v, p) for k, v in saved.items()}
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update({k: v for k, v in group.items() if k != "params"})


def runs_within(items: list, limit_bytes: int, nbytes=lambda t: t.numel() * t.element_size()):
    """``items`` in order, cut into runs of at most ``limit_bytes`` by ``nbytes(item)`` (a larger item is a run of
    its own): stage 1's broadcasts, and the files of a sharded checkpoint (app.parallel.zero.checkpoint)."""
    run, size = [], 0
    for item in items:
        n = nbytes(item)
        if run and size + n > limit_bytes:
            yield run
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        yield run


def _unflatten(work, params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Wait for one owner's broadcast and copy it into its parameters (its flat is dropped by the caller)."""
    work.wait()
    offset = 0
    for p in params:
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def _empty_like_flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)


def _to_like(value, param: torch.Tensor):
    """A saved state value placed like ``param`` (device; dtype for tensors shaped like it, as torch.optim does)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0:
        return value.clone()  # "step": kept on the CPU and in its own dtype, as torch.optim keeps it
    return value.to(device=param.device, dtype=param.dtype).clone()
