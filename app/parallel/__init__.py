"""What this project teaches and measures, one idea per file, none of it importing the training worker.

- ``ddp.py``: ``DistributedDataParallel`` from scratch (broadcast, buckets, async all-reduce, ``no_sync``, ...)
- ``comm_hooks.py``: comm hooks for it (plain all-reduce, fp16, bf16), PyTorch's signature
- ``accum.py``: the gradient-accumulation step (``accumulation_step``) and its recipe (``StepRecipe``: autocast,
  GradScaler, clipping)
- ``probes.py``: what one step's communication cost, whichever wrapper did it
- ``zero.py``: ZeRO stage 1, ``ZeroRedundancyOptimizer`` (optimizer state sharded), PyTorch's constructor
- ``sharded_grad.py``: ZeRO stage 2, ``ShardedGradDataParallel`` (gradients reduce-scattered, state sharded)
- ``fsdp.py``: ZeRO stage 3, ``FullyShardedDataParallel`` (parameters sharded too, gathered per unit)
- ``sharded_checkpoint.py``: ``save_sharded`` / ``load_sharded`` for stages 1-3, reshardable to another world size

``wrap_model`` is the one place that chooses between our wrapper and PyTorch's: the demo, the trainer and the
benchmarks all call it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

# torch is imported inside wrap_model, not here: app.worker.config reads WRAPPERS, and a bad flag must fail before the
# seconds-long torch import.
WRAPPERS = ("ours", "torch", "none")  # ours: app.parallel.ddp; torch: torch.nn.parallel; none: the bare module


def wrap_model(model: nn.Module, wrapper: str = "ours", *, bucket_cap_mb: float | None = None, **kwargs) -> nn.Module:
    """Wrap ``model`` for data-parallel training in the current process group.

    Args:
        model: the module, already on this rank's device.
        wrapper: ``"ours"`` (``app.parallel.ddp.DistributedDataParallel``), ``"torch"``
            (``torch.nn.parallel.DistributedDataParallel``) or ``"none"`` (the model itself: one process).
        bucket_cap_mb: gradient bucket size in MiB (both wrappers); ``None`` is PyTorch's default (25, and a
            1 MiB first bucket).
        **kwargs: passed on to the wrapper; both take PyTorch's constructor arguments (``find_unused_parameters``,
            ``gradient_as_bucket_view``, ``static_graph``, ``process_group``, ...).

    On CUDA, ``device_ids`` is set to the model's device, as PyTorch's DDP expects one GPU per process.

    Example::

        model = wrap_model(MiniMLP(), "ours", bucket_cap_mb=25)
        loss_fn(model(x), y).backward()  # gradients are averaged over the ranks when this returns
    """
    import torch

    if wrapper == "none":
        return model
    device = next(model.parameters()).device
    if device.type == "cuda":
        kwargs.setdefault("device_ids", [device])
    if wrapper == "torch":
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, **kwargs)
    if wrapper == "ours":
        from app.parallel.ddp import DistributedDataParallel

        return DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, **kwargs)
    raise ValueError(f"wrapper={wrapper!r}: choose one of {', '.join(WRAPPERS)}")


# The ZeRO classes, importable from here without making ``import app.parallel`` import torch (see WRAPPERS).
_LAZY = {
    "ZeroRedundancyOptimizer": "app.parallel.zero",
    "ShardedGradDataParallel": "app.parallel.sharded_grad",
    "FullyShardedDataParallel": "app.parallel.fsdp",
    "save_sharded": "app.parallel.sharded_checkpoint",
    "load_sharded": "app.parallel.sharded_checkpoint",
    "CheckpointError": "app.parallel.sharded_checkpoint",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
