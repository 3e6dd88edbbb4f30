"""The one parameter hash: sha256 over each parameter's raw bytes, in the model's ``parameters()`` order.

Equal on two ranks means bit-identical models. ``app.worker.models.parameter_checksum(model)`` hashes a whole model;
``FullyShardedDataParallel.parameter_checksum()`` feeds the same bytes in the same order one gathered unit at a
time, so a sharded run's FINISHED checksum equals an unsharded run's without any rank holding the whole model.
"""

from __future__ import annotations

import hashlib

import torch


def update(h, tensor: torch.Tensor) -> None:
    """Feed ``tensor``'s bytes to the hash ``h``: a uint8 view, so any dtype (bf16 has no numpy type) as it lies."""
    h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def tensors_checksum(tensors) -> str:
    """The hex digest of ``tensors``, in order."""
    h = hashlib.sha256()
    for t in tensors:
        update(h, t)
    return h.hexdigest()
