"""``torch.compile`` one unit at a time, so that a data-parallel wrapper's gradient hooks still fire during backward.

    from app.parallel.compile import compile_units
    compile_units(model.blocks, backend="aot_eager")  # each block's forward compiled on its own, in place
    ddp = DistributedDataParallel(model)              # buckets all-reduced while earlier blocks' backward runs

[Note: why per unit] A module compiled whole runs its backward as *one* autograd node (``CompiledFunctionBackward``):
every parameter's gradient comes out of it at once, at the very end, so a wrapper's per-parameter hooks (our DDP's,
stage 2's reduce-scatter, stage 3's) all fire after the whole backward and nothing overlaps with it. PyTorch's DDP
gets around this inside dynamo (``torch._dynamo.config.optimize_ddp``: the DDPOptimizer splits the graph at its
bucket boundaries), which only knows PyTorch's own class. Compiled one unit (a repeated block) at a time, each unit is
its own backward node: when a later unit's backward ends, its parameters' gradients are accumulated, the hooks fire
and a full bucket's all-reduce starts while the earlier units' backward runs, as in eager mode; this is how FSDP2
users compile (one ``torch.compile`` per transformer block). What is outside the units (embeddings, a head) runs
eager. tests/integration/test_ddp_compile.py counts the all-reduces launched before backward reaches the input.

In place, on the unit's ``forward``: the module keeps its class, its parameters and its ``state_dict`` keys (a
``torch.compile(module)`` wrapper would add ``_orig_mod.``), and its own forward hooks stay outside the graph. Not
``nn.Module.compile()``: it compiles ``_call_impl``, a frame of torch's own module.py, which dynamo leaves alone for
torch.nn's classes (an ``nn.Sequential`` unit ran uncompiled, torch 2.13).
Units of the same structure share one compiled graph (dynamo guards on the module's structure, not its identity).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

# torch is imported on use: app.worker.config reads BACKENDS, and a bad flag must fail before the torch import.
BACKENDS = ("aot_eager", "inductor")  # inductor: torch.compile's default; aot_eager: the same graphs, run eagerly


def compile_units(units: Iterable[nn.Module], backend: str) -> list[nn.Module]:
    """Compile each unit's ``forward`` on its own with ``backend``, in place; returns the units compiled (a unit
    compiled before is left as it is)."""
    import torch

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose one of {', '.join(BACKENDS)}")
    done = []
    for unit in units:
        if getattr(unit.forward, "_compiled_unit", False):
            continue
        compiled = torch.compile(unit.forward, backend=backend)
        compiled._compiled_unit = True
        unit.forward = compiled  # an instance attribute: _call_impl runs the unit's hooks, then this
        done.append(unit)
    return done


def default_units(model: nn.Module, class_names: list[str] | None = None) -> dict[str, nn.Module]:
    """``{name: module}`` worth compiling one by one: the modules whose class ``class_names`` names, or (none given)
    the items of the ``nn.ModuleList``/``nn.Sequential`` holding the most parameters (app.parallel.
    activation_checkpointing's rule: a transformer's blocks, an MLP's layers); only those holding a parameter (an
    activation alone gains nothing from being its own graph). ``ValueError`` (one line) when there are none."""
    from app.parallel.activation_checkpointing import candidate_units

    units = candidate_units(model, class_names or [])
    with_parameters = {n: m for n, m in units.items() if any(True for _ in m.parameters())}
    if not with_parameters:
        raise ValueError(f"none of {', '.join(units)} holds a parameter")
    return with_parameters
