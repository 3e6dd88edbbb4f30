"""Gradient buckets: the flat buffers our DistributedDataParallel all-reduces, and the rule that fills them.

Read with ``reducer.py``, which copies gradients into these buckets and launches their all-reduces. ``GradBucket``
has PyTorch's ``GradBucket`` accessors, so a comm hook written for PyTorch's DDP runs on ours unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


class GradBucket:
    """One flat buffer holding the gradients of several parameters, with PyTorch's ``GradBucket`` accessors.

    Flattening is what makes buckets pay: one all-reduce of 25 MB costs about one latency floor, while a thousand
    all-reduces of 25 KB each pay it a thousand times. ``compressed`` (ours): the buffer holds each gradient already
    divided by the world size and cast to the comm hook's ``wire_dtype`` (see ``app/parallel/ddp/comm_hooks.py``).
    """

    def __init__(
        self, index: int, params: list[nn.Parameter], param_indices: list[int], is_last: bool, wire_dtype=None
    ):
        self.position = index  # index() to a comm hook; the reducer reads it once per gradient, on its hot path
        self.params = params
        self.param_indices = param_indices  # positions of our parameters in the wrapper's parameter list
        self._is_last = is_last
        numels = [p.numel() for p in params]
        offsets = [sum(numels[:i]) for i in range(len(params))]
        # All parameters of one bucket share dtype and device (see assign_buckets), so one buffer fits all.
        self.compressed = wire_dtype is not None
        self.scale: torch.Tensor | None = None  # the reducer's 1 / world size, a 0-dim tensor (reducer.py)
        self.batched = False  # the reducer's batched_grad_copy applies to this bucket
        self.lendable: list[int] = []  # positions whose slot the reducer may hand to p.grad (reducer._plan_lending)
        self.grouped_spans: list[torch.Tensor] = []  # the memory of slots copied together (reducer._copy_grouped)
        self.inbox: torch.Tensor | None = None  # where a compressed bucket's Exchange receives (comm_hooks.py)
        self.offsets = offsets
        self._buffer = torch.zeros(sum(numels), dtype=wire_dtype or params[0].dtype, device=params[0].device)
        self.views = self._make_views()

    def _make_views(self) -> list[torch.Tensor]:
        # Views made once: slicing per gradient per step would cost Python time on the backward's critical path.
        return [self._buffer[o : o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]

    # -- Lending slots to p.grad (reducer.py, _plan_lending) --------------------------------------------------------
    def shared_elsewhere(self, lent: int) -> bool:
        """Whether a tensor other than the buffer, our views (and spans) and ``lent`` gradients handed their slot
        shares this bucket's memory: one the user kept (an old ``p.grad``, a ``detach()`` or slice of it).

        Every tensor that shares a storage holds one reference to it, and so does the temporary storage object
        made here to ask (PyTorch's CUDA-graph trees ask the same way whether a storage is still in use).
        """
        users = torch._C._storage_Use_Count(self._buffer.untyped_storage()._cdata)
        return users > 2 + len(self.views) + len(self.grouped_spans) + lent

    def renew(self) -> None:
        """A new buffer and views for this bucket; the old memory stays with whoever still holds it."""
        self._buffer = torch.empty_like(self._buffer)  # every slot is written before the next all-reduce
        self.views = self._make_views()

    # -- PyTorch's GradBucket interface, what comm hooks may call ------------------------------------------------
    def index(self) -> int:
        return self.position

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self) -> list[nn.Parameter]:
        return list(self.params)

    def gradients(self) -> list[torch.Tensor]:
        return list(self.views)

    @property
    def nbytes(self) -> int:
        return self._buffer.numel() * self._buffer.element_size()


def assign_buckets(params: list[nn.Parameter], order: list[int], first_cap: int, bucket_cap: int) -> list[list[int]]:
    """Group parameter indices, taken in ``order``, into buckets: bucket 0 of ``first_cap`` bytes, the rest
    ``bucket_cap``.

    The order is the *reverse* registration order at construction: backward runs roughly from the last layer to
    the first, so the last-registered parameters get their gradients first, and putting them in bucket 0 lets the
    first all-reduce start while the earlier layers' gradients are still being computed: the overlap. PyTorch's rule
    (``dist._compute_bucket_assignment_by_size``): a bucket closes once it holds at least its cap.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index in order:
        p = params[index]
        first = params[current[0]] if current else None
        if first is not None and (p.dtype, p.device) != (first.dtype, first.device):
            groups.append(current)  # one dtype and device per bucket: it is one flat tensor
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += p.numel() * p.element_size()
        cap = first_cap if not groups else bucket_cap
        if current_bytes >= cap:
            groups.append(current)
            current, current_bytes = [], 0
    if current:
        groups.append(current)
    return groups
