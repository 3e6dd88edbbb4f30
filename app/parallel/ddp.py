"""DistributedDataParallel from scratch: the lesson's wrapper, grown into what PyTorch's does.

Read this file top to bottom. The idea fits in four lines:

    1. every rank starts from rank 0's parameters and buffers (one broadcast at construction);
    2. every rank runs forward and backward on its own shard of the batch;
    3. as backward produces each parameter's gradient, a hook copies it into a flat *bucket*; a full bucket is
       all-reduced (SUM, then divide by the world size) *asynchronously*, while backward goes on computing the
       gradients of earlier layers;
    4. when backward ends, we wait for the outstanding buckets and copy the averages back into ``p.grad``.

So ``loss.backward(); optimizer.step()`` works exactly as with ``torch.nn.parallel.DistributedDataParallel``, and
because every rank applies the same averaged gradient to the same parameters, the ranks stay identical.

    hooks (one per parameter)   buckets (reverse order, <= bucket_cap_mb)     async all-reduce        end of backward
    p_n.grad ready ─┐
    p_n-1.grad ready├──► bucket 0 full ──► all_reduce(SUM)/world ──► (runs while backward continues) ─┐
    ...             ┘                                                                                  ├─► wait all,
    p_1.grad ready ─┐                                                                                  │   copy into
    p_0.grad ready ─┴──► bucket k full ──► all_reduce(SUM)/world ─────────────────────────────────────┘   p.grad

The names match PyTorch's (``bucket_cap_mb``, ``broadcast_buffers``, ``find_unused_parameters``,
``require_backward_grad_sync``, ``no_sync()``, ``register_comm_hook``) so either wrapper can be swapped for the
other and a reader can map this file onto ``torch/nn/parallel/distributed.py`` and its C++ ``Reducer``.

Try it: ``make demo`` (4 CPU ranks under torchrun, compared step by step with single-process training).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]

# The first bucket is capped lower than the rest, as in PyTorch (dist._DEFAULT_FIRST_BUCKET_BYTES): the last
# layers' gradients arrive first, and a small first bucket gets communication going while most of backward is
# still ahead. With one 25 MB bucket for a 24 MB model, nothing could overlap at all.
FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass
class CommStats:
    """What the wrapper did on the wire; the trainer turns these into Prometheus metrics.

    Counters are cumulative since construction; ``last_*`` fields describe the most recent synchronised backward.
    """

    sync_calls: int = 0  # backward passes that synchronised gradients (no_sync() passes are not counted)
    buckets_reduced: int = 0  # buckets handed to the comm hook
    bytes_reduced: int = 0  # bytes of bucket buffers handed to the comm hook (before any compression)
    allreduce_seconds: float = 0.0  # sum over buckets of launch -> result ready
    wait_seconds: float = 0.0  # time the end of backward blocked on communication ("exposed" comm)
    last_bucket_seconds: list[float] = field(default_factory=list)  # per bucket, in launch order
    last_bucket_bytes: list[int] = field(default_factory=list)
    last_wait_seconds: float = 0.0
    # First bucket's launch -> last bucket's completion: the wall time the reduction took. Buckets overlap and
    # queue behind each other, so the sum of last_bucket_seconds double-counts; bandwidth uses this span.
    last_comm_span_seconds: float = 0.0


class GradBucket:
    """One flat buffer holding the gradients of several parameters, with PyTorch's ``GradBucket`` accessors.

    Flattening is what makes buckets pay: one all-reduce of 25 MB costs about one latency floor, while a thousand
    all-reduces of 25 KB each pay it a thousand times.
    """

    def __init__(self, index: int, params: list[nn.Parameter], param_indices: list[int], is_last: bool):
        self._index = index
        self._params = params
        self.param_indices = param_indices  # positions of our parameters in the wrapper's parameter list
        self._is_last = is_last
        self._numels = [p.numel() for p in params]
        self._offsets = [sum(self._numels[:i]) for i in range(len(params))]
        # All parameters of one bucket share dtype and device (see _build_buckets), so one buffer fits all.
        self._buffer = torch.zeros(sum(self._numels), dtype=params[0].dtype, device=params[0].device)
        # Views made once: slicing per gradient per step would cost Python time on the backward's critical path.
        self._views = [self._buffer[o : o + n].view_as(p) for o, n, p in zip(self._offsets, self._numels, params)]

    # -- PyTorch's GradBucket interface, what comm hooks may call ------------------------------------------------
    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        return [self.view(i) for i in range(len(self._params))]

    # -- ours ----------------------------------------------------------------------------------------------------
    def view(self, i: int) -> torch.Tensor:
        """The slice of the flat buffer that belongs to parameter ``i``, shaped like the parameter."""
        return self._views[i]

    @property
    def nbytes(self) -> int:
        return self._buffer.numel() * self._buffer.element_size()


def _broadcast_coalesced(tensors: list[torch.Tensor], src: int, group) -> None:
    """Broadcast ``tensors`` from global rank ``src`` in place, one collective per (device, dtype).

    One flat broadcast instead of one per tensor, for the same reason buckets exist.
    """
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    for same_kind in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same_kind])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        with torch.no_grad():
            for t in same_kind:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves every rank with the gradient averaged over all ranks.

    Args (keyword-only, as in PyTorch):
        process_group: the group to synchronise over; ``None`` is the default (world) group.
        bucket_cap_mb: bucket size in MiB. Bigger buckets mean fewer all-reduces (less latency paid) but a later
            start of the first one (less overlap with backward); 25 is PyTorch's default.
        broadcast_buffers: re-send buffers (BatchNorm running stats) from rank 0 before each forward, so every
            rank evaluates with the same statistics.
        find_unused_parameters: walk the autograd graph after each forward and mark parameters it did not reach as
            ready, so their buckets still complete. Costs a graph walk per step; needed only when forward skips
            parameters (branches, early exits). Without it such a backward raises an error naming them.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group=None,
        bucket_cap_mb: float = 25,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
    ):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs an initialised process group: call "
                "torch.distributed.init_process_group() first (torchrun sets its env:// variables)"
            )
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        # Global rank of the group's rank 0: broadcast takes a global rank even inside a subgroup.
        self._src_rank = dist.get_global_rank(self.process_group, 0)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.stats = CommStats()

        # module.parameters() yields a tied (shared) parameter once, so it gets one hook and one bucket slot.
        # Frozen parameters get no gradient: they are left out of buckets and hooks alike.
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._param_names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
        self._buffers_to_sync = list(module.buffers())
        if not self._params:
            raise ValueError(
                "the module has no parameter that requires a gradient: there is nothing for "
                "DistributedDataParallel to synchronise; run it unwrapped"
            )

        self._check_same_model_everywhere()
        # 1. Everyone starts from rank 0's weights: ranks seeded differently would otherwise drift apart forever.
        _broadcast_coalesced(
            [p.data for p in module.parameters()] + self._buffers_to_sync, src=self._src_rank, group=self.process_group
        )

        self._buckets, self._slot = self._build_buckets()
        self._bucket_sizes = [b.nbytes for b in self._buckets]
        self._comm_hook: CommHook | None = None  # None: the built-in all-reduce (see _launch_ready_buckets)
        self._comm_state: Any = self.process_group

        # Per-backward state, reset by _prepare_for_backward() in each synchronising forward.
        self._sync_this_backward = False
        self._pending: list[int] = []  # per bucket: parameters not yet ready
        self._ready: list[bool] = []  # per parameter: gradient already copied into its bucket
        self._next_bucket = 0  # buckets are launched strictly in index order (see _launch_ready_buckets)
        self._futures: list[torch.futures.Future | None] = []
        self._launch_times: list[float] = []
        self._done_times: list[float] = []
        self._unused: list[int] = []  # not reached by this forward's graph (find_unused_parameters)
        self._locally_unused: list[int] = []  # ... and without any gradient accumulated under no_sync()
        self._callback_queued = False

        # 2. One hook per parameter, fired by autograd right after the parameter's .grad has been accumulated.
        for index, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._make_grad_hook(index))

    # ------------------------------------------------------------------------------------------------------------
    # Construction helpers
    # ------------------------------------------------------------------------------------------------------------
    def _check_same_model_everywhere(self) -> None:
        """Fail clearly, on every rank, if ranks wrapped different models (a bucket mismatch would hang later)."""
        # Count, total size and a fingerprint of every parameter's (shape, dtype): two models with the same
        # number of elements but other shapes would otherwise average unrelated tensors without a word.
        layout = hashlib.sha256(repr([(tuple(p.shape), str(p.dtype)) for p in self._params]).encode()).digest()
        mine = torch.tensor(
            [len(self._params), sum(p.numel() for p in self._params), int.from_bytes(layout[:7], "little")],
            dtype=torch.int64,
            device=self._params[0].device,
        )
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.process_group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.process_group)
        if not torch.equal(low, high):
            raise RuntimeError(
                f"ranks wrap different models: {len(self._params)} parameters, {mine[1].item()} "
                f"elements, layout fingerprint {layout[:7].hex()} here, but the ranks disagree; "
                f"build the same model on every rank"
            )

    def _build_buckets(self) -> tuple[list[GradBucket], list[tuple[int, int]]]:
        """Group parameters into buckets of at most ``bucket_cap_bytes``, in *reverse* registration order.

        Backward runs roughly from the last layer to the first, so the last-registered parameters get their
        gradients first: putting them in bucket 0 lets the first all-reduce start while the earlier layers'
        gradients are still being computed. That is the overlap. Bucket 0 is capped at FIRST_BUCKET_BYTES.
        """
        groups: list[list[int]] = []
        current: list[int] = []
        current_bytes = 0
        for index in reversed(range(len(self._params))):
            p = self._params[index]
            nbytes = p.numel() * p.element_size()
            first = self._params[current[0]] if current else None
            cap = min(self.bucket_cap_bytes, FIRST_BUCKET_BYTES) if not groups else self.bucket_cap_bytes
            starts_new = first is not None and (
                current_bytes + nbytes > cap or (p.dtype, p.device) != (first.dtype, first.device)
            )
            if starts_new:
                groups.append(current)
                current, current_bytes = [], 0
            current.append(index)
            current_bytes += nbytes  # a single parameter larger than the cap gets a bucket of its own
        if current:
            groups.append(current)

        buckets = [
            GradBucket(i, [self._params[j] for j in g], g, is_last=(i == len(groups) - 1)) for i, g in enumerate(groups)
        ]
        slot = [(0, 0)] * len(self._params)  # parameter index -> (bucket index, position in bucket)
        for b in buckets:
            for pos, index in enumerate(b.param_indices):
                slot[index] = (b.index(), pos)
        return buckets, slot

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes per bucket, in launch order (for logs, metrics and tests); fixed once the buckets are built."""
        return self._bucket_sizes

    # ------------------------------------------------------------------------------------------------------------
    # Public API (as PyTorch's)
    # ------------------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient synchronisation: gradients accumulate locally in ``p.grad``.

        The *forward* must run inside the context, as with PyTorch: whether a backward syncs is decided when its
        forward runs. The first backward after leaving the context syncs everything accumulated so far.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the default all-reduce of each bucket by ``hook(state, bucket) -> Future[Tensor]``.

        The future must resolve to the bucket's *averaged* gradients (the hook divides by the world size).
        ``app.parallel.comm_hooks`` has plain, fp16 and bf16 hooks; PyTorch's ``ddp_comm_hooks`` work too.
        """
        if self._comm_hook is not None:
            # As PyTorch: swapping reductions between steps would silently mix two averaging schemes.
            raise RuntimeError("register_comm_hook can be called only once, before training")
        self._comm_hook = hook
        self._comm_state = state

    def forward(self, *inputs, **kwargs):
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if sync and self.broadcast_buffers and self._buffers_to_sync:
            # BatchNorm's running stats are updated locally by each rank's forward; rank 0's win. Done only for
            # forwards that will sync, like PyTorch (buffers are not re-sent inside no_sync()).
            _broadcast_coalesced(self._buffers_to_sync, src=self._src_rank, group=self.process_group)
        output = self.module(*inputs, **kwargs)
        self._sync_this_backward = sync
        if sync:
            self._prepare_for_backward(output)
        return output

    # ------------------------------------------------------------------------------------------------------------
    # One synchronised backward
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_for_backward(self, output) -> None:
        n = len(self._buckets)
        self._pending = [len(b.parameters()) for b in self._buckets]
        self._ready = [False] * len(self._params)
        self._next_bucket = 0
        self._futures = [None] * n
        self._launch_times = [0.0] * n
        self._done_times = [0.0] * n
        self._callback_queued = False
        self._unused = self._find_unused(output) if self.find_unused_parameters else []

    def _find_unused(self, output) -> list[int]:
        """Indices of parameters this forward's autograd graph does not reach (their hooks will never fire)."""
        reached: set[int] = set()
        seen: set = set()
        stack = [t.grad_fn for t in _tensors_in(output) if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            variable = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf parameter
            if variable is not None:
                reached.add(id(variable))
            stack.extend(next_fn for next_fn, _ in fn.next_functions)
        return [i for i, p in enumerate(self._params) if id(p) not in reached]

    def _make_grad_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if not self._sync_this_backward:
                return  # inside no_sync(): leave the local gradient to accumulate in p.grad
            if not self._callback_queued:
                # First hook of this backward: ask autograd to call us once the whole backward pass is done.
                # (PyTorch's Reducer does the same from C++.)
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
                # Parameters the forward never reached count as ready now, as PyTorch does at the first hook, so
                # their buckets can complete. Their slot gets what p.grad holds: zeros, or gradient accumulated
                # under no_sync() by earlier micro-batches that did use them (it must still be averaged).
                self._locally_unused = [i for i in self._unused if self._params[i].grad is None]
                for unused in self._unused:
                    self._mark_ready(unused, grad=self._params[unused].grad)
            self._mark_ready(index, grad=param.grad)

        return hook

    def _mark_ready(self, index: int, grad: torch.Tensor | None) -> None:
        if self._ready[index]:
            # A parameter used twice in one graph still gets one hook call after accumulation. A second call means
            # the graph walk called it unused, yet backward reached it: the loss used it outside forward's output.
            raise RuntimeError(
                f"parameter {self._param_names[id(self._params[index])]!r} got a gradient although "
                f"forward's output does not depend on it (find_unused_parameters marked it unused): "
                f"the loss uses it outside forward; route every use through forward"
            )
        self._ready[index] = True
        bucket_index, pos = self._slot[index]
        bucket = self._buckets[bucket_index]
        # (Autograd runs hooks with grad mode off, and the buffer is no leaf of any graph: a plain copy suffices.)
        if grad is None:
            bucket.view(pos).zero_()
        else:
            bucket.view(pos).copy_(grad)
        self._pending[bucket_index] -= 1
        if self._pending[bucket_index] == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch every full bucket, in index order.

        Collectives are matched by call order on every rank, so all ranks must launch bucket 0, then 1, ... even if
        some gradients arrive in a different order here than there; a full bucket waits for its predecessors.
        """
        while self._next_bucket < len(self._buckets) and self._pending[self._next_bucket] == 0:
            i = self._next_bucket
            bucket = self._buckets[i]
            self._launch_times[i] = time.perf_counter()
            if self._comm_hook is None:
                # Built-in path: all-reduce with SUM, in place. The division by the world size happens when the
                # result is copied back into p.grad (_finalize_backward): fused into that copy, it costs no extra
                # pass over the gradients (PyTorch's Reducer fuses it into its copy *into* the bucket instead).
                fut = dist.all_reduce(
                    bucket.buffer(), op=dist.ReduceOp.SUM, group=self.process_group, async_op=True
                ).get_future()
            else:
                fut = self._comm_hook(self._comm_state, bucket)  # the hook averages, as with PyTorch's DDP

            def record_done(f: torch.futures.Future, i=i) -> torch.Tensor:
                # Runs on the communication thread when the reduction completes: launch -> done is the
                # all-reduce latency the metrics report, independent of when backward gets around to waiting.
                self._done_times[i] = time.perf_counter()
                value = f.value()
                return value[0] if isinstance(value, list) else value  # all_reduce's future holds a list

            self._futures[i] = fut.then(record_done)
            self._next_bucket += 1

    def _finalize_backward(self) -> None:
        """Called by autograd after the last gradient of this backward: wait, then write averages to ``p.grad``."""
        if self._next_bucket < len(self._buckets):
            missing = [self._param_names[id(p)] for p, ready in zip(self._params, self._ready) if not ready]
            self._sync_this_backward = False
            raise RuntimeError(
                f"parameters that received no gradient in this backward: {', '.join(missing)}; every rank would "
                f"wait forever for their buckets. Pass find_unused_parameters=True to DistributedDataParallel if "
                f"forward skips them on purpose, or make sure the loss depends on them"
            )

        globally_used = self._all_reduce_used_flags() if self.find_unused_parameters else None
        # The built-in all-reduce leaves the SUM in the bucket; a comm hook leaves the average.
        divisor = self.world_size if self._comm_hook is None else 1
        waited = 0.0
        with torch.no_grad():
            for bucket, fut in zip(self._buckets, self._futures):
                # Wait bucket by bucket and copy each out as soon as it is back: the copy of bucket i overlaps
                # the reduction of bucket i+1. Only the waiting counts as exposed communication.
                wait_start = time.perf_counter()
                averaged = fut.wait()
                waited += time.perf_counter() - wait_start
                if averaged.data_ptr() != bucket.buffer().data_ptr():
                    bucket.buffer().copy_(averaged)  # hooks may return a new tensor rather than the buffer
                for pos, (p, index) in enumerate(zip(bucket.parameters(), bucket.param_indices)):
                    if globally_used is not None and not globally_used[index]:
                        continue  # no rank used it: leave p.grad untouched (None), as PyTorch does
                    view = bucket.view(pos)
                    if p.grad is None:
                        p.grad = view / divisor if divisor != 1 else view.clone()
                    elif divisor != 1:
                        torch.div(view, divisor, out=p.grad)  # SUM ÷ world size, written straight into p.grad
                    else:
                        p.grad.copy_(view)

        seconds = [done - launch for done, launch in zip(self._done_times, self._launch_times)]
        s = self.stats
        s.sync_calls += 1
        s.buckets_reduced += len(self._buckets)
        s.bytes_reduced += sum(self.bucket_sizes)
        s.allreduce_seconds += sum(seconds)
        s.wait_seconds += waited
        s.last_bucket_seconds = seconds
        s.last_bucket_bytes = self.bucket_sizes
        s.last_wait_seconds = waited
        s.last_comm_span_seconds = max(self._done_times) - min(self._launch_times)
        self._sync_this_backward = False

    def _all_reduce_used_flags(self) -> torch.Tensor:
        """Which parameters some rank used: only those get a gradient. One tiny extra all-reduce, as in PyTorch."""
        used = torch.ones(len(self._params), dtype=torch.int32, device=self._buckets[0].buffer().device)
        used[self._locally_unused] = 0  # not reached by this forward and no gradient accumulated under no_sync()
        # int32 rather than bool: NCCL and gloo both reduce int32 with SUM.
        dist.all_reduce(used, op=dist.ReduceOp.SUM, group=self.process_group)
        return used.bool().tolist()


def _tensors_in(output) -> list[torch.Tensor]:
    """Every tensor inside a (possibly nested) forward output."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors_in(item)]
    return []
