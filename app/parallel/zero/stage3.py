"""ZeRO stage 3 (FSDP) from scratch: parameters, gradients and optimizer state all sharded over the ranks.

Stage 2 (``stage2.py``) still keeps every parameter whole on every rank. Stage 3 keeps only 1/N of them:
the model is cut into *units* (submodules you name, or each child of the root), and each unit's parameters live
as one flat fp32 shard per rank. A unit exists whole only while it computes:

    forward:   pre-hook: all_gather(unit) ─► unit.forward ─► post-hook: free the gathered copy
    backward:  the unit's output gradient arrives ─► all_gather(unit) again ─► unit's backward ─► every
               parameter's gradient in ─► reduce_scatter(SUM) the flat gradient (async) ─► free the gathered copy
               (the flat gradient goes when its reduce-scatter is done: at most two in flight, ``InFlight``)
    end:       wait, divide by N, add into shard.grad; the optimizer steps the shards (its state is 1/N too)

``prefetch=k`` (PyTorch's FSDP prefetches 1) launches the all-gathers of the next k units while this one computes:
in forward by the order the last forward ran the units, in backward by the reverse of this forward's; never more
than k + 1 units (the root's aside) gathered at once, so memory stays bounded. ``reshard_after_forward=False``
keeps each unit whole from its forward to its reduce-scatter: one all-gather a unit per step instead of two, for
every unit whole between forward and backward (PyTorch's name; stage 2's memory for the parameters).

*Free* means: the gathered buffer's storage is resized to 0 bytes; every parameter is a view of that buffer, and
so is every tensor autograd saved from it, so the backward all-gather (which resizes it back and writes into it)
repairs them all at once. The write is hidden from autograd's version counter (as PyTorch's FSDP2 does): the
values written are the ones forward used, the buffer was not "modified in place" in any sense that matters.

Parameters a unit shares with another unit (tied weights) go to the *root unit*: everything not in a unit, kept
whole from the start of forward to the end of backward. Frozen parameters (``requires_grad=False``) are not
sharded: every rank keeps them, as they are. ``compute_dtype`` (bf16 or fp16) is the dtype of the gathered
parameters, of the computation and of the gradients' reduce-scatter; the shards, and so the optimizer, stay fp32.

Why a wrapper class, ``FullyShardedDataParallel(module, ...)``, and not ``fully_shard(module)``: our DDP is a
wrapper, so ``wrap_model`` can swap one for the other, and one object holds the units and ``full_state_dict()``
where a reader finds them. ``fully_shard`` rewrites the module's class in place (FSDP2), which is more to explain.

    model = FullyShardedDataParallel(TinyTransformer(), units=[Block], compute_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # the shards (+ frozen parameters)
    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    state = model.full_state_dict()                        # rank 0: the bare model's state_dict, one unit at a time

Try it: ``torchrun --standalone --nproc-per-node=2 -m app.demos.zero_demo --stage 3``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time

import torch
import torch.distributed as dist
from torch import nn

from app.diagnostics import collectives as recorded
from app.parallel import checksum
from app.parallel.ddp.graph_walk import tensors_in  # every tensor in a forward output, as the reducer walks it
from app.parallel.zero.stage2 import FlatShard, InFlight, broadcast_module_state, clip_sharded_grad_norm_


class _Unit:
    """One unit's parameters: an fp32 shard (stepped), a gathered buffer (``p.data`` are views of it) when whole."""

    def __init__(self, name: str, params: list[nn.Parameter], names: list[str], fsdp: FullyShardedDataParallel):
        self.name, self.fsdp = name, fsdp
        self.flat_shard = s = FlatShard(params, names, fsdp.rank, fsdp.world_size)
        flat = s.flatten(torch.float32)
        self.shard = nn.Parameter(flat[s.start : s.start + s.shard_numel].clone())  # fp32 master: the optimizer's
        self.full = torch.empty(s.padded, dtype=fsdp.compute_dtype or params[0].dtype)
        with torch.no_grad():
            for p, o, n, shape in zip(params, s.offsets, s.numels, s.shapes):
                p.data = self.full[o : o + n].view(shape)  # once: from now on only the storage comes and goes
        self.full.untyped_storage().resize_(0)  # gathered only while needed
        self.gathered = False
        self.work = None  # the all-gather in flight into ``full`` (a prefetch), with its input; None once waited
        self.position = -1  # its index in the order the current forward ran the units
        self.grad: torch.Tensor | None = None
        self.local: torch.Tensor | None = None  # under no_sync(): the unit's whole gradient, summed on this rank
        self.pending = 0

    def gather(self, wait: bool = True) -> None:
        """Make the unit whole: resize the buffer's storage back and all-gather every rank's shard into it.

        ``wait=False`` (a prefetch) only launches the all-gather; ``wait()`` (the unit's own hook) completes it."""
        if not self.gathered:
            storage = self.full.untyped_storage()
            storage.resize_(self.full.numel() * self.full.element_size())
            t0 = time.perf_counter()
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
                # No copy in the shard's own dtype: no gather outlives the forward or backward that launched it (both
                # free what they prefetched and did not use), so the optimizer never steps a shard being sent.
                shard = self.shard.detach().to(self.full.dtype)
                source, group = f"FSDP unit {self.name}", self.fsdp.process_group
                self.work = (recorded.all_gather_into_tensor(self.full, shard, source, group, True), shard)
            self.fsdp.comm_seconds["all_gather"] += time.perf_counter() - t0
            self.fsdp.comm_bytes["all_gather"] += self.full.numel() * self.full.element_size()
            self.gathered = True
            self.fsdp.count_gathered(self, +1)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Complete the all-gather in flight, if any: the parameters hold every rank's values after."""
        if self.work is not None:
            t0 = time.perf_counter()
            self.work[0].wait()
            self.work = None
            self.fsdp.comm_seconds["all_gather"] += time.perf_counter() - t0

    def free(self) -> None:
        """Give the gathered copy's memory back; the parameters keep their shapes, their storage holds 0 bytes."""
        if self.gathered:
            self.wait()  # gloo may still be writing into the storage
            self.full.untyped_storage().resize_(0)
            self.gathered = False
            self.fsdp.count_gathered(self, -1)

    def reduce_scatter(self) -> None:
        """All of this unit's gradients are in: launch the async reduce-scatter, free the full parameters."""
        chunk = torch.empty(self.flat_shard.shard_numel, dtype=self.grad.dtype)
        source, group = f"FSDP unit {self.name}", self.fsdp.process_group
        work = recorded.reduce_scatter_tensor(chunk, self.grad, source, dist.ReduceOp.SUM, group, True)
        self.fsdp.comm_bytes["reduce_scatter"] += self.grad.numel() * self.grad.element_size()
        self.grad = None  # the work holds the whole unit's gradient until it is done: InFlight drops it then
        self.free()
        self.fsdp.reduce_scatters.add(work, (self, chunk))


