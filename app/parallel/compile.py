"""``torch.compile`` under our wrappers, so that their gradient hooks still fire during backward: our DDP's module
compiled whole with its graph cut at the buckets, or any wrapper's units one at a time.

    from app.parallel.compile import compile_at_buckets, compile_units
    ddp = DistributedDataParallel(model)
    compile_at_buckets(ddp, backend="inductor")       # one graph per bucket: each all-reduced as its backward ends
    compile_units(model.blocks, backend="aot_eager")  # or: each block's forward compiled on its own, in place

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

[Note: graphs cut at the buckets] A unit is a graph, so a model of many small units pays dynamo's guards and
AOTAutograd's wrappers once per unit in forward and again in backward; where a bucket spans many units (deep_mlp's
24 layers in one 25 MiB bucket) none of those cuts lets anything overlap. ``compile_at_buckets`` cuts where PyTorch's
DDP under compile does, and with the same code: dynamo's ``DDPOptimizer`` (the backend dynamo itself puts in front
of the compiler for a ``torch.nn.parallel.DistributedDataParallel``, not for ours) counts the parameters' bytes in
reverse graph order and starts a new graph at each bucket cap, our DDP's caps given to it. Each bucket's graph is
then its own backward node, so its gradients arrive, its hooks fire and its all-reduce starts while the earlier
graphs' backward runs: the overlap eager mode has at bucket granularity, with no cut where it would buy none.
The cuts are DDPOptimizer's estimate of the buckets (reverse order of use); a bucket straddling two graphs still
launches, at the later one's end. Stages 2 and 3 keep ``compile_units``: stage 3 gathers each unit's parameters in
the unit's own hooks, which a whole-model graph would skip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


def compile_at_buckets(ddp: nn.Module, backend: str, on_compile: Callable[[int], None] | None = None) -> nn.Module:
    """Compile the module ``ddp`` (app.parallel.ddp's wrapper) holds, whole and in place, its graph cut at ``ddp``'s
    bucket caps (see [Note: graphs cut at the buckets]); returns that module. Its ``state_dict`` keys, its class and
    ``ddp``'s hooks are untouched: only its ``forward`` goes through dynamo. ``on_compile(graphs)``: called each time
    dynamo compiles it (at the first forward), with the number of graphs it was cut into."""
    import torch
    from torch._dynamo.backends.distributed import DDPOptimizer
    from torch._dynamo.backends.registry import lookup_backend

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose one of {', '.join(BACKENDS)}")
    module = ddp.module
    cuts = DDPOptimizer(ddp.bucket_cap_bytes, lookup_backend(backend), first_bucket_cap=ddp.first_bucket_cap_bytes)

    def compile_fn(gm, example_inputs, **configs):
        compiled = cuts.compile_fn(gm, example_inputs, **configs)
        if on_compile is not None:
            on_compile(len(cuts.buckets))
        return compiled

    module.forward = torch.compile(module.forward, backend=compile_fn)
    return module


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
