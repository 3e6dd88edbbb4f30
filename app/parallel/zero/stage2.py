"""ZeRO stage 2 from scratch: gradients and optimizer state sharded, parameters still whole on every rank.

Stage 1 (``stage1.py``) still all-reduces the *full* gradient onto every rank, although each rank steps only 1/N of
the parameters and needs only 1/N of the gradient. Stage 2 reduce-scatters instead: the same bytes on the wire as
an all-reduce's first half, and each rank ends up holding only the summed gradient of its own shard.

    1. the trainable parameters are cut into buckets (reverse order, <= bucket_cap_mb, as in ``app.parallel.ddp``); each
       bucket's parameters are laid end to end in one flat buffer, padded to a multiple of N, and ``p.data``
       becomes a view of it. Rank r owns chunk r of every bucket: its *shard*, what its optimizer steps;
    2. as backward produces each gradient, a hook copies it into the bucket's flat gradient and frees ``p.grad``;
       a full bucket is reduce-scattered (SUM) *asynchronously* while backward goes on, and its flat gradient
       freed as soon as that is done (one in flight beside the bucket filling: ``InFlight``; on gloo an all-reduce
       in place, see ``_reduce_scatter``);
    3. when backward ends, each rank waits and keeps its chunk, divided by N: ``shard.grad``. The flat gradient
       is freed: between steps a rank holds 1/N of the gradients;
    4. the optimizer steps the shards (its state is 1/N, as in stage 1); then every bucket is all-gathered back
       into the flat buffers, so every rank's parameters are whole and equal again. With ``overlap_gather=True``
       the all-gathers are only launched (last bucket first: the first layers'), and each module's forward
       pre-hook waits for the buckets its parameters lie in, so the later buckets arrive while the first layers
       compute; a read through the wrapper (``parameters()``, ``state_dict()``, a checkpoint) or the next
       ``step()`` waits for all of them.

    p_n.grad ─┐                                             rank r keeps chunk r        optimizer.step()
    ...       ├─► bucket 0 full ─► reduce_scatter(SUM) ───► shard_0.grad = chunk / N ─► AdamW(shards) ─► all_gather
    p_0.grad ─┘   bucket k full ─► reduce_scatter(SUM) ───► shard_k.grad = chunk / N ─┘                 (each bucket)

Use::

    model = ShardedGradDataParallel(MiniMLP(), bucket_cap_mb=25)
    opt = model.build_optimizer(torch.optim.AdamW, lr=1e-3)   # over the shards; all-gathers after each step
    loss_fn(model(x), y).backward()
    opt.step(); opt.zero_grad()
    with model.no_sync(): ...                                 # gradient accumulation: no communication
    model = ShardedGradDataParallel(MiniMLP(), overlap_gather=True)   # the all-gather runs into the next forward

PyTorch has no class for exactly this (FSDP's ``SHARD_GRAD_OP`` is close); the constructor follows our DDP's.
Try it: ``torchrun --standalone --nproc-per-node=2 -m app.demos.zero_demo --stage 2``.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

from app.diagnostics import collectives as recorded
from app.parallel.ddp.module_sync import broadcast_coalesced
from app.parallel.zero.stage1 import refuse_unshardable

DEFAULT_BUCKET_CAP_MB = 25
# Each collective in flight holds a bucket-sized buffer (a flat gradient; gloo's all-gather a flat output of its
# own): a rank's peak is its state plus these. One in flight still overlaps a bucket's communication with the
# next bucket's backward.
GATHERS_IN_FLIGHT = 1  # all-gathers of the parameters in flight after a step, without overlap_gather
REDUCE_SCATTERS_IN_FLIGHT = 1  # bucket reduce-scatters in flight during backward, beside the bucket filling


@torch.no_grad()
def clip_sharded_grad_norm_(shards: list[torch.Tensor], max_norm: float, process_group=None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients cut into shards across ranks: the global L2 norm, from
    every rank's sum of squares (one all-reduce), and every shard scaled by the same ``max_norm / norm`` (at most 1).

    Each element of the model's gradient lies in exactly one rank's shard (the padding's are zeros), so the sum
    over ranks is the whole gradient's. Returns the norm before clipping, the same on every rank; inf or NaN when
    a gradient is (an fp16 overflow: the scaler then skips the step).
    """
    grads = [s.grad for s in shards if s.grad is not None]
    squares = torch.zeros((), dtype=torch.float64)
    for g in grads:
        squares += g.double().pow(2).sum()
    dist.all_reduce(squares, group=process_group)
    norm = squares.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm.float()


