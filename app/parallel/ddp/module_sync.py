"""What our DDP moves besides gradients: module state broadcast from one rank, forward inputs moved to the device.

``module.py`` broadcasts parameters and buffers at construction and buffers before forwards, ``join.py`` the final
model, ZeRO stage 2 (and through it stage 3) the initial one: all through ``broadcast_coalesced``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BROADCAST_CAP_BYTES = 25 * 2**20  # a flat broadcast's size, as DDP's default bucket


def broadcast_coalesced(tensors: list[torch.Tensor], src: int, group, cap_bytes: int = BROADCAST_CAP_BYTES) -> None:
    """Broadcast ``tensors`` from global rank ``src`` in place, one collective per run of same-kind tensors.

    Flat broadcasts instead of one per tensor, for the same reason buckets exist; each flat holds consecutive
    tensors of one (device, dtype) up to ``cap_bytes`` (a bigger tensor goes alone), so the copy it costs is one
    chunk, never the whole model: a ZeRO rank that holds 1/N of the state must not hold two models to agree on one.
    """
    chunks: list[list[torch.Tensor]] = []
    sizes: list[int] = []  # each chunk's bytes
    open_chunk: dict[tuple, int] = {}  # (device, dtype) -> the index of its chunk still being filled
    for t in tensors:
        kind, nbytes = (t.device, t.dtype), t.numel() * t.element_size()
        i = open_chunk.get(kind)
        if i is None or sizes[i] + nbytes > cap_bytes:
            i = open_chunk[kind] = len(chunks)
            chunks.append([])
            sizes.append(0)
        chunks[i].append(t)
        sizes[i] += nbytes
    for chunk in chunks:
        flat = torch.cat([t.detach().reshape(-1) for t in chunk])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        with torch.no_grad():
            for t in chunk:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        del flat  # before the next chunk's: one chunk's copy at a time


def device_of(d) -> torch.device:
    """``device_ids`` entries as PyTorch accepts them: an int (a CUDA index), a string or a ``torch.device``."""
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


def same_device(a: torch.device, b: torch.device) -> bool:
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return a.type == b.type and (current if a.index is None else a.index) == (current if b.index is None else b.index)


def to_device(obj, device: torch.device):
    """Move every tensor in a (nested) forward input to ``device``, as PyTorch's DDP does when given device_ids."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj
