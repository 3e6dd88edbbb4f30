"""DistributedDataParallel from scratch: the lesson's wrapper, grown into a drop-in for PyTorch's.

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

The constructor is PyTorch 2.13's, argument for argument (``DistributedDataParallel(model, device_ids=[rank])``
works by changing the import only); docs/ddp.md maps each argument to what it does here. With
``gradient_as_bucket_view=True`` step 4 disappears: ``p.grad`` *is* a slice of the bucket, so the gradient exists
once. With ``static_graph=True`` the first iteration is studied once (unused parameters, the order gradients
arrive in) and later iterations reuse it.

Try it: ``make demo`` (4 CPU ranks under torchrun, compared step by step with single-process training).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]

DEFAULT_BUCKET_CAP_MB = 25  # PyTorch's default, used when bucket_cap_mb is None
# With the default bucket size, the first bucket is capped lower than the rest, as in PyTorch
# (dist._DEFAULT_FIRST_BUCKET_BYTES): the last layers' gradients arrive first, and a small first bucket gets
# communication going while most of backward is still ahead. An explicit bucket_cap_mb applies to every bucket,
# the first included, again as in PyTorch: a user who asks for 25 MB buckets gets them.
FIRST_BUCKET_BYTES = 1024 * 1024

# Arguments of PyTorch's constructor that this wrapper does not implement, with the value that means "not used".
# Any other value is refused: silently ignoring them would change what training computes or how fast.
_NOT_IMPLEMENTED = {
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "mixed_precision": None,
    "device_mesh": None,
    "bucket_cap_mb_list": None,
    "batched_grad_copy": False,
}


class _Clock:
    """Timestamps for one synchronised backward: ``perf_counter`` on CPU, CUDA events on a GPU.

    On CUDA a collective's future completes when the collective is *enqueued*, and ``fut.wait()`` only makes the
    current stream wait; host clocks would time the launch, not the communication. CUDA events recorded on the
    streams that the collective's completion is synchronised with time the real thing; they are read (a host sync
    per event, already complete by then) only when the stats are read, after the step's own synchronisation.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: in a future's callback, one synchronised with the collective
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class CommStats:
    """What the wrapper did on the wire; the trainer turns these into Prometheus metrics.

    Counters are cumulative since construction; ``last_*`` fields describe the most recent synchronised backward.
    On CUDA the times are computed from CUDA events the first time a time field is read (after the step has
    synchronised, reading costs nothing; before, it waits for the step's communication).
    """

    def __init__(self):
        self.sync_calls = 0  # backward passes that synchronised gradients (no_sync() passes are not counted)
        self.buckets_reduced = 0  # buckets handed to the comm hook
        self.bytes_reduced = 0  # bytes of bucket buffers handed to the comm hook (before any compression)
        self.last_bucket_bytes: list[int] = []
        self._allreduce_seconds = 0.0  # sum over buckets of launch -> result ready
        self._wait_seconds = 0.0  # time the end of backward blocked on communication ("exposed" comm)
        self._last_bucket_seconds: list[float] = []  # per bucket, in launch order
        self._last_wait_seconds = 0.0
        # First bucket's launch -> last bucket's completion: the wall time the reduction took. Buckets overlap and
        # queue behind each other, so the sum of last_bucket_seconds double-counts; bandwidth uses this span.
        self._last_comm_span_seconds = 0.0
        self._pending: Callable[[], tuple[list[float], float, float]] | None = None

    def _record(self, bucket_bytes: list[int], timings: Callable[[], tuple[list[float], float, float]]) -> None:
        self._resolve()  # the previous step's times, if nobody read them
        self.sync_calls += 1
        self.buckets_reduced += len(bucket_bytes)
        self.bytes_reduced += sum(bucket_bytes)
        self.last_bucket_bytes = bucket_bytes
        self._pending = timings

    def _resolve(self) -> None:
        if self._pending is None:
            return
        bucket_seconds, wait, span = self._pending()
        self._pending = None
        self._allreduce_seconds += sum(bucket_seconds)
        self._wait_seconds += wait
        self._last_bucket_seconds, self._last_wait_seconds, self._last_comm_span_seconds = bucket_seconds, wait, span

    def __getstate__(self):  # CUDA events do not pickle: resolve them first
        self._resolve()
        return self.__dict__

    def _resolved(name: str):  # noqa: N805 (a property factory used in the class body, not a method)
        return property(lambda self: (self._resolve(), getattr(self, name))[1])

    allreduce_seconds = _resolved("_allreduce_seconds")
    wait_seconds = _resolved("_wait_seconds")
    last_bucket_seconds = _resolved("_last_bucket_seconds")
    last_wait_seconds = _resolved("_last_wait_seconds")
    last_comm_span_seconds = _resolved("_last_comm_span_seconds")
    del _resolved


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