class InFlight:
    """Asynchronous reduce-scatters in launch order, at most ``limit`` of them alive: their inputs are big.

    A gloo work keeps its input (a whole bucket's or unit's flat gradient) until the work object is dropped, so
    works kept until the end of backward would hold the whole model's gradient there, the very memory stage 2
    exists to save. Each launch drops the works that are done and waits for the oldest beyond ``limit``; only what
    each was added with (this rank's chunk, with whatever the caller pairs it with) is kept for ``results()``.
    """

    def __init__(self, limit: int = 2):
        self.limit = limit
        self.seconds = 0.0  # waited for, here and in results(): the exposed part of the communication
        self._items: list[list] = []  # [work or None once done, result, done or None]

    def add(self, work, result, done=None) -> None:
        """Keep ``result``; ``done``: a function of it, called once the work is done, whose value is kept instead
        (what to keep of a buffer the work wrote: the buffer itself is dropped with the work)."""
        self._items.append([work, result, done])
        live = [item for item in self._items if item[0] is not None]
        for n, item in enumerate(live):
            if len(live) - n > self.limit or item[0].is_completed():
                self._finish(item)

    def _finish(self, item: list) -> None:
        t0 = time.perf_counter()
        item[0].wait()
        item[0] = None  # the work, and with it its input, is gone
        if item[2] is not None:
            item[1], item[2] = item[2](item[1]), None
        self.seconds += time.perf_counter() - t0

    def results(self) -> list:
        """Wait for every work still alive; what each was added with, in launch order. Empties the list."""
        for item in self._items:
            if item[0] is not None:
                self._finish(item)
        results = [result for _, result, _ in self._items]
        self._items = []
        return results


