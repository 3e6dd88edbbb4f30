"""Where a model is cut into pipeline stages: the model as a sequence of modules, and the stages' ranges over it.

A pipeline stage runs a run of consecutive modules, so the model must *be* a sequence: its forward calls its
children one after the other, each on the previous one's output. ``model_sequence`` lists that sequence, with an
``nn.Sequential`` or ``nn.ModuleList`` child expanded into its own children (``net.0``, ``net.1``, ...; a
transformer's ``embed, blocks.0 .. blocks.N, head``). ``check_sequence`` proves the model is that sequence: the
chain of its modules must give the model's own output on a sample.

A split names the module at which each stage after the first begins (``net.2`` for 2 stages, ``blocks.4,blocks.8``
for 3; a container names its first item: ``blocks.4`` for ``blocks.4.0`` when ``blocks.4`` is an ``nn.Sequential``);
``None`` splits by parameter count (``balance_partition``, as ``split_model`` does). Every stage must hold
parameters: a stage of activations only would pass tensors on and add a hop to the pipeline for nothing.

    sequence = model_sequence(model)                     # [("net.0", Linear), ("net.1", Tanh), ("net.2", Linear)]
    check_sequence(model, sequence, x)                   # ValueError unless the chain is the model's forward
    ranges = stage_ranges(sequence, 2, ["net.2"])        # [(0, 2), (2, 3)]
    stage = SequenceStage(sequence[2:3])                 # its state_dict keys are the whole model's: net.2.weight

Every error is a ``ValueError`` with one line naming the cause and the fix; the worker adds the setting's name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from app.parallel.model_parallel import balance_partition

Named = Sequence[tuple[str, nn.Module]]


def model_sequence(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``model``'s children in order, ``nn.Sequential``/``nn.ModuleList`` children expanded into theirs (at any
    depth), each under its name in ``model.named_modules()``. A model that is itself a container is expanded too."""
    items: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, nn.Sequential | nn.ModuleList):
            items += model_sequence(child, f"{prefix}{name}.")
        else:
            items.append((f"{prefix}{name}", child))
    return items


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _names(sequence: Named) -> str:
    # The names a user can cut at, shortened when there are many: the first three and the last.
    names = [name for name, _ in sequence]
    return ", ".join(names) if len(names) <= 5 else f"{', '.join(names[:3])} .. {names[-1]}"


def check_sequence(model: nn.Module, sequence: Named, sample: torch.Tensor) -> None:
    """``ValueError`` unless running ``sequence`` in order on ``sample`` is ``model``'s forward on it, and the
    sequence holds every parameter and buffer of the model (a stage can only carry what its modules hold)."""
    kind = type(model).__name__
    if len(sequence) < 2:
        raise ValueError(
            f"{kind} has {len(sequence)} child module(s) to cut between; a pipeline needs its forward to be a "
            f"sequence of child modules (an nn.Sequential, or children called in order)"
        )
    held = {f"{name}.{key}" for name, module in sequence for key in module.state_dict()}
    outside = [key for key in model.state_dict() if key not in held]
    if outside:
        raise ValueError(
            f"{kind}'s {outside[0]} belongs to no module of its sequence ({_names(sequence)}); a stage carries only "
            f"whole child modules: move it into one"
        )
    training = model.training
    model.eval()  # dropout off, BatchNorm's running statistics untouched: the two outputs must compare
    try:
        with torch.no_grad():
            expected = model(sample)
            out = sample
            for _, module in sequence:
                out = module(out)
        same = isinstance(out, torch.Tensor) and out.shape == expected.shape and torch.allclose(out, expected)
    except Exception as e:  # a child that needs more than the previous one's output (a mask, a skip)
        raise ValueError(
            f"{kind} is not the sequence of its children ({_names(sequence)}): calling them in order raised "
            f"{type(e).__name__}; write its forward as those children one after the other"
        ) from None
    finally:
        model.train(training)
    if not same:
        raise ValueError(
            f"{kind}'s forward is not its children in order ({_names(sequence)}): the chain gives another output; "
            f"write its forward as those children one after the other (no skips, no reuse)"
        )


