"""Uneven inputs: ``with model.join():`` for our DistributedDataParallel, as PyTorch's DDP has it.

When ranks have different numbers of batches, a rank that runs out stops calling forward and backward, and the
others would wait forever in their next all-reduce. PyTorch's ``torch.distributed.algorithms.join.Join`` context
manager keeps the finished ("joined") ranks answering: each iteration it asks how many ranks still train, and while
any does, it runs each joinable's ``main_hook``, which must issue the same collectives, in the same order, as one
training iteration of the others. Ours does, per iteration:

1. ``Join``'s count of the ranks still training (an all-reduce both sides take part in; ``ddp.forward`` starts it);
2. the buffer broadcast, where the forward would sync buffers, from the highest rank still training (rank 0 may have
   joined, with stale buffers): an all-reduce (MAX) to agree on that rank, then the broadcast;
3. whether this iteration synchronises (an all-reduce of 1 or 0): ``no_sync()`` iterations send nothing more;
4. if it does: one all-reduce of zeros per bucket, in bucket order; the used-flags all-reduce where the reducer has
   one (``find_unused_parameters``); the sparse gradients' all-reduces, empty.

A joined rank contributes zeros, so the average is over the world size (``divide_by_initial_world_size=True``, the
default) or over the ranks still training (``False``: ``Reducer.set_divisor`` each iteration). At the end every
rank takes the parameters and buffers of the last rank to join (the highest, if several). Not handled (refused at
``join()`` with a one-line error): a comm hook, ``static_graph`` and ``skip_all_reduce_unused_params``, whose
collectives a joined rank cannot tell in advance.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from app.diagnostics import collectives as recorded
from app.parallel.ddp.module_sync import broadcast_coalesced

SYNC_FLAG = "DDP join: does this step sync"  # one source on both sides: a joined rank's shadow and a training rank


def join_context(
    ddp, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
):
    """``DistributedDataParallel.join``: PyTorch's ``Join`` context manager over ``ddp`` alone."""
    options = {
        "a comm hook": ddp.reducer.has_comm_hook,
        "static_graph": ddp.static_graph,
        "skip_all_reduce_unused_params": ddp.skip_all_reduce_unused_params,
    }
    refused = next((name for name, on in options.items() if on), None)
    if enable and refused:
        raise NotImplementedError(
            f"DistributedDataParallel.join() with {refused} is not implemented by app.parallel.ddp: train "
            f"without it, or use torch.nn.parallel.DistributedDataParallel"
        )
    return Join(
        [ddp],
        enable,
        throw_on_early_termination,
        divide_by_initial_world_size=divide_by_initial_world_size,
    )


class DDPJoinHook(JoinHook):
    """What a joined rank does for ``ddp`` while others train (``main_hook``) and once all have joined."""

    def __init__(self, ddp, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp.divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        if ddp.will_sync_module_buffers():
            ddp.sync_module_buffers(still_training=False)
        sync = torch.zeros(1, device=ddp.device)
        recorded.all_reduce(sync, SYNC_FLAG, group=ddp.process_group)
        ddp.require_forward_param_sync = bool(sync.item())  # as after the others' forward
        if not sync.item():
            return  # the others' iteration runs under no_sync(), or without grad: nothing more to match
        ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = dist.get_global_rank(ddp.process_group, common_rank(ddp, candidate=is_last_joiner))
        buffers = list(ddp.module.buffers()) if ddp.forward_sync_buffers else []
        broadcast_coalesced([p.data for p in ddp.module.parameters()] + buffers, src=src, group=ddp.process_group)


def common_rank(ddp, candidate: bool) -> int:
    """The highest rank of ``ddp``'s group among those that are candidates (the group rank; PyTorch's rule)."""
    rank = torch.tensor([dist.get_rank(ddp.process_group) if candidate else -1], device=ddp.device)
    recorded.all_reduce(rank, "DDP join: the common rank", op=dist.ReduceOp.MAX, group=ddp.process_group)
    return int(rank.item())


def notify(ddp, sync: bool) -> None:
    """At the start of a forward inside ``join()`` on a rank still training: the count of ranks still training (and
    the divisor it sets), then, after the buffers, whether this iteration synchronises (steps 1 and 3 above)."""
    work = Join.notify_join_context(ddp)
    if work is not None and sync:  # (set each time: an earlier join() may have divided otherwise)
        divide_by_all = ddp.divide_by_initial_world_size
        ddp.reducer.set_divisor(ddp.world_size if divide_by_all else int(work.get_future().wait()[0].item()))


def tell_sync(ddp, sync: bool) -> None:
    recorded.all_reduce(torch.tensor([float(sync)], device=ddp.device), SYNC_FLAG, group=ddp.process_group)