class FlatShard:
    """Parameters laid end to end (padded to a multiple of ``world_size``); this rank owns one equal chunk.

    Offsets are those of the unpadded concatenation, the same for every world size: that is what lets a sharded
    checkpoint saved on 4 ranks be cut again for 3 (``checkpoint.py``).
    """

    def __init__(self, params: list[torch.Tensor], names: list[str], rank: int, world_size: int):
        self.params, self.names = params, names
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.total = sum(self.numels)
        self.shard_numel = -(-self.total // world_size)  # ceil: the last chunk is padded with zeros
        self.padded = self.shard_numel * world_size
        self.start = rank * self.shard_numel  # this rank's chunk, in flat coordinates

    def flatten(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The parameters' current values, laid out flat and padded."""
        p0 = self.params[0]
        flat = torch.zeros(self.padded, dtype=dtype or p0.dtype, device=p0.device)
        for p, o, n in zip(self.params, self.offsets, self.numels):
            flat[o : o + n].copy_(p.detach().reshape(-1))
        return flat

    def pieces(self) -> list[tuple[int, int, int, int]]:
        """``(param index, lo, hi, shard offset)``: elements ``[lo, hi)`` of parameter i lie in this rank's chunk,
        starting at ``shard offset`` inside it."""
        out, end = [], self.start + self.shard_numel
        for i, (o, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(o, self.start), min(o + n, end)
            if lo < hi:
                out.append((i, lo - o, hi - o, lo - self.start))
        return out


def broadcast_module_state(module: nn.Module, group, src_rank: int = 0) -> None:
    """Every rank takes rank ``src_rank``'s parameters and buffers: one flat broadcast per (device, dtype)."""
    src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
    broadcast_coalesced([*module.parameters(), *module.buffers()], src=src, group=group)


def trainable_named_parameters(module: nn.Module) -> tuple[list[nn.Parameter], list[str]]:
    """Parameters that require grad, each once (a tied parameter under its first name), in module order."""
    params, names = [], []
    for name, p in module.named_parameters():  # remove_duplicate=True: a tied parameter appears once
        if p.requires_grad:
            params.append(p)
            names.append(name)
    return params, names


class _Bucket:
    """One flat buffer of whole parameters (``p.data`` are views of it), this rank's chunk as a Parameter."""

    def __init__(self, params: list[nn.Parameter], names: list[str], rank: int, world_size: int):
        self.flat_shard = FlatShard(params, names, rank, world_size)
        self.flat = self.flat_shard.flatten()  # the replicated parameters, padded
        with torch.no_grad():
            for p, o, n, shape in zip(params, self.flat_shard.offsets, self.flat_shard.numels, self.flat_shard.shapes):
                p.data = self.flat[o : o + n].view(shape)
        s = self.flat_shard
        # The shard is a view of the flat buffer: the optimizer updates this rank's chunk in place, and the
        # all-gather after the step brings the other chunks.
        self.shard = nn.Parameter(self.flat[s.start : s.start + s.shard_numel])
        self.grad: torch.Tensor | None = None  # the flat gradient, alive only during one synchronised backward
        self.pending = 0

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class ShardedGradDataParallel(nn.Module):
    """Wrap ``module``: gradients reduce-scattered in buckets during backward, each rank keeping 1/N of them.

    Args:
        module: the model, on one device; its trainable parameters must share one dtype.
        process_group: the group to shard over; ``None`` is the default (world) group.
        bucket_cap_mb: bucket size in MiB (a bucket closes once it holds at least this much, as in DDP).
            Bigger buckets: fewer collectives, later first launch. Each bucket is padded to a multiple of N.
        init_sync: broadcast rank 0's parameters and buffers at construction (``False``: the ranks agree already).
        overlap_gather: launch the parameters' all-gather after ``step()`` without waiting; each bucket is waited
            for just before the forward of the first module that reads it (the module holding the parameter, or
            its nearest ancestor whose forward ran in the last forward seen). Off by default: code that reads the
            *bare* model's parameters between a step and the next forward (``model.module.parameters()``, the
            worker's final checksum) must call ``wait_parameters()`` first, and so must a model whose forward
            reads another module's parameter before that module's own forward runs.

    Parameters with ``requires_grad=False`` are not sharded: every rank keeps them whole and nobody steps them.
    Every trainable parameter must get a gradient in each synchronised backward (no ``find_unused_parameters``).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        bucket_cap_mb: float | None = None,
        init_sync=True,
        overlap_gather: bool = False,
    ):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.require_backward_grad_sync = True  # PyTorch's name; no_sync() turns it off
        if init_sync:
            broadcast_module_state(module, process_group)
        params, names = trainable_named_parameters(module)
        if len({p.dtype for p in params}) > 1:
            raise ValueError("ShardedGradDataParallel: trainable parameters must share one dtype (one flat buffer)")
        cap = int((bucket_cap_mb if bucket_cap_mb is not None else DEFAULT_BUCKET_CAP_MB) * 1024 * 1024)
        self._buckets: list[_Bucket] = []
        self._slot: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket index, position in bucket)
        # Reverse order: the last layers' gradients arrive first in backward, so bucket 0 fills (and launches) first.
        group, group_names, size = [], [], 0
        for p, name in reversed(list(zip(params, names))):
            group.append(p)
            group_names.append(name)
            size += p.numel() * p.element_size()
            if size >= cap:
                self._add_bucket(group, group_names)
                group, group_names, size = [], [], 0
        if group:
            self._add_bucket(group, group_names)
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_hook)
        self.comm_bytes = {"reduce_scatter": 0, "all_gather": 0}  # cumulative bytes handed to each collective
        # Cumulative seconds this rank waited on each: the reduce-scatters run during backward, so only the wait at
        # its end is counted; the all-gather after the step is waited for whole.
        self.comm_seconds = {"reduce_scatter": 0.0, "all_gather": 0.0}
        self._works = InFlight()
        self._next_bucket = 0
        self._callback_queued = False
        self.overlap_gather = overlap_gather
        self._gathers: dict[int, tuple] = {}  # bucket index -> (work, its input): all-gathers still in flight
        self._ran: set[int] = set()  # id() of every module whose forward was seen to run
        self._waits: dict[int, list[int]] | None = None  # id(module) -> buckets its forward pre-hook waits for
        for sub in module.modules():
            sub.register_forward_pre_hook(self._before_module_forward)
        for m in (self, module):  # state_dict / load_state_dict of the wrapper or the bare model: gathered first
            m.register_state_dict_pre_hook(lambda *_: self.wait_parameters())
            m.register_load_state_dict_pre_hook(lambda *_: self.wait_parameters())

    def _add_bucket(self, params: list[nn.Parameter], names: list[str]) -> None:
        for pos, p in enumerate(params):
            self._slot[id(p)] = (len(self._buckets), pos)
        self._buckets.append(_Bucket(params, names, self.rank, self.world_size))

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate full gradients locally in ``p.grad``: no communication at all.

        The first synchronised backward after it reduce-scatters the accumulated sum. Costs a full gradient per
        rank while inside (as with FSDP's ``no_sync``): the price of skipping the communication.
        """
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    # -- the optimizer -------------------------------------------------------------------------------------------
    def shard_parameters(self) -> list[nn.Parameter]:
        """This rank's chunk of every bucket: what the optimizer steps (``shard.grad`` holds the averaged chunk)."""
        return [b.shard for b in self._buckets]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the whole gradient's global norm to ``max_norm``, its shards on every rank alike (collective)."""
        return clip_sharded_grad_norm_(self.shard_parameters(), max_norm, self.process_group)

    def build_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **defaults) -> torch.optim.Optimizer:
        """``optimizer_class`` over this rank's shards, made to all-gather the parameters after every ``step()``."""
        refuse_unshardable(optimizer_class)
        optimizer = optimizer_class(self.shard_parameters(), **defaults)
        # The step writes the shards, views of the flat buffers an all-gather may still be writing into: wait first.
        optimizer.register_step_pre_hook(lambda *_: self.wait_parameters())
        optimizer.register_step_post_hook(lambda *_: self.gather_parameters())
        return optimizer

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """All-gather every bucket's chunks into its flat buffer: each rank's parameters whole and equal again.

        With ``overlap_gather`` the all-gathers are only launched, last bucket first (the first layers' parameters,
        the first the next forward needs), and each is waited for by the forward pre-hook of the first module that
        reads its parameters, so the gathers of later layers run while earlier layers compute. Anything else that
        reads the parameters through this wrapper waits for them all first (``wait_parameters``)."""
        self.wait_parameters()
        if self.overlap_gather and self._waits is None and self._ran:
            self._waits = self._wait_map()
        t0 = time.perf_counter()
        for i in reversed(range(len(self._buckets))):
            b = self._buckets[i]
            # The input is a copy: the shard is a view of the very buffer being gathered into.
            shard = b.shard.detach().clone()
            work = recorded.all_gather_into_tensor(b.flat, shard, f"ZeRO bucket {i}", self.process_group, True)
            self._gathers[i] = (work, shard)
            self.comm_bytes["all_gather"] += b.nbytes
            if not self.overlap_gather and len(self._gathers) > GATHERS_IN_FLIGHT:
                # Each gather in flight holds a copy of its shard: all of them at once would be a second copy of
                # this rank's whole shard of the parameters. Overlap launches them all, and pays that copy.
                self.wait_parameters([max(self._gathers)])
        self.comm_seconds["all_gather"] += time.perf_counter() - t0
        if not (self.overlap_gather and self._waits is not None):
            self.wait_parameters()  # no forward seen yet (or no overlap): nothing knows which module needs what

    @property
    def gathers_in_flight(self) -> int:
        """All-gathers launched and not yet waited for (``overlap_gather``: between a step and the next forward)."""
        return len(self._gathers)

    def wait_parameters(self, buckets=None) -> None:
        """Wait for the all-gathers still in flight (of ``buckets``, default all): the parameters are whole after."""
        t0 = time.perf_counter()
        for i in sorted(self._gathers if buckets is None else buckets, reverse=True):
            entry = self._gathers.pop(i, None)
            if entry is not None:
                entry[0].wait()
        self.comm_seconds["all_gather"] += time.perf_counter() - t0

    def _before_module_forward(self, module: nn.Module, _inputs) -> None:
        self._ran.add(id(module))
        if self._gathers:
            self.wait_parameters(self._waits.get(id(module), ()) if self._waits is not None else None)

    def _wait_map(self) -> dict[int, list[int]]:
        """Which buckets each module's forward pre-hook waits for: a parameter's bucket is waited for by the nearest
        module, from the one that holds it up to the root, whose forward was seen to run (a module whose forward
        never runs, MultiheadAttention's ``out_proj``, has its parameters read by its parent's)."""
        modules = dict(self.module.named_modules(remove_duplicate=False))
        waits: dict[int, set[int]] = {}
        for name, sub in modules.items():
            for p in sub.parameters(recurse=False):
                if id(p) not in self._slot:
                    continue  # frozen: never gathered
                path = name.split(".") if name else []
                holder = self.module  # no module on the way ran: the root waits
                for k in range(len(path), 0, -1):
                    if id(modules[".".join(path[:k])]) in self._ran:
                        holder = modules[".".join(path[:k])]
                        break
                waits.setdefault(id(holder), set()).add(self._slot[id(p)][0])
        return {k: sorted(v) for k, v in waits.items()}

    def _named_members(self, *args, **kwargs):
        # parameters(), named_parameters(), buffers() through the wrapper: the parameters are read whole.
        self.wait_parameters()
        return super()._named_members(*args, **kwargs)

    # -- one synchronised backward -------------------------------------------------------------------------------
    def _grad_hook(self, param: torch.Tensor) -> None:
        if not self.require_backward_grad_sync:
            return  # inside no_sync(): leave the gradient to accumulate in p.grad
        if not self._callback_queued:
            # First hook of this backward: autograd calls _finalize_backward once the whole pass is done.
            self.wait_parameters()  # a gather that no forward waited for (a parameter read outside forward)
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
            self._next_bucket, self._works = 0, InFlight(REDUCE_SCATTERS_IN_FLIGHT)
            for b in self._buckets:
                b.pending = len(b.flat_shard.params)
        index, pos = self._slot[id(param)]
        bucket = self._buckets[index]
        if bucket.grad is None:
            bucket.grad = torch.zeros_like(bucket.flat)  # zeros: the padding must add nothing
        s = bucket.flat_shard
        bucket.grad[s.offsets[pos] : s.offsets[pos] + s.numels[pos]].copy_(param.grad.reshape(-1))
        param.grad = None  # the full gradient lives only until it is in the bucket
        bucket.pending -= 1
        # Collectives match by call order on every rank: launch buckets 0, 1, ... in turn, never out of order.
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            b = self._buckets[self._next_bucket]
            self._reduce_scatter(b, f"ZeRO bucket {self._next_bucket}")
            b.grad = None  # the work holds the flat gradient until it is done: InFlight drops it then
            self.comm_bytes["reduce_scatter"] += b.nbytes
            self._next_bucket += 1

    def _reduce_scatter(self, b: _Bucket, source: str) -> None:
        """Launch the SUM of ``b``'s flat gradient over the ranks; this rank's chunk of it goes to ``self._works``.

        [Note: gloo's reduce-scatter is an all-reduce of a copy] Measured on gloo (``reduce_scatter_tensor`` of a
        bucket): the call allocates about a bucket's size beside its input, and its chunk is bit-equal to the same
        chunk of an ``all_reduce`` of that input (N = 2, 3, 4). The flat gradient is ours and dies after this, so
        on gloo it is all-reduced in place and the chunk copied out when done: the same values without the copy.
        Other backends (NCCL) reduce-scatter for real: half the bytes on the wire."""
        s = b.flat_shard
        if dist.get_backend(self.process_group) == "gloo":
            work = recorded.all_reduce(b.grad, source, dist.ReduceOp.SUM, self.process_group, True)
            self._works.add(work, b.grad, lambda flat: flat[s.start : s.start + s.shard_numel].clone())
            return
        chunk = torch.empty(s.shard_numel, dtype=b.grad.dtype, device=b.grad.device)
        work = recorded.reduce_scatter_tensor(chunk, b.grad, source, dist.ReduceOp.SUM, self.process_group, True)
        self._works.add(work, chunk)

    def _finalize_backward(self) -> None:
        self._callback_queued = False
        if self._next_bucket < len(self._buckets):
            missing = [name for b in self._buckets if b.pending for name in b.flat_shard.names]
            raise RuntimeError(
                f"ShardedGradDataParallel: some of these parameters got no gradient in this backward: "
                f"{', '.join(missing)}; every rank would wait for their buckets. Make the loss depend on them, "
                f"or freeze them (requires_grad=False) before wrapping"
            )
        with torch.no_grad():
            for b, chunk in zip(self._buckets, self._works.results()):
                chunk.div_(self.world_size)  # SUM / N: the mean over ranks, as DDP's average
                # Two synchronised backwards without zero_grad add up, as p.grad does in plain PyTorch.
                b.shard.grad = chunk if b.shard.grad is None else b.shard.grad.add_(chunk)
        self.comm_seconds["reduce_scatter"] += self._works.seconds
        self._works = InFlight()

    # -- what this rank holds (bench, checkpoint) ----------------------------------------------------------------
    def flat_shards(self) -> list[tuple[FlatShard, nn.Parameter]]:
        """Each bucket's layout and this rank's chunk of it (the sharded checkpoint cuts along these)."""
        self.wait_parameters()  # a checkpoint reads or writes the shards: no gather may still write into them
        return [(b.flat_shard, b.shard) for b in self._buckets]

    @property
    def bucket_sizes(self) -> list[int]:
        return [b.nbytes for b in self._buckets]
