"""Activation checkpointing: a unit keeps only its input for backward and computes its forward again there.

Backward needs what forward saved (each op's inputs or outputs): for a transformer block that is many tensors of
the activations' size per layer, held from forward until that layer's backward. A checkpointed unit runs its
forward without saving them (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``); when backward
reaches it, the forward runs again from the kept input to rebuild them, so the memory of a step's activations
shrinks to the units' inputs plus one unit's worth, for about one more forward of compute. The gradients are
the same: the same ops run on the same values (the RNG state is replayed too).

    units = candidate_units(model, class_names=[])   # the items of the largest ModuleList/Sequential
    checkpoint_modules(every_nth(units, 2).values())  # model(x) now recomputes every second one in backward

In the worker: ``--activation-checkpointing units | every:N | off`` and ``--activation-checkpointing-units Block``
(docs/training.md "Activation checkpointing"); measured by ``make bench-activation-checkpointing``.

[Note: checkpointing by class] A checkpointed module gets a subclass of its own class whose ``forward`` calls the
original through ``checkpoint``; names, parameters, ``state_dict`` keys and hooks stay as they were, so checkpoints
load either way and a wrapper's hooks on the module (zero3 gathers a unit in its forward pre-hook) run outside the
recomputed region. PyTorch's ``checkpoint_wrapper`` inserts a module level instead, which renames every parameter
under it (``_checkpoint_wrapped_module.``), the names zero3's shards and sharded checkpoints are keyed by; a
``forward`` set on the instance would be copied, bound to the original, into ``nn.DataParallel``'s replicas.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.utils.checkpoint import checkpoint

_SUBCLASSES: dict[type, type] = {}  # a module class -> its checkpointed subclass (one per class, made on first use)


def candidate_units(model: nn.Module, class_names: list[str]) -> dict[str, nn.Module]:
    """``{name: module}`` that may be checkpointed, in module order: every module whose class ``class_names`` names,
    or (``[]``) the items of the ``nn.ModuleList``/``nn.Sequential`` holding the most parameters (the outermost of
    equals): the repeated blocks of most models, not the layers inside one. ``ValueError`` (one line) if none."""
    if class_names:
        found = {n: m for n, m in model.named_modules() if n and type(m).__name__ in class_names}
        missing = [c for c in class_names if not any(type(m).__name__ == c for m in found.values())]
        if missing:
            have = sorted({type(m).__name__ for n, m in model.named_modules() if n})
            raise ValueError(
                f"{', '.join(missing)} names no module class of {type(model).__name__} (it has {', '.join(have)})"
            )
        return found
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList or nn.Sequential to take its units from")
    name, largest = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))  # the first of equals
    return {f"{name}.{n}" if name else n: m for n, m in largest.named_children()}


def every_nth(units: dict[str, nn.Module], every: int) -> dict[str, nn.Module]:
    """The ``every``-th, ``2 × every``-th, ... of ``units`` (1: all of them; ``{}`` when there are fewer)."""
    return dict(list(units.items())[every - 1 :: every])


def checkpoint_modules(modules: Iterable[nn.Module]) -> None:
    """Make each module's forward a non-reentrant checkpoint of its own (see the note above); twice is once."""
    for module in modules:
        cls = type(module)
        if cls in _SUBCLASSES.values():
            continue
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": _checkpointed_forward(cls.forward)})
            _SUBCLASSES[cls].__qualname__, _SUBCLASSES[cls].__module__ = cls.__qualname__, cls.__module__
        module.__class__ = _SUBCLASSES[cls]


def is_checkpointed(module: nn.Module) -> bool:
    return type(module) in _SUBCLASSES.values()


def _checkpointed_forward(forward):
    def checkpointed(self, *args, **kwargs):
        # Non-reentrant: saved tensors are dropped through autograd's hooks, so parameters get their gradients
        # even when no input requires one (a first layer), and wrappers' per-parameter hooks fire as without it.
        return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)

    return checkpointed
