"""Parameters that get no gradient in a backward, for the reducer (``reducer.py``; this is a part of its class).

A bucket launches once every one of its parameters is ready, so a parameter whose hook never fires would hold its
bucket, and every rank with it, forever. The reducer learns which parameters those are in one of two ways:

- ``find_unused_parameters``: before each backward, by walking the autograd graph from forward's outputs
  (``graph_walk.py``); they are marked ready at the first hook;
- ``static_graph``: once, in the first iteration, from the hooks themselves, as PyTorch's does. That iteration
  reduces nothing while backward runs: at its end the parameters whose hook never fired are the unused ones, every
  bucket fills and launches, and later iterations reuse the set and the order the gradients arrived in. No graph
  walk: a reentrant ``torch.utils.checkpoint`` recomputes its part of the graph during backward, out of a walk's
  reach, and its parameters' hooks fire all the same.

Then one small all-reduce of used flags tells every rank which parameters no rank used (their ``p.grad`` stays
None, as in PyTorch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class UnusedParameters:
    """The reducer's methods for unused parameters and ``static_graph`` (they use the reducer's state)."""

    def _mark_learned(self) -> None:
        """End of static_graph's first backward: what arrived is used, the rest unused; mark all ready, in the
        order they arrived (unused first, as find_unused_parameters marks them), which launches every bucket."""
        arrived = list(dict.fromkeys(self._arrival_order))  # (a reentrant checkpoint may fire a hook twice)
        seen = set(arrived)
        self._unused = [i for i in range(len(self._params)) if i not in seen]
        self._locally_unused = [i for i in self._unused if self._params[i].grad is None]
        self._arrival_order = self._unused + arrived
        for index in self._arrival_order:
            self._mark_ready(index)

    def _globally_used_flags(self) -> list[bool] | None:
        """Which parameters some rank used (only those get a gradient); ``None`` when all are, by construction."""
        if self._static_used_flags is not None:
            return self._static_used_flags  # static graph: the first iteration's answer holds for every iteration
        if not (self.find_unused_parameters or self.static_graph):
            return None
        used = torch.ones(len(self._params), dtype=torch.int32, device=self.device)
        used[self._locally_unused] = 0  # not reached by this forward and no gradient accumulated under no_sync()
        if not self.skip_all_reduce_unused_params:
            # One tiny extra all-reduce, as in PyTorch. int32 rather than bool: NCCL and gloo both SUM int32.
            dist.all_reduce(used, op=dist.ReduceOp.SUM, group=self.process_group)
        return used.bool().tolist()

    def _learn_static_graph(self, globally_used: list[bool] | None) -> None:
        """End of the first iteration under static_graph: keep what it found, rebuild buckets in arrival order."""
        self._static_unused = list(self._unused)
        self._static_used_flags = globally_used if globally_used is not None else [True] * len(self._params)
        # Every rank must bucket identically (collectives match by call order): rank 0's order is the order.
        order = torch.tensor(self._arrival_order, dtype=torch.int64, device=self.device)
        dist.broadcast(order, src=self._src_rank, group=self.process_group)
        if order.tolist() == [i for b in self._buckets for i in b.param_indices]:
            return  # gradients arrived in bucket order already
        self._buckets, self._slot = self._build_buckets(order.tolist())
        if self.gradient_as_bucket_view:
            with torch.no_grad():
                for index, p in enumerate(self._params):
                    if p.grad is not None:  # a slot of the old buckets: move it into the new ones
                        p.grad = self._slot[index][1].copy_(p.grad)