def _device_of(d) -> torch.device:
    """``device_ids`` entries as PyTorch accepts them: an int (a CUDA index), a string or a ``torch.device``."""
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


def _same_device(a: torch.device, b: torch.device) -> bool:
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return a.type == b.type and (current if a.index is None else a.index) == (current if b.index is None else b.index)


def _to_device(obj, device: torch.device):
    """Move every tensor in a (nested) forward input to ``device``, as PyTorch's DDP does when given device_ids."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves every rank with the gradient averaged over all ranks.

    The signature is ``torch.nn.parallel.DistributedDataParallel``'s (torch 2.13), same order, same defaults.

    Args:
        module: the model, on one device (this rank's GPU, or the CPU).
        device_ids: ``None``, or one device: the GPU ``module`` lives on. Forward inputs are then moved to it, as
            PyTorch does. More than one device, or any device for a CPU module, is an error (as PyTorch's).
        output_device: ``None`` or ``device_ids[0]``; like PyTorch 2.13 with one device per process, nothing is
            moved to it. Given for a CPU module, an error (as PyTorch's, whose truthiness lets 0 pass).
        dim: the scatter dimension of the old one-process-many-GPUs mode; one device per process never scatters,
            so only ``0`` is accepted.
        broadcast_buffers: deprecated in 2.13 for ``forward_sync_buffers`` (same FutureWarning); ``False`` also
            leaves buffers out of the broadcast at construction. ``None``: ``True``.
        init_sync: at construction, check that every rank wraps the same model and broadcast rank 0's parameters
            (and buffers) to all. ``False`` skips both: the ranks must already agree.
        process_group: the group to synchronise over; ``None`` is the default (world) group.
        bucket_cap_mb: bucket size in MiB; ``None`` is 25. Bigger buckets mean fewer all-reduces (less latency
            paid) but a later start of the first one (less overlap with backward). With ``None`` the first bucket
            is capped at 1 MiB, as in PyTorch; a bucket closes once it holds at least its cap (PyTorch's rule).
        find_unused_parameters: walk the autograd graph after each forward and mark parameters it did not reach as
            ready, so their buckets still complete. Costs a graph walk and a small all-reduce per step; needed only
            when forward skips parameters. Without it such a backward raises an error naming them.
        check_reduction: deprecated and ignored, as in PyTorch (a FutureWarning when ``True``).
        gradient_as_bucket_view: ``p.grad`` becomes a view into its bucket after the first synchronised backward:
            the gradient is stored once, and the copy back from the bucket disappears (so does the copy into it
            when ``p.grad`` is kept between steps, e.g. ``zero_grad(set_to_none=False)``).
        static_graph: the set of used parameters and the order gradients arrive in never change. The first
            iteration finds both (as ``find_unused_parameters`` would); later ones skip the graph walk and the
            used-flags all-reduce, and buckets are rebuilt once in rank 0's arrival order so each fills up and
            launches in turn.
        skip_all_reduce_unused_params: with ``find_unused_parameters`` or ``static_graph``: trust that every rank
            leaves the same parameters unused; skip the used-flags all-reduce and buckets holding only unused
            parameters. Ranks that disagree would hang, as in PyTorch.
        forward_sync_buffers: broadcast rank 0's buffers (BatchNorm running stats) before each synchronising
            forward. ``None``: ``True``. Buffers are broadcast at construction either way (with ``init_sync``).
        delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision, device_mesh,
            bucket_cap_mb_list, batched_grad_copy: not implemented; a non-default value raises
            ``NotImplementedError`` naming it.

    Example::

        dist.init_process_group("gloo")
        model = DistributedDataParallel(MiniMLP())  # or (model.cuda(rank), device_ids=[rank]) on GPUs
        loss_fn(model(x), y).backward()  # every rank now holds the averaged gradient
    """

    def __init__(
        self,
        module,
        device_ids=None,
        output_device=None,
        dim=0,
        broadcast_buffers=None,
        init_sync=True,
        process_group=None,
        bucket_cap_mb=None,
        find_unused_parameters=False,
        check_reduction=False,
        gradient_as_bucket_view=False,
        static_graph=False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params=False,
        bucket_cap_mb_list=None,
        batched_grad_copy=False,
        forward_sync_buffers=None,
    ):
        super().__init__()
        _refuse_not_implemented(locals())
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs an initialised process group: call "
                "torch.distributed.init_process_group() first (torchrun sets its env:// variables)"
            )
        first_bucket_capped = bucket_cap_mb is None
        bucket_cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if dim != 0:
            raise ValueError(
                f"dim={dim}: inputs are never scattered (one device per process), so only dim=0 is accepted"
            )
        if check_reduction:
            warnings.warn("check_reduction is deprecated and ignored, as in PyTorch", FutureWarning, stacklevel=2)
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        # Global rank of the group's rank 0: broadcast takes a global rank even inside a subgroup.
        self._src_rank = dist.get_global_rank(self.process_group, 0)
        self.dim = dim
        self.forward_sync_buffers, init_sync_buffers = _buffer_sync_flags(broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.bucket_bytes_cap = self.bucket_cap_bytes  # PyTorch's attribute name
        self.first_bucket_cap_bytes = FIRST_BUCKET_BYTES if first_bucket_capped else self.bucket_cap_bytes
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
        self.device = self._params[0].device
        self.device_ids, self.output_device = self._check_devices(device_ids, output_device)
        self._clock = _Clock(self.device)

        if init_sync:
            self._check_same_model_everywhere()
            # 1. Everyone starts from rank 0's weights: ranks seeded differently would otherwise drift apart forever.
            buffers = self._buffers_to_sync if init_sync_buffers else []
            _broadcast_coalesced(
                [p.data for p in module.parameters()] + buffers, src=self._src_rank, group=self.process_group
            )

        self._buckets, self._slot = self._build_buckets(list(reversed(range(len(self._params)))))
        self._bucket_sizes = [b.nbytes for b in self._buckets]
        self._comm_hook: CommHook | None = None  # None: the built-in all-reduce (see _launch_ready_buckets)
        self._comm_state: Any = self.process_group

        # What static_graph learns in its first synchronised iteration (None until then).
        self._static_unused: list[int] | None = None
        self._static_used_flags: list[bool] | None = None
        self._arrival_order: list[int] = []

        # Per-backward state, reset by _prepare_for_backward() in each synchronising forward.
        self._sync_this_backward = False
        self._pending: list[int] = []  # per bucket: parameters not yet ready
        self._ready: list[bool] = []  # per parameter: gradient already copied into its bucket
        self._next_bucket = 0  # buckets are launched strictly in index order (see _launch_ready_buckets)
        self._futures: list[torch.futures.Future | None] = []
        self._launch_times: list = []
        self._done_times: list = []
        self._unused: list[int] = []  # not reached by this forward's graph (find_unused_parameters)
        self._locally_unused: list[int] = []  # ... and without any gradient accumulated under no_sync()
        self._callback_queued = False

        # 2. One hook per parameter, fired by autograd right after the parameter's .grad has been accumulated.
        for index, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._make_grad_hook(index))

    # ------------------------------------------------------------------------------------------------------------
    # Construction helpers
    # ------------------------------------------------------------------------------------------------------------
    def _check_devices(self, device_ids, output_device) -> tuple[list[int] | None, int | None]:
        """PyTorch's rules for ``device_ids``/``output_device``, plus: the one device must be the module's."""
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(
                f"device_ids={device_ids}: device_ids can only be None or contain a single element "
                f"(one process per device; start one rank per GPU with torchrun)"
            )
        devices = {p.device for p in self._params}
        if len({d.type for d in devices}) != 1 or len(devices) > 1:
            raise ValueError(f"the module's parameters are on several devices ({devices}): move it to one device")
        if not device_ids or self.device.type == "cpu":
            if device_ids or output_device:  # PyTorch's truthiness: output_device=0 passes for a CPU module
                raise ValueError(
                    f"device_ids={device_ids}, output_device={output_device}: these work only for a module on one "
                    f"GPU, but the module is on {self.device}; pass neither (DDP(model)) for a CPU module"
                )
            return None, None
        wanted = _device_of(device_ids[0])
        if not _same_device(wanted, self.device):
            raise ValueError(
                f"device_ids={device_ids}: the module lives on {self.device}; move it first "
                f"(model.to({wanted})) or pass device_ids=[{self.device.index}]"
            )
        out = _device_of(output_device if output_device is not None else device_ids[0])
        return [self.device.index], out.index

    def _check_same_model_everywhere(self) -> None:
        """Fail clearly, on every rank, if ranks wrapped different models (a bucket mismatch would hang later)."""
        # Count, total size and a fingerprint of every parameter's (shape, dtype): two models with the same
        # number of elements but other shapes would otherwise average unrelated tensors without a word.
        layout = hashlib.sha256(repr([(tuple(p.shape), str(p.dtype)) for p in self._params]).encode()).digest()
        mine = torch.tensor(
            [len(self._params), sum(p.numel() for p in self._params), int.from_bytes(layout[:7], "little")],
            dtype=torch.int64,
            device=self.device,
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

    def _build_buckets(self, order: list[int]) -> tuple[list[GradBucket], list[tuple[int, int]]]:
        """Group parameters, taken in ``order``, into buckets of at most ``bucket_cap_bytes``.

        The order is the *reverse* registration order at construction: backward runs roughly from the last layer
        to the first, so the last-registered parameters get their gradients first, and putting them in bucket 0
        lets the first all-reduce start while the earlier layers' gradients are still being computed. That is the
        overlap. (static_graph later rebuilds with the order really observed.) Bucket 0 is capped at
        ``first_bucket_cap_bytes``.

        PyTorch's rule (``dist._compute_bucket_assignment_by_size``): a parameter joins the open bucket, which
        closes once it holds at least its cap. So a bucket may overshoot its cap by its last parameter, and a
        last layer of 1 MiB + bias fills a 1 MiB first bucket rather than leaving the bias alone in it.
        """
        groups: list[list[int]] = []
        current: list[int] = []
        current_bytes = 0
        for index in order:
            p = self._params[index]
            first = self._params[current[0]] if current else None
            if first is not None and (p.dtype, p.device) != (first.dtype, first.device):
                groups.append(current)  # one dtype and device per bucket: it is one flat tensor
                current, current_bytes = [], 0
            current.append(index)
            current_bytes += p.numel() * p.element_size()
            cap = self.first_bucket_cap_bytes if not groups else self.bucket_cap_bytes
            if current_bytes >= cap:
                groups.append(current)
                current, current_bytes = [], 0
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
        """Bytes per bucket, in launch order (for logs, metrics and tests)."""
        return self._bucket_sizes

    @property
    def broadcast_buffers(self) -> bool:
        """The deprecated name of ``forward_sync_buffers``, as in PyTorch 2.13."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def gradient_bytes(self) -> int:
        """Bytes held by gradients and buckets together, each storage counted once (a view costs nothing)."""
        storages = {b.buffer().untyped_storage().data_ptr(): b.nbytes for b in self._buckets}
        for p in self._params:
            if p.grad is not None:
                s = p.grad.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())

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

    def _set_static_graph(self) -> None:
        """PyTorch's older way to ask for ``static_graph=True`` after construction (before the first forward)."""
        self.static_graph = True

    def forward(self, *inputs, **kwargs):
        if self.device_ids:
            inputs, kwargs = _to_device(inputs, self.device), _to_device(kwargs, self.device)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if sync and self.forward_sync_buffers and self._buffers_to_sync:
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
        self._launch_times = [None] * n
        self._done_times = [None] * n
        self._callback_queued = False
        self._arrival_order = []
        if self._static_unused is not None:
            self._unused = self._static_unused  # static graph: learned in the first iteration, no walk
        elif self.find_unused_parameters or self.static_graph:
            self._unused = self._find_unused(output)
        else:
            self._unused = []

    def _learning_static_graph(self) -> bool:
        return self.static_graph and self._static_unused is None

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
                    self._mark_ready(unused)
            self._mark_ready(index)

        return hook

    def _mark_ready(self, index: int) -> None:
        if self._ready[index]:
            # A parameter used twice in one graph still gets one hook call after accumulation. A second call means
            # the graph walk called it unused, yet backward reached it: the loss used it outside forward's output.
            raise RuntimeError(
                f"parameter {self._param_names[id(self._params[index])]!r} got a gradient although "
                f"forward's output does not depend on it (find_unused_parameters marked it unused): "
                f"the loss uses it outside forward; route every use through forward"
            )
        self._ready[index] = True
        if self._learning_static_graph():
            self._arrival_order.append(index)
        bucket_index, pos = self._slot[index]
        bucket = self._buckets[bucket_index]
        param, view = self._params[index], bucket.view(pos)
        # (Autograd runs hooks with grad mode off, and the buffer is no leaf of any graph: a plain copy suffices.)
        if param.grad is None:
            view.zero_()
        elif param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            if self.gradient_as_bucket_view:
                # From now on p.grad *is* the bucket slot: the separate gradient tensor is freed, and while p.grad
                # is kept (zero_grad(set_to_none=False), no_sync()), autograd accumulates straight into the bucket.
                param.grad = view
        # else: p.grad already is the bucket slot (gradient_as_bucket_view), nothing to copy.
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
            self._launch_times[i] = self._clock.now()
            if self._skips(bucket):
                # Only unused parameters, on every rank by the caller's promise: nothing to reduce.
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
            elif self._comm_hook is None:
                # Built-in path: all-reduce with SUM, in place. The division by the world size happens when the
                # result is copied back into p.grad (_finalize_backward): fused into that copy, it costs no extra
                # pass over the gradients (PyTorch's Reducer fuses it into its copy *into* the bucket instead).
                fut = dist.all_reduce(
                    bucket.buffer(), op=dist.ReduceOp.SUM, group=self.process_group, async_op=True
                ).get_future()
            else:
                fut = self._comm_hook(self._comm_state, bucket)  # the hook averages, as with PyTorch's DDP

            def record_done(f: torch.futures.Future, i=i) -> torch.Tensor:
                # Runs when the reduction completes (gloo: on its thread, once the data is back; CUDA: on a stream
                # synchronised with the collective, so the event completes with it). launch -> done is the
                # all-reduce latency the metrics report, independent of when backward gets around to waiting.
                self._done_times[i] = self._clock.now()
                value = f.value()
                return value[0] if isinstance(value, list) else value  # all_reduce's future holds a list

            self._futures[i] = fut.then(record_done)
            self._next_bucket += 1

    def _skips(self, bucket: GradBucket) -> bool:
        if not self.skip_all_reduce_unused_params or not self._locally_unused:
            return False
        unused = set(self._locally_unused)
        return all(i in unused for i in bucket.param_indices)

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

        globally_used = self._globally_used_flags()
        # The built-in all-reduce leaves the SUM in the bucket; a comm hook leaves the average.
        divisor = self.world_size if self._comm_hook is None else 1
        waits = []
        with torch.no_grad():
            for bucket, fut in zip(self._buckets, self._futures):
                # Wait bucket by bucket and write each out as soon as it is back: the write of bucket i overlaps
                # the reduction of bucket i+1. Only the waiting counts as exposed communication.
                before = self._clock.now()
                averaged = fut.wait()
                waits.append((before, self._clock.now()))
                if averaged.data_ptr() != bucket.buffer().data_ptr():
                    bucket.buffer().copy_(averaged)  # hooks may return a new tensor rather than the buffer
                self._write_back(bucket, globally_used, divisor)
        self._record_stats(waits)
        if self._learning_static_graph():
            self._learn_static_graph(globally_used)
        self._sync_this_backward = False

    def _write_back(self, bucket: GradBucket, globally_used: list[bool] | None, divisor: int) -> None:
        """Make ``p.grad`` hold the bucket's averages: a copy, or (gradient_as_bucket_view) the slot itself."""
        if self.gradient_as_bucket_view and divisor != 1:
            bucket.buffer().div_(divisor)  # p.grad is the slot: divide in place, one pass over the bucket
        for pos, (p, index) in enumerate(zip(bucket.parameters(), bucket.param_indices)):
            if globally_used is not None and not globally_used[index]:
                continue  # no rank used it: leave p.grad untouched (None), as PyTorch does
            view = bucket.view(pos)
            if self.gradient_as_bucket_view:
                if p.grad is None:
                    p.grad = view  # unused here but used elsewhere: the average arrives only through the bucket
            elif p.grad is None:
                p.grad = view / divisor if divisor != 1 else view.clone()
            elif divisor != 1:
                torch.div(view, divisor, out=p.grad)  # SUM ÷ world size, written straight into p.grad
            else:
                p.grad.copy_(view)

    def _globally_used_flags(self) -> list[bool] | None:
        """Which parameters some rank used (only those get a gradient); ``None`` when all are, by construction."""
        if self._static_used_flags is not None:
            return self._static_used_flags  # static graph: the first iteration's answer holds for every iteration
        if not (self.find_unused_parameters or self.static_graph):
            return None
        used = torch.ones(len(self._params), dtype=torch.int32, device=self.device)
        used[self._locally_unused] = 0  # not reached by this forward and no gradient accumulated under no_sync()
        if not self.skip_all_reduce_unused_params:
            # One tiny extra all-reduce, as in PyTorch. int32 rather than bool: NCCL and gloo both SUM int32.
            dist.all_reduce(used, op=dist.ReduceOp.SUM, group=self.process_group)
        return used.bool().tolist()

    def _record_stats(self, waits: list) -> None:
        clock, launches, dones = self._clock, self._launch_times, self._done_times

        def timings() -> tuple[list[float], float, float]:
            seconds = [clock.seconds(start, end) for start, end in zip(launches, dones)]
            waited = sum(clock.seconds(start, end) for start, end in waits)
            # Buckets launch in index order, so bucket 0's launch is the first.
            span = max(clock.seconds(launches[0], end) for end in dones)
            return seconds, waited, span

        self.stats._record(list(self.bucket_sizes), timings)
        if not clock.cuda:
            self.stats._resolve()  # host clocks are final already

    def _learn_static_graph(self, globally_used: list[bool] | None) -> None:
        """End of the first iteration under static_graph: keep what it found, rebuild buckets in arrival order."""
        self._static_unused = list(self._unused)
        self._static_used_flags = globally_used if globally_used is not None else [True] * len(self._params)
        # Every rank must bucket identically (collectives match by call order): rank 0's order is the order.
        order = torch.tensor(self._arrival_order, dtype=torch.int64, device=self.device)
        dist.broadcast(order, src=self._src_rank, group=self.process_group)
        order_list = order.tolist()
        if order_list == [i for b in self._buckets for i in b.param_indices]:
            return  # gradients arrived in bucket order already
        self._buckets, self._slot = self._build_buckets(order_list)
        self._bucket_sizes = [b.nbytes for b in self._buckets]
        if self.gradient_as_bucket_view:
            with torch.no_grad():
                for index, p in enumerate(self._params):
                    if p.grad is not None:  # a slot of the old buckets: move it into the new ones
                        bucket_index, pos = self._slot[index]
                        view = self._buckets[bucket_index].view(pos)
                        view.copy_(p.grad)
                        p.grad = view


def _refuse_not_implemented(arguments: dict) -> None:
    for name, default in _NOT_IMPLEMENTED.items():
        if arguments[name] is not default and arguments[name] != default:
            raise NotImplementedError(
                f"DistributedDataParallel({name}=...) is not implemented by app.parallel.ddp; leave it at "
                f"{default!r} or use torch.nn.parallel.DistributedDataParallel"
            )


def _buffer_sync_flags(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(sync buffers before each forward, broadcast buffers at construction), by PyTorch 2.13's rules."""
    if broadcast_buffers is not None:
        ignored = "; its value is ignored: `forward_sync_buffers` is given" if forward_sync_buffers is not None else ""
        warnings.warn(
            "`broadcast_buffers` is deprecated (as in PyTorch 2.13): use `forward_sync_buffers`"
            + ignored
            + ". Unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init.",
            FutureWarning,
            stacklevel=3,
        )
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = broadcast_buffers if broadcast_buffers is not None else True
    return effective, effective


def _tensors_in(output) -> list[torch.Tensor]:
    """Every tensor inside a (possibly nested) forward output."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors_in(item)]
    return []
