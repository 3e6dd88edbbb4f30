"""What this project teaches and measures, a package or file per way to parallelise, none of it importing the worker.

- ``ddp/``: ``DistributedDataParallel`` from scratch (broadcast, buckets, async all-reduce, ``no_sync``, comm hooks,
  join, sparse gradients)
- ``accum.py``: the gradient-accumulation step (``accumulation_step``) and its recipe (``StepRecipe``: autocast,
  GradScaler, clipping)
- ``probes.py``: what one step's communication cost, whichever wrapper did it
- ``zero/``: ZeRO stages 1-3 (``ZeroRedundancyOptimizer``, ``ShardedGradDataParallel``, ``FullyShardedDataParallel``)
  and their sharded checkpoints (``save_sharded`` / ``load_sharded``, reshardable to another world size)
- ``pipeline/``: pipeline parallelism across ranks (GPipe, 1F1B) on ``torch.distributed.pipelining``
- ``model_parallel.py``, ``tensor_parallel.py``, ``activation_checkpointing.py``: the other ways to split a model

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


# The wrappers, importable from here without making ``import app.parallel`` import torch (see WRAPPERS).
_LAZY = {
    "DistributedDataParallel": "app.parallel.ddp",
    "ZeroRedundancyOptimizer": "app.parallel.zero",
    "ShardedGradDataParallel": "app.parallel.zero",
    "FullyShardedDataParallel": "app.parallel.zero",
    "save_sharded": "app.parallel.zero",
    "load_sharded": "app.parallel.zero",
    "CheckpointError": "app.parallel.zero",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