def stage_ranges(sequence: Named, num_stages: int, split: Sequence[str] | None = None) -> list[tuple[int, int]]:
    """``[(first, end), ...]``: each stage's index range in ``sequence``; ``split`` names where stages 2.. begin
    (``None``: balanced by parameter count). ``ValueError`` for a name not in the sequence, cuts out of order or
    of the wrong count, or a stage without parameters."""
    if split is None:
        return _balanced(sequence, num_stages)
    if len(split) != num_stages - 1:
        raise ValueError(
            f"{len(split)} cut(s) for {num_stages} stages: name the {num_stages - 1} module(s) where stages 2.. begin"
        )
    starts = [0] + [_start(sequence, name) for name in split]
    if starts[1] == 0:
        raise ValueError(f"{split[0]!r} is where the model begins, so stage 0 would be empty: cut at a later module")
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"the cuts {', '.join(split)} are not in forward order: name them as the forward runs them")
    ranges = list(zip(starts, starts[1:] + [len(sequence)]))
    for stage, (first, end) in enumerate(ranges):
        if not any(_has_params(module) for _, module in sequence[first:end]):
            raise ValueError(
                f"stage {stage} ({_names(sequence[first:end])}) has no parameters; move the cut so that every "
                f"stage holds a module with parameters"
            )
    return ranges


def _start(sequence: Named, name: str) -> int:
    # A name in the sequence, or a container whose items begin there (blocks.1 for blocks.1.0, blocks.1.1, ...).
    for i, (item, _) in enumerate(sequence):
        if item == name or item.startswith(name + "."):
            return i
    inside = next((item for item, _ in sequence if name.startswith(item + ".")), None)
    if inside is not None:  # a stage runs each module of the sequence whole
        raise ValueError(f"{name!r} is inside {inside}, which a stage runs whole: cut at {inside} or after it")
    raise ValueError(f"{name!r} is not a module of the model's sequence ({_names(sequence)}): name one of those")


def _balanced(sequence: Named, num_stages: int) -> list[tuple[int, int]]:
    # As split_model: a module with parameters starts a layer, parameterless ones (activations) join the one before;
    # those before the first (a Flatten) join the first, so that no stage is without parameters.
    layers: list[list[int]] = []
    leading: list[int] = []
    for i, (_, module) in enumerate(sequence):
        if _has_params(module):
            layers.append(leading + [i])
            leading = []
        elif layers:
            layers[-1].append(i)
        else:
            leading.append(i)
    costs = [float(sum(p.numel() for i in layer for p in sequence[i][1].parameters())) for layer in layers]
    if not any(costs) or num_stages > len(layers):
        raise ValueError(
            f"{num_stages} stages but the model's sequence has {len(layers)} module(s) with parameters: "
            f"use at most {len(layers)} stages"
        )
    return [(layers[first][0], layers[end - 1][-1] + 1) for first, end in balance_partition(costs, num_stages)]


def split_names(sequence: Named, ranges: Sequence[tuple[int, int]]) -> list[str]:
    """The names where stages 2.. begin: the ``split`` that gives ``ranges`` (what a log line shows)."""
    return [sequence[first][0] for first, _ in ranges[1:]]


class SequenceStage(nn.Module):
    """A run of a model's sequence as one module: ``forward`` calls them in order, and the modules sit under their
    names in the whole model (``blocks.4`` as ``self.blocks[4]``), so ``state_dict()`` keys are the whole model's
    and the stages' dicts merge into one that loads into the bare model."""

    def __init__(self, items: Named):
        super().__init__()
        self.stage_order = [name for name, _ in items]
        for name, module in items:
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.stage_order:
            x = self.get_submodule(name)(x)
        return x
