"""DistributedDataParallel from scratch: the lesson's wrapper, grown into a drop-in for PyTorch's.

Three files (and the smaller ones they name: ``buckets.py``, ``unused.py``, ``sparse.py``), read in this order:

- ``module.py`` (this one): the ``nn.Module`` front: PyTorch's constructor, the initial broadcast, ``forward``,
  ``no_sync()``, ``register_comm_hook``, the buffer sync; it decides *whether* a backward synchronises;
- ``reducer.py``: the ``Reducer``: per-parameter hooks filling the buckets of ``buckets.py``, the asynchronous
  all-reduce, the write-back into ``p.grad``, unused parameters, static graph; it does the synchronising (PyTorch's
  C++ ``Reducer``);
- ``comm_stats.py``: the ``Clock`` and the ``CommStats`` the trainer turns into metrics.

The idea fits in four lines:

    1. every rank starts from rank 0's parameters and buffers (one broadcast at construction);
    2. every rank runs forward and backward on its own shard of the batch;
    3. as backward produces each parameter's gradient, a hook copies it, divided by the world size, into a flat
       *bucket*; a full bucket is all-reduced (SUM) *asynchronously*, while backward computes earlier layers';
    4. when backward ends, we wait for the outstanding buckets and put the averages in ``p.grad`` (copied back, or
       for a large gradient its slot handed over when nobody else could tell: ``reducer._plan_lending``).

So ``loss.backward(); optimizer.step()`` works exactly as with ``torch.nn.parallel.DistributedDataParallel``, and
because every rank applies the same averaged gradient to the same parameters, the ranks stay identical.

    hooks (one per parameter)   buckets (reverse order, <= bucket_cap_mb)     async all-reduce        end of backward
    p_n.grad ready ─┐
    p_n-1.grad ready├──► bucket 0 full ──► all_reduce(SUM)       ──► (runs while backward continues) ─┐
    ...             ┘                                                                                  ├─► wait all,
    p_1.grad ready ─┐                                                                                  │   copy into
    p_0.grad ready ─┴──► bucket k full ──► all_reduce(SUM) ───────────────────────────────────────────┘   p.grad

The constructor is PyTorch 2.13's, argument for argument (``DistributedDataParallel(model, device_ids=[rank])``
works by changing the import only); docs/ddp.md maps each argument to what it does here. With
``gradient_as_bucket_view=True`` step 4 always disappears: ``p.grad`` *is* a slice of the bucket. With
``static_graph=True`` the first iteration is studied once (unused parameters, gradients' order) and reused.

Buffers (BatchNorm's running stats) are broadcast from rank 0 exactly when PyTorch's DDP does it: before the first
forward and before each forward that follows a synchronising one (under ``no_sync()``: the first micro-batch's).

Try it: ``make demo`` (4 CPU ranks under torchrun, compared step by step with single-process training).
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable

from app.parallel.ddp.comm_stats import Clock, CommStats
from app.parallel.ddp.join import DDPJoinHook, common_rank, join_context, notify, tell_sync
from app.parallel.ddp.module_sync import broadcast_coalesced, device_of, same_device, to_device
from app.parallel.ddp.reducer import CommHook, GradBucket, Reducer
from app.parallel.ddp.sparse import sparse_gradient_params

__all__ = ["DistributedDataParallel", "GradBucket", "CommStats", "Clock", "Reducer", "CommHook"]

DEFAULT_BUCKET_CAP_MB = 25  # PyTorch's default, used when bucket_cap_mb is None
# With the default bucket size, the first bucket is capped lower, as in PyTorch (dist._DEFAULT_FIRST_BUCKET_BYTES):
# the last layers' gradients arrive first, and a small first bucket starts communication early in backward. An
# explicit bucket_cap_mb applies to every bucket, the first too, as in PyTorch: ask for 25 MB buckets, get them.
FIRST_BUCKET_BYTES = 1024 * 1024

# Arguments of PyTorch's constructor that this wrapper does not implement; None means "not used", and any other
# value is refused: silently ignoring them would change what training computes or how fast.
_NOT_IMPLEMENTED = (
    "delay_all_reduce_named_params param_to_hook_all_reduce mixed_precision device_mesh bucket_cap_mb_list"
)


class DistributedDataParallel(nn.Module, Joinable):
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
        bucket_cap_mb: bucket size in MiB; ``None`` is 25, with a first bucket of 1 MiB (as PyTorch). Bigger buckets:
            fewer all-reduces (less latency paid) but a later start of the first (less overlap with backward).
        find_unused_parameters: walk the autograd graph after each forward and mark parameters it did not reach as
            ready, so their buckets still complete. Costs a graph walk and a small all-reduce per step; needed only
            when forward skips parameters. Without it such a backward raises an error naming them.
        check_reduction: deprecated and ignored, as in PyTorch (a FutureWarning when ``True``).
        gradient_as_bucket_view: ``p.grad`` becomes a view into its bucket after the first synchronised backward:
            the gradient is stored once, and the copy back from the bucket disappears (so does the copy into it
            when ``p.grad`` is kept between steps, e.g. ``zero_grad(set_to_none=False)``).
        static_graph: the used parameters and the order gradients arrive in never change. The first iteration finds
            both; later ones skip the graph walk and used-flags all-reduce, in buckets rebuilt in rank 0's order.
        skip_all_reduce_unused_params: with ``find_unused_parameters`` or ``static_graph``: trust that every rank
            leaves the same parameters unused; skip the used-flags all-reduce and buckets holding only unused
            parameters. Ranks that disagree would hang, as in PyTorch.
        batched_grad_copy: a full bucket takes its gradients in one ``_foreach_copy_`` and one scaling, as PyTorch's
            (two ops per bucket, not one per parameter: for many small parameters; see ``reducer.py``).
        forward_sync_buffers: broadcast rank 0's buffers (BatchNorm running stats) before the first forward and
            each one after a synchronising forward, as PyTorch. ``None``: ``True``. Always at init (``init_sync``).
        delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision, device_mesh,
            bucket_cap_mb_list: not implemented; a non-default value raises
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
        Joinable.__init__(self)  # join(): uneven inputs (join.py)
        self.divide_by_initial_world_size = True
        _refuse_not_implemented(locals())
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs an initialised process group: call "
                "torch.distributed.init_process_group() first (torchrun sets its env:// variables)"
            )
        self.bucket_cap_bytes, self.first_bucket_cap_bytes = _bucket_caps(bucket_cap_mb, dim, check_reduction)
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
        self.batched_grad_copy = batched_grad_copy
        self.bucket_bytes_cap = self.bucket_cap_bytes  # PyTorch's attribute name
        self.require_backward_grad_sync = True  # False inside no_sync()
        # Whether the next forward starts by broadcasting rank 0's buffers (PyTorch's name and rule, see forward).
        self.require_forward_param_sync = True

        trainable, sparse_params = self._collect_parameters(module)
        self.device = trainable[0].device
        self.device_ids, self.output_device = self._check_devices(device_ids, output_device)

        if init_sync:
            self._check_same_model_everywhere()
            # 1. Everyone starts from rank 0's weights: ranks seeded differently would otherwise drift apart forever.
            buffers = self._buffers_to_sync if init_sync_buffers else []
            broadcast_coalesced(
                [p.data for p in module.parameters()] + buffers, src=self._src_rank, group=self.process_group
            )

        # 2. The reducer: buckets in reverse parameter order and one hook per parameter (see reducer.py).
        self.reducer = Reducer(
            self._params,
            self._param_names,
            self.process_group,
            first_bucket_cap_bytes=self.first_bucket_cap_bytes,
            bucket_cap_bytes=self.bucket_cap_bytes,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            batched_grad_copy=batched_grad_copy,
            sparse_params=sparse_params,
        )
        self.stats: CommStats = self.reducer.stats

    # -- Construction helpers ------------------------------------------------------------------------------------------
    def _collect_parameters(self, module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """Set the bucketed parameters, their names and the buffers to sync; return (trainable, sparse) parameters."""
        # module.parameters() yields a tied (shared) parameter once, so it gets one hook and one bucket slot.
        # Frozen parameters get no gradient: they are left out of buckets and hooks alike.
        trainable = [p for p in module.parameters() if p.requires_grad]
        sparse = sparse_gradient_params(module)  # nn.Embedding(sparse=True): reduced apart (sparse.py)
        self._params = [p for p in trainable if id(p) not in sparse]
        self._param_names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
        self._buffers_to_sync = list(module.buffers())
        if not trainable:
            raise ValueError(
                "the module has no parameter that requires a gradient: there is nothing for "
                "DistributedDataParallel to synchronise; run it unwrapped"
            )
        return trainable, [p for p in trainable if id(p) in sparse]

    def _check_devices(self, device_ids, output_device) -> tuple[list[int] | None, int | None]:
        """PyTorch's rules for ``device_ids``/``output_device``, plus: the one device must be the module's."""
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(
                f"device_ids={device_ids}: device_ids can only be None or contain a single element "
                f"(one process per device; start one rank per GPU with torchrun)"
            )
        devices = {p.device for p in self.module.parameters() if p.requires_grad}
        if len({d.type for d in devices}) != 1 or len(devices) > 1:
            raise ValueError(f"the module's parameters are on several devices ({devices}): move it to one device")
        if not device_ids or self.device.type == "cpu":
            if device_ids or output_device:  # PyTorch's truthiness: output_device=0 passes for a CPU module
                raise ValueError(
                    f"device_ids={device_ids}, output_device={output_device}: these work only for a module on one "
                    f"GPU, but the module is on {self.device}; pass neither (DDP(model)) for a CPU module"
                )
            return None, None
        wanted = device_of(device_ids[0])
        if not same_device(wanted, self.device):
            raise ValueError(
                f"device_ids={device_ids}: the module lives on {self.device}; move it first "
                f"(model.to({wanted})) or pass device_ids=[{self.device.index}]"
            )
        out = device_of(output_device if output_device is not None else device_ids[0])
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

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes per bucket, in launch order (for logs, metrics and tests)."""
        return self.reducer.bucket_sizes

    def bucket_layout(self) -> list[list[int]]:
        """Per bucket, in launch order, the indices (into ``parameters()`` that require grad) of its parameters."""
        return [list(b.param_indices) for b in self.reducer.buckets]

    @property
    def broadcast_buffers(self) -> bool:
        """The deprecated name of ``forward_sync_buffers``, as in PyTorch 2.13."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def gradient_bytes(self) -> int:
        """Bytes held by gradients and buckets together, each storage counted once (a view costs nothing)."""
        storages = {b.buffer().untyped_storage().data_ptr(): b.nbytes for b in self.reducer.buckets}
        for p in self._params:
            if p.grad is not None:
                storages[p.grad.untyped_storage().data_ptr()] = p.grad.untyped_storage().nbytes()
        return sum(storages.values())

    # -- Public API (as PyTorch's) -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient synchronisation: gradients accumulate locally in ``p.grad``. The *forward* must run inside
        it, as with PyTorch (it decides); the first backward after leaving it syncs everything accumulated."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the default all-reduce of each bucket by ``hook(state, bucket) -> Future[Tensor]``, resolving to
        the *averaged* gradients (``app.parallel.ddp.comm_hooks``; PyTorch's ``ddp_comm_hooks`` work too)."""
        self.reducer.register_comm_hook(state, hook)

    def _set_static_graph(self) -> None:
        """PyTorch's older way to ask for ``static_graph=True`` after construction (before the first forward)."""
        self.static_graph = True
        self.reducer.static_graph = True

    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        """Train on uneven inputs, as PyTorch's: ``with model.join(): for batch in my_batches: ...`` (``join.py``)."""
        return join_context(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    def join_hook(self, **kwargs) -> DDPJoinHook:
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward starts with the buffer broadcast (a joined rank's hook asks it too)."""
        return self.require_forward_param_sync and self.forward_sync_buffers and bool(self._buffers_to_sync)

    def sync_module_buffers(self, still_training: bool = True) -> None:
        """Broadcast rank 0's buffers in place: each rank's forwards update BatchNorm's stats locally; rank 0's win."""
        self._buffers_to_sync = list(self.module.buffers())  # re-read, as PyTorch: a module may reassign a buffer
        src = self._src_rank
        if self._join_config.enable:  # rank 0 may have joined, with stale buffers: the highest still training wins
            src = dist.get_global_rank(self.process_group, common_rank(self, still_training))
        # Keep the buffers' autograd version counters (as PyTorch): an earlier forward may have saved them for its
        # backward (BatchNorm in eval mode), and a bumped counter would fail that backward.
        with torch.autograd._unsafe_preserve_version_counter(tuple(self._buffers_to_sync)):
            broadcast_coalesced(self._buffers_to_sync, src=src, group=self.process_group)

    def forward(self, *inputs, **kwargs):
        if self.device_ids:
            inputs, kwargs = to_device(inputs, self.device), to_device(kwargs, self.device)
        # This forward decides whether its backward syncs, and whether the *next* forward starts by syncing
        # buffers (only if this one synchronises; no_sync() and no-grad forwards do not), as PyTorch's.
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._join_config.enable:
            notify(self, sync)  # inside join(): the joined ranks match this iteration's collectives
        if self.will_sync_module_buffers():
            self.sync_module_buffers()
        if self._join_config.enable:
            tell_sync(self, sync)
        output = self.module(*inputs, **kwargs)
        self.require_forward_param_sync = sync
        if sync:
            self.reducer.prepare_for_backward(output)  # arms this backward: its hooks will all-reduce
        else:
            self.reducer.expect_autograd_hooks = False  # no_sync() or no grad: the hooks leave p.grad alone
        return output


def _refuse_not_implemented(arguments: dict) -> None:
    for name in _NOT_IMPLEMENTED.split():
        if arguments[name] is not None:
            raise NotImplementedError(
                f"DistributedDataParallel({name}=...) is not implemented by app.parallel.ddp; leave it at "
                f"None or use torch.nn.parallel.DistributedDataParallel"
            )


def _bucket_caps(bucket_cap_mb: float | None, dim: int, check_reduction: bool) -> tuple[int, int]:
    """(bucket cap, first bucket's cap) in bytes, by PyTorch's rules; the arguments it refuses, refused."""
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    if dim != 0:
        raise ValueError(f"dim={dim}: inputs are never scattered (one device per process), so only dim=0 is accepted")
    if check_reduction:
        warnings.warn("check_reduction is deprecated and ignored, as in PyTorch", FutureWarning, stacklevel=3)
    if bucket_cap_mb is None:  # PyTorch's default: 25 MiB, and a small first bucket so the first launch comes early
        return int(DEFAULT_BUCKET_CAP_MB * 1024 * 1024), FIRST_BUCKET_BYTES
    cap = int(bucket_cap_mb * 1024 * 1024)
    return cap, cap


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
    sync = broadcast_buffers is None or bool(broadcast_buffers)  # None: True, as PyTorch
    return sync, sync
