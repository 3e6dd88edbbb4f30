"""Tensor parallelism on one pair of Linear layers, on PyTorch's engine (``torch.distributed.tensor.parallel``).

Where model and pipeline parallelism give each rank whole layers, tensor parallelism splits *inside* a layer. The
classic pair (Megatron-LM's MLP) is a column split followed by a row split:

    x (replicated) ─► Linear A, columns split: rank r holds rows r of A.weight ─► hidden, sharded by feature
                   ─► ReLU (elementwise: no communication)
                   ─► Linear B, rows split: rank r holds the matching columns of B.weight ─► partial sums
                   ─► all-reduce ─► y (replicated)

So the pair costs one all-reduce of the output in forward and one of the input's gradient in backward, whatever the
hidden width: the hidden activation never crosses. Each rank holds 1/world of both weight matrices.

    mesh = init_device_mesh("cpu", (world_size,))            # after init_process_group; "cuda" on GPUs
    model = parallelize_linear_pair(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)), mesh)
    F.mse_loss(model(x), y).backward(); optimizer.step()     # x and y the same on every rank

The parameters become ``DTensor``s: ``p.to_local()`` is this rank's shard, ``p.full_tensor()`` the whole matrix
(a collective: every rank must call it).
"""

from __future__ import annotations

from torch import nn


def parallelize_linear_pair(model: nn.Sequential, mesh, first: str = "0", second: str = "2") -> nn.Sequential:
    """Split ``model[first]`` by columns (output features) and ``model[second]`` by rows (input features).

    Args:
        model: a module whose children ``first`` and ``second`` are ``nn.Linear`` layers with only elementwise
            modules between them.
        mesh: a 1-D ``DeviceMesh`` over the ranks that share the pair.
        first, second: the two layers' names in ``model``.

    Example::

        tp = parallelize_linear_pair(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)), mesh)
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layers = dict(model.named_children())
    for name in (first, second):
        if not isinstance(layers.get(name), nn.Linear):
            raise ValueError(f"model[{name!r}] is not an nn.Linear: name the two Linear layers of the pair")
    hidden = layers[first].out_features
    if hidden % mesh.size():
        raise ValueError(f"hidden width {hidden} does not split over {mesh.size()} ranks: use a multiple of it")
    return parallelize_module(model, mesh, {first: ColwiseParallel(), second: RowwiseParallel()})


def all_reduce_bytes_per_step(batch: int, in_features: int, out_features: int, element_size: int = 4) -> int:
    """What the pair all-reduces per step: the output [batch, out] in forward, the input gradient [batch, in] in
    backward (each an all-reduce of that many bytes, whatever the hidden width)."""
    return batch * (out_features + in_features) * element_size
