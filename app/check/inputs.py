"""What the check trains on: the user's data (a spec) or a synthetic batch inferred from the model, and the loss.

Everything here runs in the parent process, before any rank starts, so that a wrong spec, a data set too small or a
forward that fails on the inferred input is a one-line ``InputError`` (exit code 2), not a crash on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.specs import SpecError, build
from app.specs import build_loss as build_loss_spec

SEQ_LEN = 16  # tokens per sample in the synthetic input of a model that starts with an Embedding
CONV_SIDE = {1: 64, 2: 16, 3: 8}  # spatial size per dimension of the synthetic input of a ConvNd-first model


class InputError(ValueError):
    """The model, data or loss cannot be used as given; one line saying which and what to do."""


def build_data(spec: str, kwargs: dict, needed: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The first ``needed`` samples of what the data spec returns: ``(inputs, targets)`` tensors or a map-style
    data set of ``(input, target)`` pairs (collated with PyTorch's ``default_collate``)."""
    data = build(spec, kwargs)
    if isinstance(data, tuple | list) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        inputs, targets = data
        if len(inputs) != len(targets):
            raise SpecError(f"spec {spec!r}: inputs have {len(inputs)} samples, targets {len(targets)}")
        size, kind = len(inputs), "tensors"
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        size, kind = len(data), f"a {type(data).__name__} data set"
    else:
        raise SpecError(f"spec {spec!r}: returned a {type(data).__name__}, not (inputs, targets) tensors or a data set")
    if size < needed:
        raise InputError(
            f"--data {spec}: {size} samples, the check needs steps x ranks x accum x micro-batch = {needed}: "
            f"lower --steps or --micro-batch"
        )
    if kind != "tensors":
        from torch.utils.data import default_collate

        pairs = [data[i] for i in range(needed)]
        if not all(isinstance(p, tuple | list) and len(p) == 2 for p in pairs[:1]):
            raise SpecError(f"spec {spec!r}: items are {type(pairs[0]).__name__}, not (input, target) pairs")
        inputs, targets = default_collate(pairs)
    return inputs[:needed], targets[:needed], f"{spec} ({kind}, the first {needed} samples in order)"


def synthetic_data(model: nn.Module, needed: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Inputs shaped for the model's first Linear, Embedding or Conv layer; targets shaped like its output.

    Integer inputs (an Embedding first) get integer targets in ``[0, output's last dim)``: next-token style
    classification, so the default loss is cross-entropy. Float inputs get N(0, 1) targets: MSE.
    """
    g = torch.Generator().manual_seed(seed)
    first = next(
        (m for m in model.modules() if isinstance(m, nn.Linear | nn.Embedding | nn.modules.conv._ConvNd)), None
    )
    if isinstance(first, nn.Embedding):
        inputs = torch.randint(0, first.num_embeddings, (needed, SEQ_LEN), generator=g)
        shape = f"token ids in [0, {first.num_embeddings}) of shape [N, {SEQ_LEN}]"
    elif isinstance(first, nn.Linear):
        inputs = torch.randn(needed, first.in_features, generator=g, dtype=first.weight.dtype)
        shape = f"N(0, 1) of shape [N, {first.in_features}]"
    elif first is not None:
        dims = len(first.kernel_size)
        side = (CONV_SIDE[dims],) * dims
        inputs = torch.randn(needed, first.in_channels, *side, generator=g, dtype=first.weight.dtype)
        shape = f"N(0, 1) of shape [N, {first.in_channels}, {', '.join(map(str, side))}]"
    else:
        raise InputError(
            f"{type(model).__name__} has no Linear, Embedding or Conv layer to infer an input from: --data"
        )
    name = next(n for n, m in model.named_modules() if m is first)
    out = _forward_once(model, inputs[:2], f"the synthetic input ({shape}, from {name})")
    if inputs.dtype == torch.long:
        targets = torch.randint(0, out.shape[-1], (needed, *out.shape[1:-1]), generator=g)
        target_kind = f"class ids in [0, {out.shape[-1]})"
    else:
        targets = torch.randn(needed, *out.shape[1:], generator=g, dtype=out.dtype)
        target_kind = "N(0, 1) shaped like the output"
    return (
        inputs,
        targets,
        f"synthetic: inputs {shape}, inferred from {name} ({type(first).__name__}); targets {target_kind}",
    )


def _forward_once(model: nn.Module, x: torch.Tensor, what: str) -> torch.Tensor:
    import copy

    try:
        out = copy.deepcopy(model)(x)  # a copy: a model that builds layers in forward must still start fresh
    except Exception as e:
        raise InputError(f"the model's forward failed on {what}: {type(e).__name__}: {e}; pass --data") from None
    if not isinstance(out, torch.Tensor):
        raise InputError(f"the model's forward returned a {type(out).__name__} on {what}: the check needs a tensor")
    return out


def check_pipeline_split(model: nn.Module, stages: int, cuts: list[str] | None, sample: torch.Tensor) -> list[str]:
    """Where ``--parallel pipeline`` cuts ``model`` into ``stages``: the names where stages 2.. begin (``cuts``, or
    balanced by parameter count), after the pipeline's own checks (``app.parallel.pipeline.split``): the model is
    its sequence of children, every stage holds parameters. InputError naming the flags otherwise."""
    import copy

    from app.parallel.pipeline.split import check_sequence, model_sequence, split_names, stage_ranges

    probe = copy.deepcopy(model)  # a model that builds layers in its forward must still start fresh
    sequence = model_sequence(probe)
    try:
        check_sequence(probe, sequence, sample)
        return split_names(sequence, stage_ranges(sequence, stages, cuts))
    except ValueError as e:
        flags = f"--parallel pipeline --ranks {stages}" + (f" --pipeline-split {','.join(cuts)}" if cuts else "")
        raise InputError(f"{flags}: {e}") from None


def mean_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The default loss: cross-entropy over the last dim for integer targets (``[B, C]`` or ``[B, T, C]``), else
    MSE. Both are means over the samples, which is what lets N ranks' averaged gradients equal one process's."""
    if not target.is_floating_point():
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.mse_loss(output, target)


def build_loss(spec: str | None, kwargs: dict):
    """The loss function ``loss(output, target) -> scalar`` (``app.specs.build_loss``: a class instantiated with the
    keywords, a function with them bound); no spec: ``mean_loss``."""
    if spec is None:
        if kwargs:
            raise InputError("--loss-kwargs needs --loss")
        return mean_loss
    return build_loss_spec(spec, kwargs)


def check_loss(loss_fn, model: nn.Module, x: torch.Tensor, y: torch.Tensor, what: str) -> None:
    """One forward and loss before any rank starts: a mismatch of shapes or dtypes is input, not a DDP problem."""
    out = _forward_once(model, x, what)
    try:
        loss = loss_fn(out, y)
    except Exception as e:
        raise InputError(f"the loss failed on the model's output and {what}: {type(e).__name__}: {e}") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise InputError(f"the loss returned {type(loss).__name__} {getattr(loss, 'shape', '')}, not a scalar tensor")
