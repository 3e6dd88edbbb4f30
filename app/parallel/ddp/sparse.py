"""Sparse gradients in our DistributedDataParallel: ``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)``.

Such a layer's backward gives ``p.grad`` as a sparse COO tensor: the rows this rank's batch looked up, not the whole
table. A dense bucket cannot hold it (copying sparse into dense is not implemented, and would cost the whole table
anyway), so, as PyTorch's DDP does, these parameters stay out of the buckets and are all-reduced on their own: the
local gradient divided by the world size, then SUM. gloo reduces sparse tensors as such (the union of the ranks'
rows); NCCL has no sparse all-reduce and PyTorch's DDP refuses sparse gradients with it (so do we, at
construction).

PyTorch decides which parameters these are from the module type, before any backward: so do we
(``sparse_gradient_params``). What differs from PyTorch's: the reduction runs once backward has ended, after the
dense buckets, on every rank in parameter order (collectives match by call order), so it does not overlap backward;
and comm hooks apply to the dense buckets only. A weight tied to a dense use (an embedding shared with the output
layer) gets a dense gradient: it is reduced here all the same, dense.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from app.diagnostics import collectives as recorded


def sparse_gradient_params(module: nn.Module) -> set[int]:
    """``id()`` of every parameter whose gradient is sparse by construction (PyTorch's rule for its DDP)."""
    return {
        id(p)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        for p in m.parameters(recurse=False)
        if p.requires_grad
    }


class SparseGradients:
    """All-reduce (average) the gradients of ``params`` over ``process_group``: called by the reducer at the end of
    each synchronising backward, so that ``no_sync()`` leaves them to accumulate locally as it does dense ones."""

    def __init__(self, params: list[nn.Parameter], process_group, names: dict[int, str]):
        self.params = params
        self.process_group = process_group
        self.divisor = dist.get_world_size(process_group)  # (join() may set the ranks still training)
        if params and dist.get_backend(process_group) == dist.Backend.NCCL:
            raise RuntimeError(
                f"{names[id(params[0])]!r} has sparse gradients (sparse=True), which NCCL cannot all-reduce: "
                f"construct the embedding with sparse=False, or use the gloo backend"
            )

    @staticmethod
    def empty_gradient(p: nn.Parameter) -> torch.Tensor:
        """A sparse gradient of ``p`` with no rows: what a rank that looked nothing up contributes."""
        rows = torch.empty(1, 0, dtype=torch.long, device=p.device)
        return torch.sparse_coo_tensor(rows, p.new_empty((0, *p.shape[1:])), p.shape)

    def shadow(self) -> None:
        """``reduce``'s all-reduces, with no rows: a rank that ran out of inputs (``join.py``) matching the others."""
        for i, p in enumerate(self.params):
            recorded.all_reduce(self.empty_gradient(p), f"DDP sparse gradient {i}", group=self.process_group)

    def reduce(self) -> None:
        for i, p in enumerate(self.params):
            grad = p.grad
            if grad is None:  # not looked up on this rank: it still takes part, with no rows
                grad = self.empty_gradient(p)
            elif grad.is_sparse:
                grad = grad.coalesce()  # (one entry per row: the division below then divides each row once)
            grad.div_(self.divisor)
            recorded.all_reduce(grad, f"DDP sparse gradient {i}", group=self.process_group)  # (SUM)
            if p.grad is not None or grad._nnz():  # a table no rank looked up keeps p.grad None, as a dense one
                p.grad = grad