class FullyShardedDataParallel(nn.Module):
    """Wrap ``module`` so that each rank stores 1/N of its parameters, gradients and optimizer state.

    Args:
        module: the model, on the CPU (this implementation's gathers and buffers are CPU tensors).
        units: submodules to shard as units: their names (``"layers.0"``) or classes (``Block``: every instance).
            ``None``: each child of the root (the items of a ModuleList/ModuleDict child). A parameter in two units
            (tied) goes to the root unit. A unit must be a module whose own forward runs: its forward pre-hook is
            what gathers it.
        compute_dtype: ``torch.bfloat16``/``torch.float16`` to gather and compute in (the shards stay fp32);
            floating-point forward inputs are cast to it and the output cast back to fp32. ``None``: the
            parameters' own dtype.
        process_group: the group to shard over; ``None`` is the default (world) group.
        init_sync: broadcast rank 0's parameters and buffers first (``False``: the ranks agree already).
        reduce_dtype: what the gradients are reduce-scattered in: fp32 by default, whatever the compute dtype (the
            sum of N low-precision gradients loses what fp32 keeps; PyTorch's ``MixedPrecisionPolicy`` calls it the
            same); ``None``: the compute dtype (half the bytes on the wire).
        prefetch: how many units' all-gathers run ahead of the unit computing (0: none, each gathered when
            needed). At most ``prefetch`` + 1 units other than the root are gathered at once (one more per level
            of units nested in units); ``max_units_gathered`` counts it.
        reshard_after_forward: ``False`` keeps every unit whole from its forward until its gradients are
            reduce-scattered (no second all-gather in backward; the limit above then applies to forward only).

    Every trainable parameter must get a gradient in every backward (there is no ``find_unused_parameters``).
    Gradient accumulation needs nothing special: each backward reduce-scatters and adds into ``shard.grad``; or,
    inside ``no_sync()``, keeps each unit's whole gradient on the rank and reduce-scatters the sum once.
    """

    def __init__(
        self,
        module: nn.Module,
        units=None,
        compute_dtype=None,
        process_group=None,
        init_sync=True,
        reduce_dtype=torch.float32,
        prefetch: int = 0,
        reshard_after_forward: bool = True,
    ):
        super().__init__()
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch}: the number of units gathered ahead must be >= 0")
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.units_gathered = 0  # units other than the root whose storage is allocated now (gathered or in flight)
        self.max_units_gathered = 0  # the most there ever were at once
        self._order: list[_Unit] = []  # the units in the order the last complete forward ran them
        self._running: list[_Unit] = []  # ... this forward's, so far
        for name, dtype in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"{name}={dtype}: choose None, torch.float32, torch.bfloat16 or torch.float16")
        self.reduce_dtype = reduce_dtype
        self.require_backward_grad_sync = True  # False inside no_sync()
        unit_modules = resolve_units(module, units)  # before any collective: a bad list fails alone, at once
        self.module, self.compute_dtype, self.process_group = module, compute_dtype, process_group
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        if init_sync:
            broadcast_module_state(module, process_group)
        self._state_dict_names = {}  # id(param) -> every name the bare model's state_dict gives it (tied: several)
        for name, p in module.named_parameters(remove_duplicate=False):
            self._state_dict_names.setdefault(id(p), []).append(name)
        self._state_dict_keys = list(module.state_dict().keys())
        self._parameter_order = list(module.parameters())  # the bare model's order, for parameter_checksum()
        self.comm_bytes = {"all_gather": 0, "reduce_scatter": 0}
        # Cumulative seconds this rank spent in each: the all-gathers are synchronous, the reduce-scatters async
        # (only the wait at the end of backward is counted).
        self.comm_seconds = {"all_gather": 0.0, "reduce_scatter": 0.0}
        self.reduce_scatters = InFlight()  # this backward's, each with its unit, in launch order
        self._callback_queued = False
        self._root_unit = None  # count_gathered() runs while the units are made
        assignment = assign_parameters(module, unit_modules)
        self.units: list[_Unit] = []
        for unit_name, params in assignment.items():
            if params:
                names = [self._state_dict_names[id(p)][0] for p in params]
                self.units.append(_Unit(unit_name, params, names, self))
        self._root_unit = next((u for u in self.units if u.name == ""), None)
        self._unregister(module, {id(p) for u in self.units for p in u.flat_shard.params})
        # What the optimizer steps: the shards, registered here so that model.parameters() yields them.
        self.flat_params = nn.ParameterList([u.shard for u in self.units])
        for unit in self.units:
            for p in unit.flat_shard.params:
                p.register_post_accumulate_grad_hook(self._make_grad_hook(unit))
            if unit is not self._root_unit:
                sub = module.get_submodule(unit.name)
                sub.register_forward_pre_hook(lambda *_, u=unit: self._before_unit_forward(u))
                sub.register_forward_hook(lambda _m, _i, out, u=unit: self._after_unit_forward(u, out))

    @staticmethod
    def _unregister(module: nn.Module, sharded: set[int]) -> None:
        """Take the sharded parameters out of ``_parameters`` (kept as plain attributes, so forward finds them):
        ``parameters()`` and ``state_dict()`` must not hand out storage that is usually 0 bytes."""
        for sub in module.modules():
            for attr, p in list(sub._parameters.items()):
                if p is not None and id(p) in sharded:
                    del sub._parameters[attr]
                    sub.__dict__[attr] = p

    def count_gathered(self, unit: _Unit, change: int) -> None:
        if unit is not self._root_unit:
            self.units_gathered += change
            self.max_units_gathered = max(self.max_units_gathered, self.units_gathered)

    # -- forward -------------------------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        for unit in self.units:  # always fresh: the optimizer may have stepped since a copy was gathered
            if unit is self._root_unit or torch._C._current_graph_task_id() == -1:
                unit.free()
        if self._root_unit is not None:
            self._root_unit.gather()
        if self.compute_dtype is not None:
            inputs, kwargs = _cast_floats((inputs, kwargs), self.compute_dtype)
        self._running = []
        output = self.module(*inputs, **kwargs)
        if torch._C._current_graph_task_id() == -1:
            self._order = self._running  # what the next forward prefetches by, and this backward
            if self.reshard_after_forward:
                for unit in self.units:  # a prefetch the forward took another path past: not left in flight
                    if unit is not self._root_unit:
                        unit.free()
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:
            # The first gradient of backward reaches the output: queue the end-of-backward step then.
            torch.autograd.graph.register_multi_grad_hook(tensors, self._on_backward_start, mode="any")
        if self.compute_dtype is not None:
            output = _cast_floats(output, torch.float32)
        return output

    def _before_unit_forward(self, unit: _Unit) -> None:
        unit.gather()
        if torch._C._current_graph_task_id() != -1:
            return  # an activation checkpoint's recomputation inside backward: no forward order to follow
        k = unit.position = len(self._running)  # where its backward finds it (nested units come after it)
        self._running.append(unit)
        if k < len(self._order) and self._order[k] is unit:  # the same path as the last forward: prefetch by it
            self._prefetch(self._order[k + 1 : k + 1 + self.prefetch])

    def _prefetch(self, units: list[_Unit]) -> None:
        """Launch the all-gathers of ``units`` (in order), keeping at most ``prefetch`` + 1 units gathered."""
        for unit in units:
            if unit.gathered or unit is self._root_unit:
                continue
            if self.units_gathered >= self.prefetch + 1:
                return
            unit.gather(wait=False)

    def _after_unit_forward(self, unit: _Unit, output) -> None:
        if torch._C._current_graph_task_id() != -1:
            # A forward inside backward: an activation checkpoint recomputing this unit, whose backward is about
            # to read the parameters; they stay whole until its reduce-scatter frees them.
            return
        if self.reshard_after_forward:
            unit.free()  # the point of stage 3; otherwise the unit stays whole until its gradients are in
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:
            # Backward reaches this unit when its output's gradient is computed: gather it again right then (and
            # prefetch the unit that ran before it in forward: the next one backward needs).
            hook = functools.partial(self._before_unit_backward, self._running, unit.position)
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")

    def _before_unit_backward(self, order: list[_Unit], k: int, _grads=None) -> None:
        """Backward reached ``order[k]``, the k-th unit its forward ran: gather it; prefetch the ones before it."""
        order[k].gather()
        earlier = [u for u in reversed(order[max(0, k - self.prefetch) : k]) if u.pending]  # not reduced yet
        self._prefetch(earlier)

    # -- backward ------------------------------------------------------------------------------------------------
    def _on_backward_start(self, _grads) -> None:
        if self._callback_queued:
            return
        self._callback_queued = True
        self.reduce_scatters = InFlight()
        for unit in self.units:
            unit.pending = len(unit.flat_shard.params)
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside keep each unit's whole gradient on this rank, summed, instead of reduce-scattering
        it; the first backward outside reduce-scatters the sum once (PyTorch's FSDP ``no_sync``). It costs a whole
        model's gradient per rank (4 bytes a parameter in fp32), which is what stage 3 otherwise saves: fewer
        collectives for more memory."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _make_grad_hook(self, unit: _Unit):
        s = unit.flat_shard
        position = {id(p): i for i, p in enumerate(s.params)}

        def hook(param: torch.Tensor) -> None:
            if unit.grad is None:  # what no_sync() kept, or zeros (the padding adds nothing)
                unit.grad = (
                    unit.local if unit.local is not None else torch.zeros(s.padded, dtype=self._reduce_dtype(param))
                )
                unit.local = None
            i = position[id(param)]
            unit.grad[s.offsets[i] : s.offsets[i] + s.numels[i]].add_(param.grad.reshape(-1))
            param.grad = None
            unit.pending -= 1
            if unit.pending == 0 and self.require_backward_grad_sync:
                unit.reduce_scatter()
            elif unit.pending == 0:  # inside no_sync(): keep the sum here, give the gathered parameters back
                unit.local, unit.grad = unit.grad, None
                unit.free()

        return hook

    def _reduce_dtype(self, param: torch.Tensor) -> torch.dtype:
        return self.reduce_dtype or param.grad.dtype

    def _finalize_backward(self) -> None:
        self._callback_queued = False
        incomplete = [u.name or "<root>" for u in self.units if u.pending]
        if incomplete:
            raise RuntimeError(
                f"FullyShardedDataParallel: units {', '.join(incomplete)} did not get every parameter's gradient "
                f"in this backward; the ranks would hang waiting for their reduce-scatter. Make the loss depend "
                f"on every trainable parameter, or freeze the unused ones before wrapping"
            )
        for unit in self.units:
            if unit is not self._root_unit:
                unit.free()  # a prefetch the backward never reached (every unit is reduce-scattered otherwise)
        with torch.no_grad():
            for unit, chunk in self.reduce_scatters.results():
                # SUM / N in fp32: the shard is fp32, and so the mean is taken after the (possibly bf16) transfer.
                chunk = chunk.float().div_(self.world_size)
                unit.shard.grad = chunk if unit.shard.grad is None else unit.shard.grad.add_(chunk)
        self.comm_seconds["reduce_scatter"] += self.reduce_scatters.seconds
        self.reduce_scatters = InFlight()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the whole gradient's global norm to ``max_norm``, its shards on every rank alike (collective), as
        PyTorch's ``FullyShardedDataParallel.clip_grad_norm_``; frozen parameters have no gradient to count."""
        return clip_sharded_grad_norm_([u.shard for u in self.units], max_norm, self.process_group)

    # -- state ---------------------------------------------------------------------------------------------------
    def flat_shards(self) -> list[tuple[FlatShard, nn.Parameter]]:
        """Each unit's layout and this rank's fp32 shard of it (the sharded checkpoint cuts along these)."""
        return [(u.flat_shard, u.shard) for u in self.units]

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """On rank 0, the bare model's ``state_dict()`` (fp32, unsharded); ``{}`` on the other ranks.

        Gathered one unit at a time, so no rank ever holds more than one whole unit beyond its result; the
        optimizer's state is not touched (it stays sharded: see ``checkpoint.py``).
        """
        values: dict[str, torch.Tensor] = {}
        for unit in self.units:
            s = unit.flat_shard
            full = torch.empty(s.padded, dtype=torch.float32)
            recorded.all_gather_into_tensor(full, unit.shard.detach(), f"FSDP unit {unit.name}", self.process_group)
            if self.rank == 0:
                for p, o, n, shape in zip(s.params, s.offsets, s.numels, s.shapes):
                    for name in self._state_dict_names[id(p)]:
                        values[name] = full[o : o + n].view(shape).clone()
        if self.rank != 0:
            return {}
        values.update({k: v.detach().clone() for k, v in self.module.state_dict().items()})  # frozen, buffers
        return {k: values[k] for k in self._state_dict_keys}

    @torch.no_grad()
    def parameter_checksum(self) -> str:
        """``app.parallel.checksum`` of the bare model, the same on every rank, without gathering the model whole.

        Collective. The parameters are hashed in the bare model's order and dtype, as the whole model would be;
        each unit is all-gathered when the walk first needs it and dropped after its last parameter, so a rank holds
        about one unit at a time (``full_state_dict`` plus a broadcast held the whole model on every rank: the end
        of a zero3 run peaked above its training).
        """
        where = {id(p): (u, i) for u in self.units for i, p in enumerate(u.flat_shard.params)}
        left = {id(u): len(u.flat_shard.params) for u in self.units}
        gathered: dict[int, torch.Tensor] = {}
        h = hashlib.sha256()
        for p in self._parameter_order:
            if id(p) not in where:  # frozen: whole on every rank, as in the bare model
                checksum.update(h, p)
                continue
            unit, i = where[id(p)]
            s = unit.flat_shard
            if id(unit) not in gathered:
                gathered[id(unit)] = full = torch.empty(s.padded, dtype=torch.float32)
                recorded.all_gather_into_tensor(full, unit.shard.detach(), f"FSDP unit {unit.name}", self.process_group)
            full = gathered[id(unit)]
            checksum.update(h, full[s.offsets[i] : s.offsets[i] + s.numels[i]].view(s.shapes[i]).to(p.dtype))
            left[id(unit)] -= 1
            if not left[id(unit)]:
                del gathered[id(unit)]
        return h.hexdigest()


def resolve_units(module: nn.Module, units) -> dict[str, nn.Module]:
    """``{name: submodule}`` for ``units`` (names or classes; ``None``: every child of the root)."""
    if units is None:
        # A ModuleList/ModuleDict child has no forward of its own (its parent calls its items): its items are units.
        found = {}
        for name, child in module.named_children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                found.update({f"{name}.{n}": m for n, m in child.named_children()})
            else:
                found[name] = child
        return found
    if isinstance(units, (str, type)):
        units = [units]
    found: dict[str, nn.Module] = {}
    for unit in units:
        if isinstance(unit, str):
            try:
                found[unit] = module.get_submodule(unit)
            except AttributeError:
                raise ValueError(f"units: {unit!r} names no submodule of {type(module).__name__}") from None
        elif isinstance(unit, type):
            found.update({n: m for n, m in module.named_modules() if n and isinstance(m, unit)})
        else:
            raise ValueError(f"units: {unit!r} is neither a submodule name nor an nn.Module class")
    if not found:
        raise ValueError(f"units={list(units)!r} names no submodule of {type(module).__name__}: nothing to shard")
    return found


def assign_parameters(module: nn.Module, unit_modules: dict[str, nn.Module]) -> dict[str, list[nn.Parameter]]:
    """``{unit name: its trainable parameters}``, the root unit under ``""``, each parameter in exactly one unit.

    A parameter goes to the innermost unit whose subtree holds it; one held by two units that do not nest (a tied
    weight) goes to the root unit, which is whole for the whole step, so both users find it gathered.
    """
    holders: dict[int, list[str]] = {}
    for name, sub in unit_modules.items():
        for p in sub.parameters():
            holders.setdefault(id(p), []).append(name)
    assignment: dict[str, list[nn.Parameter]] = {"": [], **{name: [] for name in unit_modules}}
    for p in module.parameters():
        if not p.requires_grad:
            continue  # frozen: replicated as it is, never stepped
        names = holders.get(id(p), [])
        # Innermost: the holder that every other holder contains (its name extends theirs).
        inner = [n for n in names if all(n == m or n.startswith(m + ".") for m in names)]
        assignment[inner[0] if inner else ""].append(p)
    return assignment


def _cast_floats(obj, dtype: torch.dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj
