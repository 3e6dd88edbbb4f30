"""The reducer of our DistributedDataParallel: gradients into buckets, buckets all-reduced while backward runs.

Second of three files (read ``module.py`` first, this next, ``comm_stats.py`` last). ``module.py`` decides *whether* a
backward synchronises; this file does the synchronising, as PyTorch's C++ ``Reducer`` does for its DDP:

1. at construction, parameters are grouped into flat ``GradBucket`` buffers (``buckets.py``), in reverse
   registration order, and one hook per parameter is registered with autograd (``register_post_accumulate_grad_hook``);
2. ``prepare_for_backward(outputs)`` arms the next backward: its hooks copy each gradient, divided by the world
   size, into its bucket slot, and a full bucket is all-reduced (SUM) asynchronously while backward goes on;
3. at the end of that backward (an autograd callback) every bucket is waited for and its averages are copied into
   ``p.grad``, except where ``p.grad`` is its slot of the bucket already: a large gradient whose ``p.grad`` was
   None (nobody else holding the bucket) is handed its slot by its hook, which skips a pass (``_plan_lending``).

The hooks run once per parameter per step, on backward's critical path, so they do as little Python as possible:
everything that can be computed once (views, slots, divisors) is, small gradients go into their bucket together
(two calls per bucket, ``_copy_grouped``), and the copy back is one call per bucket.
Unused parameters and ``static_graph`` (below), ``gradient_as_bucket_view`` and sparse gradients
(``sparse.py``) are handled here too; ``no_sync()`` is not: a backward that was not prepared leaves ``p.grad``
alone. Compressed buckets (a comm hook with a ``wire_dtype``, ``comm_hooks.py``) hold the gradients cast, not divided.

**Unused parameters.** A bucket launches once every one of its parameters is ready, so a parameter whose hook never
fires would hold its bucket, and every rank with it, forever. The reducer learns which parameters those are
in one of two ways:

- ``find_unused_parameters``: before each backward, by walking the autograd graph from forward's outputs
  (``graph_walk.py``); they are marked ready at the first hook;
- ``static_graph``: once, in the first iteration, from the hooks themselves, as PyTorch's does. That iteration
  reduces nothing while backward runs: at its end the parameters whose hook never fired are the unused ones, every
  bucket fills and launches, and later iterations reuse the set and the order the gradients arrived in. No graph
  walk: a reentrant ``torch.utils.checkpoint`` recomputes its part of the graph during backward, out of a walk's
  reach, and its parameters' hooks fire all the same.

Then one small all-reduce of used flags tells every rank which parameters no rank used (their ``p.grad`` stays
None, as in PyTorch).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from app.diagnostics import collectives as recorded
from app.parallel.ddp.buckets import GradBucket, assign_buckets
from app.parallel.ddp.comm_hooks import Exchange
from app.parallel.ddp.comm_stats import BackwardTimes, Clock, CommStats
from app.parallel.ddp.graph_walk import unused_parameters
from app.parallel.ddp.sparse import SparseGradients

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]
# Gradients up to this many elements are copied into their bucket in one grouped call (see Reducer._grouped):
# 64 Ki elements, 256 KiB in fp32, still in cache for the copy after the hook that saw them.
GROUP_NUMEL = 64 * 1024


class Reducer:
    """Buckets, hooks and the all-reduce of one wrapped module's gradients (PyTorch's ``Reducer``, in Python).

    ``DistributedDataParallel`` builds one and calls ``prepare_for_backward(outputs)`` after each synchronising
    forward. Everything else happens inside autograd: hooks as gradients arrive, a callback when backward ends.

    Attributes:
        expect_autograd_hooks: whether the next backward synchronises. ``prepare_for_backward`` sets it, the end of
            that backward clears it; while it is ``False`` the hooks return at once and gradients accumulate
            locally in ``p.grad`` (that is all ``no_sync()`` needs). PyTorch's Reducer calls it the same.
        stats: a ``CommStats``, updated at the end of every synchronised backward.
    """

    def __init__(self, params: list[nn.Parameter], param_names: dict[int, str], process_group, **options):
        self._params = params
        self._param_names = param_names
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self._divisor = self.world_size  # of every gradient: the world size (join(): perhaps the ranks still training)
        # Global rank of the group's rank 0: broadcast takes a global rank even inside a subgroup.
        self._src_rank = dist.get_global_rank(process_group, 0)
        self.device = (params or options["sparse_params"])[0].device
        self.first_bucket_cap_bytes: int = options["first_bucket_cap_bytes"]
        self.bucket_cap_bytes: int = options["bucket_cap_bytes"]
        self.find_unused_parameters: bool = options["find_unused_parameters"]
        self.gradient_as_bucket_view: bool = options["gradient_as_bucket_view"]
        self.static_graph: bool = options["static_graph"]
        self.skip_all_reduce_unused_params: bool = options["skip_all_reduce_unused_params"]
        self.batched_grad_copy: bool = options.get("batched_grad_copy", False)  # one _foreach_copy_ (_grouped)
        self.stats = CommStats()
        self._clock = Clock(self.device)
        self._comm_hook: CommHook | None = None  # None: the built-in all-reduce (see _launch_ready_buckets)
        self._comm_state: Any = process_group
        # The built-in all-reduce SUMs, so each gradient is multiplied by 1 / world size in its copy into the bucket,
        # as PyTorch's Reducer does (by each bucket's 0-dim ``scale``: a Python number would be wrapped into a tensor
        # on every call, costing as much as the copy of a small gradient). False: no scaling (a comm hook averages).
        self._divides = True
        self._wire_dtype: torch.dtype | None = None  # a compressed bucket's dtype, if the comm hook asks for one
        self._buckets, self._slot = self._build_buckets(list(reversed(range(len(self._params)))))
        self._sparse = SparseGradients(options.get("sparse_params", []), process_group, param_names)  # no bucket

        self._static_unused: list[int] | None = None  # these two: what static_graph's first iteration learns
        self._static_used_flags: list[bool] | None = None
        self.expect_autograd_hooks = False  # the rest of the per-backward state is set by prepare_for_backward

        # One hook per parameter (once p.grad is accumulated), holding us weakly: a cycle through it kept the group
        # and futures until shutdown, where freeing them aborted 1 finished run in 4. (Sparse: only ends backward.)
        hooked = [*enumerate(params), *((None, p) for p in self._sparse.params)]
        hooks = [p.register_post_accumulate_grad_hook(_grad_hook(weakref.ref(self), i)) for i, p in hooked]
        weakref.finalize(self, lambda: [h.remove() for h in hooks])

    def _build_buckets(self, order: list[int]) -> tuple[list[GradBucket], list[tuple[GradBucket, int]]]:
        groups = assign_buckets(self._params, order, self.first_bucket_cap_bytes, self.bucket_cap_bytes)
        # A compressed bucket cannot hold p.grad itself (another dtype): with gradient_as_bucket_view the hook
        # compresses a full-precision bucket instead.
        dtype = None if self.gradient_as_bucket_view else self._wire_dtype
        buckets = [
            GradBucket(i, [self._params[j] for j in g], g, is_last=(i == len(groups) - 1), wire_dtype=dtype)
            for i, g in enumerate(groups)
        ]
        slot: list = [None] * len(self._params)  # parameter index -> (its bucket, its slot, grouped)
        for b in buckets:
            # In the gradients' dtype: a float64 one gives the same bits but a kernel 1.5x slower on small gradients.
            b.scale = torch.tensor(1.0 / self._divisor, dtype=b.params[0].dtype)
            # PyTorch's batched_grad_copy: copy all, then divide the buffer (a compressed one keeps its fused cast).
            b.batched = self.batched_grad_copy and not b.compressed and not self.gradient_as_bucket_view
            self._fill_slots(b, slot)
        # Full-precision bytes (what the stats and logs report, compressed or not).
        self._bucket_sizes = [sum(p.numel() * p.element_size() for p in b.params) for b in buckets]
        return buckets, slot

    def _fill_slots(self, bucket: GradBucket, slot: list) -> None:
        """Each slot and whether it is grouped; then the grouped slots' memory in as few runs as it takes, and the
        slots that may become p.grad (_plan_lending: large, laid out as their view, unlike channels_last)."""
        spans: list[list[int]] = []
        lending = not (bucket.compressed or self.gradient_as_bucket_view)
        bucket.lendable = []
        for k, (index, view, start) in enumerate(zip(bucket.param_indices, bucket.views, bucket.offsets)):
            grouped = self._grouped(bucket, view)
            slot[index] = (bucket, view, grouped)
            if grouped and spans and spans[-1][1] == start:
                spans[-1][1] += view.numel()
            elif grouped:
                spans.append([start, start + view.numel()])
            elif lending and bucket.params[k].is_contiguous():
                bucket.lendable.append(k)
        bucket.grouped_spans = [bucket.buffer()[start:end] for start, end in spans]

    def _grouped(self, bucket: GradBucket, view: torch.Tensor) -> bool:
        """Whether this slot's gradient waits for its bucket to fill and is copied with the others (_copy_grouped).

        A small gradient's copy costs less than its op's dispatch from Python, so the hooks leave the small ones
        (up to GROUP_NUMEL elements) to one grouped copy per bucket: 2 calls, not dozens. Large ones are copied as
        they come, while still in cache (a second pass costs more than a call saves). batched_grad_copy groups all.
        """
        if self.gradient_as_bucket_view:  # the slot becomes p.grad itself: nothing to copy after the first step
            return False
        return bucket.batched or view.numel() <= GROUP_NUMEL

    # -- What the wrapper (and a pipeline stage) call ------------------------------------------------------------------
    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes per bucket, in launch order (for logs, metrics and tests)."""
        return self._bucket_sizes

    @property
    def buckets(self) -> tuple[GradBucket, ...]:
        """The current buckets, in launch order (read-only: static_graph may rebuild them after iteration 1)."""
        return tuple(self._buckets)

    @property
    def has_comm_hook(self) -> bool:
        return self._comm_hook is not None

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        if self._comm_hook is not None:
            # As PyTorch: swapping reductions between steps would silently mix two averaging schemes.
            raise RuntimeError("register_comm_hook can be called only once, before training")
        self._comm_hook, self._comm_state = hook, state
        # A hook with a wire_dtype gets buckets cast in the copies into and out of them (two passes fewer); others
        # full precision, as PyTorch's. The hook divides (a cast fused with the division: a kernel 1.5x slower).
        self._divides = False
        self._wire_dtype = getattr(hook, "wire_dtype", None)
        if self._wire_dtype is not None and not self.gradient_as_bucket_view:
            self._buckets, self._slot = self._build_buckets([i for b in self._buckets for i in b.param_indices])

    def set_divisor(self, n: int) -> None:
        """Divide gradients by ``n`` from the next backward on (``join.py``: the ranks still training)."""
        self._divisor = self._sparse.divisor = n
        for b in self._buckets:
            b.scale.fill_(1.0 / n)

    def prepare_for_backward(self, outputs) -> None:
        """Arm the next backward to synchronise: called after a synchronising forward, or by a pipeline stage
        before its last micro-batch's backward. ``outputs`` (any nesting of tensors) is what that backward starts
        from: with ``find_unused_parameters`` (and no ``static_graph``) its graph is walked."""
        n = len(self._buckets)
        self.expect_autograd_hooks = True
        self._pending = [len(b.param_indices) for b in self._buckets]  # per bucket: parameters not yet ready
        self._ready = [False] * len(self._params)  # per parameter: gradient already copied into its bucket
        self._next_bucket = 0  # buckets are launched strictly in index order (see _launch_ready_buckets)
        self._futures: list[torch.futures.Future | None] = [None] * n
        self._flights: list[list | None] = [None] * n  # the flight recorder's entry of each bucket's collective
        self._times = BackwardTimes(self._clock, n)
        self._callback_queued = False
        self._arrival_order: list[int] = []
        self._grouped_grads: list[list] = [[] for _ in range(n)]  # per bucket: (slot, gradient) of grouped copies
        self._locally_unused: list[int] = []  # unused (below) and no gradient accumulated under no_sync()
        self._plan_lending()  # (after the line above: the last backward's futures no longer hold any tensor)
        # Not reached by this forward's graph (find_unused_parameters); static graph: the set its first iteration's
        # hooks told (_mark_learned), as PyTorch's, without a walk (blind to a reentrant checkpoint's inner graph).
        self._learning = self.static_graph and self._static_unused is None
        walk = self.find_unused_parameters and not self.static_graph
        self._unused = unused_parameters(outputs, self._params) if walk else (self._static_unused or [])

    # -- During backward: hooks (_grad_hook, below the class), launches -----------------------------------------------
    def _first_hook(self) -> None:
        """First hook of this backward: ask autograd to call us once the whole backward pass is done."""
        self._callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)  # as PyTorch's, from C++
        # Parameters the forward never reached are ready now, as in PyTorch, so their buckets complete. Their slot
        # gets p.grad: zeros, or what earlier micro-batches accumulated under no_sync() (still to be averaged).
        self._locally_unused = [i for i in self._unused if self._params[i].grad is None]
        for unused in self._unused:
            self._mark_ready(unused)

    def _mark_ready(self, index: int) -> None:
        if self._ready[index]:
            # One hook call per parameter per backward, even if used twice; a second means the graph walk called it
            # unused, yet backward reached it: the loss used it outside forward's output.
            raise RuntimeError(
                f"parameter {self._param_names[id(self._params[index])]!r} got a gradient although "
                f"forward's output does not depend on it (find_unused_parameters marked it unused): "
                f"the loss uses it outside forward; route every use through forward"
            )
        self._ready[index] = True
        bucket, view, grouped = self._slot[index]
        param = self._params[index]
        grad = param.grad
        # (Autograd runs hooks with grad mode off, and the buffer is no leaf of any graph: plain ops suffice.)
        if grad is None:
            view.zero_()
        elif grouped:  # (never lent: such a slot is never p.grad)
            self._grouped_grads[bucket.position].append((view, grad))  # copied with the rest of its group, below
        elif grad.data_ptr() == view.data_ptr():
            # p.grad is its slot (gradient_as_bucket_view, or lent by an earlier backward and kept since by
            # zero_grad(set_to_none=False) or no_sync()): autograd accumulated straight into the bucket.
            if self._divides:
                view.mul_(bucket.scale)  # scale it in place, while it is still in cache
        else:
            if self._divides:
                torch.mul(grad, bucket.scale, out=view)  # copy, scale and (wire_dtype) cast: one pass
            else:
                view.copy_(grad)
            if self.gradient_as_bucket_view:
                # From now on p.grad *is* the bucket slot: the separate gradient tensor is freed, and while p.grad
                # is kept (zero_grad(set_to_none=False), no_sync()), autograd accumulates straight into the bucket.
                param.grad = view
            elif self._lend[index]:
                # Lent (see _plan_lending): freed now, the tensor autograd made lends its memory, still in cache,
                # to the next gradient backward computes.
                param.grad = view.detach()
        self._pending[bucket.position] -= 1
        if self._pending[bucket.position] == 0:
            if self._grouped_grads[bucket.position]:
                self._copy_grouped(bucket)
            self._launch_ready_buckets()

    def _copy_grouped(self, bucket: GradBucket) -> None:
        """A full bucket's grouped gradients into their slots, in two calls whatever their number."""
        views, grads = map(list, zip(*self._grouped_grads[bucket.position]))
        self._grouped_grads[bucket.position] = []  # the gradients may be freed once backward no longer holds them
        if bucket.batched:
            torch._foreach_copy_(views, grads)  # PyTorch's batched_grad_copy: a copy, then divide the buffer
            if self._divides:
                bucket.buffer().div_(self._divisor)  # (slots of missing gradients are zeros)
        elif self._divides:
            # Copied, then scaled in place where they lie: the same bits as torch.mul into the slot, and no
            # temporary per gradient (a _foreach_mul would allocate one each; for small ones that is the cost).
            torch._foreach_copy_(views, grads)
            torch._foreach_mul_(bucket.grouped_spans, bucket.scale)
        else:
            torch._foreach_copy_(views, grads)

    def _launch_ready_buckets(self) -> None:
        """Launch every full bucket, in index order: collectives are matched by call order on every rank, so all
        ranks must launch bucket 0, then 1, ...; a full bucket waits for its predecessors."""
        while self._next_bucket < len(self._buckets) and self._pending[self._next_bucket] == 0:
            i = self._next_bucket
            bucket = self._buckets[i]
            self._times.launches[i] = self._clock.now()
            unused = self._locally_unused
            if self.skip_all_reduce_unused_params and unused and set(bucket.param_indices) <= set(unused):
                # Only unused parameters, on every rank by the caller's promise: nothing to reduce.
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
            elif self._comm_hook is None:
                # Built-in path: all-reduce with SUM, in place (each slot was divided by the world size already).
                work = recorded.all_reduce(bucket.buffer(), f"DDP bucket {i}", group=self.process_group, async_op=True)
                fut, self._flights[i] = work.get_future(), work.entry
            else:
                self._flights[i] = recorded.start("comm_hook", self.process_group, bucket.buffer(), f"DDP bucket {i}")
                fut = self._comm_hook(self._comm_state, bucket)  # the hook averages, as with PyTorch's DDP

            def record_done(f: torch.futures.Future, i=i, times=self._times, clock=self._clock) -> None:
                # Runs when the reduction completes (gloo: on its thread; CUDA: on a stream synchronised with the
                # collective): launch -> done is the latency the metrics report, whenever backward gets to waiting.
                if times.dones[i] is None:  # (unless _finalize_backward's wait returned first)
                    times.dones[i] = clock.now()

            # Held here, fut frees record_done on this thread, not on gloo's at shutdown (an abort: see __init__).
            if not isinstance(fut, Exchange):  # (an Exchange is finished, and timed, by its wait())
                fut.then(record_done)
            self._futures[i] = fut
            self._next_bucket += 1

    # -- End of backward: wait, write p.grad ---------------------------------------------------------------------------
    def _finalize_backward(self) -> None:
        """Called by autograd after the last gradient of this backward: wait, then write averages to ``p.grad``."""
        self.expect_autograd_hooks = False
        if self._learning:
            self._mark_learned()  # static_graph's first iteration: every bucket fills and launches now
        if self._next_bucket < len(self._buckets):
            missing = [self._param_names[id(p)] for p, ready in zip(self._params, self._ready) if not ready]
            raise RuntimeError(
                f"parameters that received no gradient in this backward: {', '.join(missing)}; every rank would "
                f"wait forever for their buckets. Pass find_unused_parameters=True to DistributedDataParallel if "
                f"forward skips them on purpose, or make sure the loss depends on them"
            )
        globally_used = self._globally_used_flags()
        with torch.no_grad():
            for i, (bucket, fut) in enumerate(zip(self._buckets, self._futures)):
                # Bucket by bucket: writing out i overlaps reducing i+1. Only waiting is exposed communication.
                before = self._clock.now()
                averaged = fut.wait()
                recorded.end(self._flights[i])
                averaged = averaged[0] if isinstance(averaged, list) else averaged  # all_reduce's future: a list
                self._times.waits.append((before, self._clock.now()))
                if self._times.dones[i] is None:
                    self._times.dones[i] = self._times.waits[-1][1]
                if averaged.data_ptr() != bucket.buffer().data_ptr():
                    bucket.buffer().copy_(averaged)  # hooks may return a new tensor rather than the buffer
                self._write_back(bucket, globally_used)
        self._sparse.reduce()  # (after the buckets, in the same order on every rank)
        self.stats.record(list(self._bucket_sizes), self._times)
        if self._learning:
            self._learn_static_graph(globally_used)

    def shadow_backward(self) -> None:
        """The collectives of one synchronised backward, in its order, contributing zeros: what a rank that ran out of
        inputs issues while the others train (``join.py``)."""
        g, zeros = self.process_group, [torch.zeros_like(b.buffer()) for b in self._buckets]
        for work in [recorded.all_reduce(z, f"DDP bucket {i}", group=g, async_op=True) for i, z in enumerate(zeros)]:
            work.wait()
        self._locally_unused = list(range(len(self._params)))
        self._globally_used_flags()  # its all-reduce, where a backward has one, with every flag 0
        self._sparse.shadow()

    def _plan_lending(self) -> None:
        """Before a synchronised backward: which gradients get their bucket slot as ``p.grad``, not a copy.

        PyTorch's DDP copies every average back into ``p.grad``, one more pass; ours skips it where nobody can tell:
        a large gradient whose ``p.grad`` is None now (``zero_grad()``'s default) is handed its slot once copied into
        it, as with ``gradient_as_bucket_view``, if no tensor outside ours shares the bucket (a ``p.grad`` kept from
        the last step must not change: the bucket moves first). Small or ``no_sync()`` ones are copied back.
        """
        self._lend = [False] * len(self._params)
        for b in self._buckets:
            grads = [b.params[k].grad for k in b.lendable]
            kept = [g is not None and g.data_ptr() == b.views[k].data_ptr() for g, k in zip(grads, b.lendable)]
            if b.lendable and b.shared_elsewhere(lent=sum(kept)):
                b.renew()
                self._fill_slots(b, self._slot)
            for g, k in zip(grads, b.lendable):
                self._lend[b.param_indices[k]] = g is None

    def _write_back(self, bucket: GradBucket, globally_used: list[bool] | None) -> None:
        """Make ``p.grad`` hold the bucket's averages: copied, in one call per bucket, into every ``p.grad`` that is
        not its slot already (gradient_as_bucket_view, a slot lent in this backward or kept since)."""
        params, views = bucket.params, bucket.views
        if globally_used is None and not bucket.lendable:  # every parameter used, none can be its slot
            if not self.gradient_as_bucket_view:  # (with it, every p.grad is its slot already)
                torch._foreach_copy_([p.grad for p in params], views)  # one call (and cast) for the whole bucket
            return
        copy_to, copy_from = [], []
        for p, view, index in zip(params, views, bucket.param_indices):
            if globally_used is not None and not globally_used[index]:
                continue  # no rank used it: leave p.grad untouched (None), as PyTorch does
            if p.grad is None:  # unused here but used elsewhere: the average arrives only through the bucket
                if self.gradient_as_bucket_view:
                    p.grad = view
                elif self._lend[index]:
                    p.grad = view.detach()
                else:
                    p.grad = view.to(p.dtype, copy=True)  # (a compressed slot: cast back)
            elif p.grad.data_ptr() != view.data_ptr():
                copy_to.append(p.grad)
                copy_from.append(view)
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)

    # Unused parameters and static_graph (see the module's docstring).

    def _mark_learned(self) -> None:
        """End of static_graph's first backward: what arrived is used, the rest unused; mark all ready, in the
        order they arrived (unused first, as find_unused_parameters marks them), which launches every bucket."""
        arrived = list(dict.fromkeys(self._arrival_order))  # (a reentrant checkpoint may fire a hook twice)
        seen = set(arrived)
        self._unused = [i for i in range(len(self._params)) if i not in seen]
        self._locally_unused = [i for i in self._unused if self._params[i].grad is None]
        self._arrival_order = self._unused + arrived
        for index in self._arrival_order:
            self._mark_ready(index)

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

    def _learn_static_graph(self, globally_used: list[bool] | None) -> None:
        """End of the first iteration under static_graph: keep what it found, rebuild buckets in arrival order."""
        self._static_unused = list(self._unused)
        self._static_used_flags = globally_used if globally_used is not None else [True] * len(self._params)
        # Every rank must bucket identically (collectives match by call order): rank 0's order is the order.
        order = torch.tensor(self._arrival_order, dtype=torch.int64, device=self.device)
        dist.broadcast(order, src=self._src_rank, group=self.process_group)
        if order.tolist() == [i for b in self._buckets for i in b.param_indices]:
            return  # gradients arrived in bucket order already
        self._buckets, self._slot = self._build_buckets(order.tolist())
        if self.gradient_as_bucket_view:
            with torch.no_grad():
                for index, p in enumerate(self._params):
                    if p.grad is not None:  # a slot of the old buckets: move it into the new ones
                        p.grad = self._slot[index][1].copy_(p.grad)


def _grad_hook(reducer: weakref.ref, index: int):
    def hook(param: torch.Tensor) -> None:
        self = reducer()
        if self is None or not self.expect_autograd_hooks:
            return  # inside no_sync(): leave the local gradient to accumulate in p.grad
        if not self._callback_queued:
            self._first_hook()
        if index is None:  # (a sparse gradient: reduced once backward ends, see sparse.py)
            return
        if self._learning:
            self._arrival_order.append(index)  # (the reduction waits for the end of backward: _mark_learned)
        else:
            self._mark_ready(index)

    return hook
