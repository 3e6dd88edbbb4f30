"""Pipeline parallelism across ranks on PyTorch's engine (``torch.distributed.pipelining``): one stage per rank.

Model parallelism (``app.parallel.model_parallel``) leaves all but one device idle at any moment. A pipeline cuts
the batch into M *micro-batches* and streams them through the S stages, so stage 1 works on micro-batch 0 while
stage 0 already works on micro-batch 1. What is left idle is the *bubble*: the fill and drain at the ends of each
step. With equal stages, GPipe (all forwards, then all backwards) idles each stage for a share

    bubble = (S - 1) / (M + S - 1)

of the step. 1F1B (one forward, one backward, in steady state) has the same bubble but holds at most S
micro-batches' activations instead of M, which is why it is the default of large trainings.

    runner = build_pipeline_stage(model, stage_index=rank, num_stages=world, n_microbatches=4, schedule="1f1b")
    optimizer = torch.optim.SGD(runner.module.parameters(), lr=0.1)   # this stage's parameters only
    result = runner.forward_backward(x, y)   # x used on the first stage, y on the last; result.loss on every stage
    optimizer.step(); optimizer.zero_grad()

The send/recv of activations and gradients, the shape inference and the schedules' orders are PyTorch's
(``PipelineStage``, ``ScheduleGPipe``, ``Schedule1F1B``); the loop that steps them is ``schedule.OverlappedSchedule``
(every receive posted ahead, sends waited at the end of the step; ``overlap=False``: PyTorch's loop); this file
splits the model (``split_model``, shared with model parallelism, or
at named modules of any model that is a sequence of its children: ``split.py``),
measures each step (compute vs blocked time, bytes sent) and adds data parallelism across pipeline replicas with
this project's DDP wrapper over a sub-group (``build_pipeline_groups``).

[Note: a pipeline under autocast] With a ``recipe`` (``app.parallel.accum.StepRecipe``), every stage's forward and
the loss run under ``torch.autocast``; the parameters stay fp32, the master weights each stage's optimizer steps. An
activation crosses to the next stage in the dtype it comes out in (bf16 after a Linear, fp32 after an op autocast
keeps in fp32) and its gradient comes back in that dtype: PyTorch sizes the receive buffers from one forward run
under the same autocast (``TimedStage._compute_outputs``). Not cast to fp32 for the wire: that doubles the bytes,
and the next stage would hand its first op an fp32 tensor where one process hands it the bf16 one (an op that
promotes, an add with an fp32 tensor, rounds otherwise), so the pipeline would no longer be one process's forward
cut in pieces. fp16 adds a ``ShardedGradScaler``: the loss is scaled before the schedule backwards it, and
``optimizer_step`` unscales, all-reduces one found-inf flag over the world (every stage skips the same step, every
scale halves alike), clips and steps. bf16 has fp32's range: no scaler.

Every rank builds the whole model from the same seed and keeps its slice: the stages start as the slices of one
model, which is what makes a pipeline comparable with single-process training. (A model too big for one host would
be built on the ``meta`` device and materialised per stage instead.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from app.diagnostics import collectives as recorded
from app.parallel.accum import StepRecipe
from app.parallel.ddp import DistributedDataParallel
from app.parallel.model_parallel import merge_stage_state_dicts, sequential_of, split_model
from app.parallel.pipeline.schedule import OverlappedSchedule
from app.parallel.pipeline.split import SequenceStage, model_sequence, stage_ranges

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def theoretical_bubble(num_stages: int, n_microbatches: int) -> float:
    """GPipe's (and 1F1B's) idle share per stage with equal stages and free communication: (S−1)/(M+S−1)."""
    return (num_stages - 1) / (n_microbatches + num_stages - 1)


class PipelineStepResult(NamedTuple):
    """What one pipeline forward+backward (``PipelineRunner.forward_backward``) measured on this rank: the fields
    of the ``ddp_pipeline_*`` metrics. The pipeline's counterpart of ``app.parallel.accum.StepResult``.

    loss: mean of the micro-batch losses, i.e. the loss of the whole batch (from the last stage, on every stage)
    compute_seconds: this stage's forward + backward + loss time
    send_recv_seconds: the rest of the step: blocked waiting for activations/gradients (and their sends)
    bubble_ratio: send_recv_seconds / step wall time, the measured idle share
    activation_bytes: bytes of activations (forward) and gradients (backward) this stage sent to its neighbours
    phases: where the step's wall time went, in seconds: compute, recv_wait (blocked until a neighbour's tensor
        arrived), send (handing tensors to gloo), send_drain (the step's sends completing at its end), loss_share
        (the loss broadcast that ends the step), overhead (the rest: the schedule's Python). With PyTorch's own
        loop (``overlap=False``) the waits inside it cannot be told apart: recv_wait holds them all, send is 0.
    """

    loss: float
    compute_seconds: float
    send_recv_seconds: float
    bubble_ratio: float
    activation_bytes: int
    phases: dict | None = None


class TimedStage(PipelineStage):
    """PyTorch's ``PipelineStage``, timing its compute, counting the bytes it sends, and driving our DDP wrapper.

    Everything a schedule does outside ``forward_one_chunk``/``backward_one_chunk`` (and the loss) is waiting on a
    neighbour or handing it a tensor: that is what the bubble is made of on this stage.
    """

    def __init__(self, *args, recipe: StepRecipe | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.recipe = recipe or StepRecipe()
        self.compute_seconds = 0.0
        self.sent_bytes = 0
        # Flight recorder entries of receives not yet waited for, by (what, chunk): ended when that chunk computes.
        self._receiving: dict[tuple[str, int], list] = {}
        self._sending: list = []  # and of sends (waited for by the end of the schedule's step: sends_done)

    def _record(self, ops: list[dist.P2POp], what: str, chunk: int) -> list[dist.P2POp]:
        for op in ops:
            recv = op.op in (dist.irecv, dist.recv)
            source = f"pipeline stage {self.stage_index} {what} chunk {chunk}"
            entry = recorded.start("recv" if recv else "send", op.group, op.tensor, source, peer=op.peer)
            if recv:
                self._receiving.setdefault((what, chunk), []).append(entry)
            else:
                self._sending.append(entry)
        return ops

    def _received(self, what: str, chunk: int) -> None:
        # A schedule computes a chunk only once it has waited for that chunk's receives; the other receives
        # posted ahead (OverlappedSchedule) stay open in the recorder until their own chunk is computed.
        for entry in self._receiving.pop((what, chunk), []):
            recorded.end(entry)

    def sends_done(self) -> None:
        for entry in self._sending:
            recorded.end(entry)
        self._sending = []

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._record(super().get_fwd_recv_ops(fwd_chunk_id), "activations in", fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._record(super().get_bwd_recv_ops(bwd_chunk_id), "gradients in", bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self._received("activations in", fwd_chunk_id)
        return self._computing(super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self._received("gradients in", bwd_chunk_id)
        return self._computing(super().backward_one_chunk, bwd_chunk_id, *args, **kwargs)

    def _computing(self, chunk, *args, **kwargs):
        """Run one chunk's forward or backward, its time counted as compute (what it waited to receive is not)."""
        start = time.perf_counter()
        try:
            return chunk(*args, **kwargs)
        finally:
            self.compute_seconds += time.perf_counter() - start

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.sent_bytes += sum(op.tensor.nelement() * op.tensor.element_size() for op in ops)
        return self._record(ops, "activations out", fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.sent_bytes += sum(op.tensor.nelement() * op.tensor.element_size() for op in ops)
        return self._record(ops, "gradients out", bwd_chunk_id)

    def autocast(self):
        """The recipe's autocast on this stage's device: its forward and the loss run under it, backward does not."""
        return self.recipe.autocast(self.device.type)

    def _compute_outputs(self, *args, module: nn.Module, **kwargs):
        # The forward PyTorch runs once to infer what the stages send each other: under the same autocast as the
        # real forwards, so the receive buffers it sizes have the dtypes the activations really come out in.
        with self.autocast():
            return super()._compute_outputs(*args, module=module, **kwargs)

    def forward_maybe_with_nosync(self, *args, **kwargs):
        with self.autocast():
            if isinstance(self.submod, DistributedDataParallel):
                # Every micro-batch's forward runs without sync; the last backward is armed in
                # backward_maybe_with_nosync, as PyTorch's PipelineStage does for its own DDP.
                with self.submod.no_sync():
                    return self.submod(*args, **kwargs)
            return super().forward_maybe_with_nosync(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if isinstance(self.submod, DistributedDataParallel) and last_backward:
            # Our wrapper decides at forward time whether a backward syncs, but the schedules interleave forwards
            # and backwards of different micro-batches. So, like PyTorch's PipelineStage with
            # reducer.prepare_for_backward, arm the sync right before the last micro-batch's backward: its hooks
            # then all-reduce p.grad, which by then holds the sum over all M micro-batches.
            self.submod.reducer.prepare_for_backward(bwd_kwargs["stage_output"])
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


class PipelineRunner:
    """This rank's stage of a pipeline: its module, PyTorch's stage and schedule, and a measured
    ``forward_backward``.

    Attributes:
        module: this stage's layers (an ``nn.Sequential`` keyed by the model's layer indices, or with a ``split``
            a ``SequenceStage`` holding them under their own names): give its parameters to the optimizer;
            ``state_dict()`` below names them as in the whole model.
        stage_index, num_stages, n_microbatches, schedule_name: as built.
    """

    def __init__(self, module, stage: TimedStage, schedule, prefix: str, group, dp_group, schedule_name: str):
        self.module = module
        self.stage = stage
        self.schedule = schedule
        self.prefix = prefix
        self.group = group
        self.dp_group = dp_group
        self.schedule_name = schedule_name
        self.stage_index = stage.stage_index
        self.num_stages = stage.num_stages
        self.n_microbatches = schedule._n_microbatches
        self._last_stage_rank = dist.get_global_rank(group, self.num_stages - 1) if group is not None else None

    def check_batch(self, batch_size: int) -> None:
        """One-line ``ValueError`` unless ``batch_size`` splits into equal micro-batches."""
        if batch_size % self.n_microbatches:
            raise ValueError(
                f"batch of {batch_size} does not split into {self.n_microbatches} equal micro-batches: make the "
                f"batch a multiple of n_microbatches, or choose n_microbatches dividing {batch_size}"
            )

    def forward_backward(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> PipelineStepResult:
        """One training step's forward and backward through the pipeline (no optimizer step: the caller's).

        Args:
            x: the input batch (read by the first stage only).
            y: the labels (read by the last stage only).

        Unequal micro-batches would make the mean of micro-batch means differ from the batch mean, so a batch that
        does not split evenly is refused. Gradients are divided by M, so they equal the whole batch's.
        """
        for t in (x, y):
            if t is not None:
                self.check_batch(t.shape[0])
        compute0, bytes0 = self.stage.compute_seconds, self.stage.sent_bytes
        scaler = self.stage.recipe.scaler
        if scaler is not None:
            # Only the last stage scales a loss, but every stage's optimizer_step unscales its gradients: a scale
            # made here (GradScaler's lazy start), the same initial value on every stage.
            scaler.scale(torch.zeros((), device=self.stage.device))
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        if self.stage.is_first:
            self.schedule.step(x, return_outputs=False)
        elif self.stage.is_last:
            self.schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        self.stage.sends_done()  # (every schedule waits for its sends before its step returns)
        # The loss broadcast is part of the step: the last stage blocks in it while the others drain their backward.
        # The losses the schedule kept were scaled for backward (fp16): shared unscaled.
        schedule_end = time.perf_counter()
        loss = self._share_loss(losses) / (scaler.get_scale() if scaler is not None else 1.0)
        end = time.perf_counter()
        wall, compute = end - start, self.stage.compute_seconds - compute0
        blocked = max(0.0, wall - compute)
        phases = self._phases(wall, compute, loss_share=end - schedule_end)
        return PipelineStepResult(
            loss, compute, blocked, blocked / wall if wall > 0 else 0.0, self.stage.sent_bytes - bytes0, phases
        )

    def _phases(self, wall: float, compute: float, loss_share: float) -> dict:
        """The step's wall time by phase (``PipelineStepResult.phases``); overhead is what no phase accounts for."""
        if isinstance(self.schedule, OverlappedSchedule):
            p = self.schedule.phases
            waits = {"recv_wait": p.recv_wait, "send": p.send, "send_drain": p.send_drain}
        else:  # PyTorch's loop waits inside itself: all of its non-compute time counts as waiting
            waits = {"recv_wait": max(0.0, wall - compute - loss_share), "send": 0.0, "send_drain": 0.0}
        phases = {"compute": compute, **waits, "loss_share": loss_share}
        phases["overhead"] = max(0.0, wall - sum(phases.values()))
        return phases

    def _share_loss(self, losses: list[torch.Tensor]) -> float:
        # One float from the last stage to the others, so every rank (the worker logs on rank 0) knows the loss.
        value = torch.zeros(1)
        if losses:
            value[0] = torch.stack([loss.detach().float().cpu() for loss in losses]).mean()
        src = self._last_stage_rank if self._last_stage_rank is not None else self.num_stages - 1
        recorded.broadcast(value, "pipeline: the loss", src=src, group=self.group)
        return value.item()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> tuple[float | None, bool]:
        """The recipe's end of a step on this stage's ``optimizer``: unscale (fp16), clip by the whole model's norm,
        step unless some stage found an inf/NaN gradient, update the scale; then the gradients are dropped.
        Returns ``(grad_norm before clipping or None, skipped)``, the same on every rank. Collective: every rank.

        ``ShardedGradScaler.unscale_`` all-reduces its found-inf flag over the world, so one stage's overflow skips
        the step on every stage and every scale halves alike: the stages stay one model with one scale.
        """
        grad_norm, skipped = self.stage.recipe.step(self, optimizer)
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the gradients by their global L2 norm over the whole model, as ``torch.nn.utils.clip_grad_norm_`` does
        in one process; returns the norm before clipping. Collective over the pipeline group: every stage calls it.

        Each stage holds a slice of the gradient, so the squared norms of the slices are summed over the pipeline;
        the replicas' gradients are equal by then (all-reduced in the last backward), so every rank clips alike.
        """
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        local = get_total_norm(grads) if grads else torch.zeros(())
        squared = local.detach().float().pow(2).reshape(1).to(self.stage.device)
        recorded.all_reduce(squared, "pipeline: the gradient's squared norm", group=self.group)
        norm = squared.sqrt()[0]
        clip_grads_with_norm_(self.module.parameters(), max_norm, norm)
        return norm.item()

    def state_dict(self) -> dict:
        """This stage's parameters under the whole model's keys (``net.12.weight``): merge with the other stages'
        by ``merge_stage_state_dicts(..., prefix="")`` or ``merge_state_dicts`` below."""
        return {self.prefix + k: v for k, v in self.module.state_dict().items()}

    def gather_state_dict(self) -> dict | None:
        """The whole model's ``state_dict`` (CPU tensors), merged from every stage of this pipeline, on its first
        stage; ``None`` on the others. Collective over the pipeline group: every stage must call it.

        Example::

            full = runner.gather_state_dict()
            if full is not None:
                torch.save(full, "model.pt")  # loads into the bare model, no pipeline needed
        """
        parts: list = [None] * self.num_stages
        dist.all_gather_object(parts, {k: v.cpu() for k, v in self.state_dict().items()}, group=self.group)
        return merge_state_dicts(parts) if self.stage_index == 0 else None

    def load_state_dict(self, state_dict: dict) -> None:
        """Load this stage's slice from a whole-model ``state_dict`` (merged, or this stage's own ``state_dict()``).

        A state dict that lacks one of this stage's tensors, or holds it in another shape, was saved by another
        model or split: ``ValueError`` with one line, before anything is loaded.
        """
        expected = self.module.state_dict()
        own = {k.removeprefix(self.prefix): v for k, v in state_dict.items() if k.startswith(self.prefix)}
        missing = [k for k in expected if k not in own]
        wrong = [k for k in expected if k in own and own[k].shape != expected[k].shape]
        if missing or wrong:
            key = (missing or wrong)[0]
            raise ValueError(
                f"state_dict does not fit stage {self.stage_index} of {self.num_stages}: {self.prefix}{key} is "
                f"{'missing' if missing else 'another shape'}; it was saved by another model or layout: load the "
                f"merged whole-model state_dict (merge_state_dicts) into the same model"
            )
        self.module.load_state_dict({k: own[k] for k in expected})


def merge_state_dicts(stage_state_dicts: list[dict]) -> dict:
    """One whole-model ``state_dict`` from ``PipelineRunner.state_dict()`` of every stage (any order).

    Example::

        model.load_state_dict(merge_state_dicts(gathered))  # the bare model, no pipeline needed
    """
    return merge_stage_state_dicts(stage_state_dicts, prefix="")


def build_pipeline_groups(num_stages: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, int, int]:
    """Process groups for ``world_size / num_stages`` pipeline replicas of ``num_stages`` stages each.

    Rank r is stage ``r % S`` of replica ``r // S``. The pipeline group joins the stages of one replica (for
    send/recv); the data-parallel group joins one stage's replicas (for the gradient all-reduce). Every rank must
    call this, in the same order: ``new_group`` is collective.

    Returns:
        ``(pipeline_group, dp_group, stage_index, replica_index)``; a group is ``None`` when it would be the
        whole world (pipeline) or a single rank (data parallel).

    Example::

        pp, dp, stage, replica = build_pipeline_groups(2)  # 4 ranks: 2 replicas of a 2-stage pipeline
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if num_stages < 2:
        raise ValueError(f"a pipeline needs >= 2 stages, got {num_stages}: run data parallel (--parallel ddp) instead")
    if world % num_stages:
        raise ValueError(
            f"world size {world} is not a multiple of {num_stages} stages: use {num_stages} x replicas ranks"
        )
    replicas = world // num_stages
    pipeline_group = dp_group = None
    for replica in range(replicas):
        ranks = list(range(replica * num_stages, (replica + 1) * num_stages))
        group = dist.new_group(ranks) if replicas > 1 else None
        if rank in ranks:
            pipeline_group = group
    for stage in range(num_stages):
        ranks = list(range(stage, world, num_stages))
        group = dist.new_group(ranks) if replicas > 1 else None
        if rank in ranks:
            dp_group = group
    return pipeline_group, dp_group, rank % num_stages, rank // num_stages


def build_pipeline_stage(
    model: nn.Module,
    *,
    stage_index: int,
    num_stages: int,
    n_microbatches: int,
    schedule: str = "gpipe",
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.mse_loss,
    balance: str = "params",
    bucket_cap_mb: float = 25.0,
    split: Sequence[str] | None = None,
    recipe: StepRecipe | None = None,
    overlap: bool = True,
) -> PipelineRunner:
    """Build this rank's stage of ``model``, on PyTorch's pipelining engine.

    Args:
        model: the whole model, the same on every rank: an ``nn.Sequential`` or a module with one as ``.net``;
            with ``split``, any model whose forward is its sequence of children (``app.parallel.pipeline.split``).
        stage_index: this rank's stage, 0-based (its rank in ``group``).
        num_stages: stages in the pipeline (>= 2, at most the model's layers; uneven splits allowed).
        n_microbatches: micro-batches per step; the batch must be a multiple of it (1F1B needs >= num_stages).
        schedule: ``"gpipe"`` or ``"1f1b"``.
        device: this stage's device.
        group: the pipeline's process group (``None``: the world, which must then have ``num_stages`` ranks).
        dp_group: if given, this stage's replicas: the stage is wrapped in ``app.parallel.ddp`` over it, and its
            gradients are averaged across the replicas once per step.
        loss_fn: ``loss_fn(output, target)`` with a *mean* reduction (gradients are divided by M).
        balance: ``"params"`` or ``"time"`` (see ``app.parallel.model_parallel.split_model``).
        bucket_cap_mb: the DDP wrapper's bucket size when ``dp_group`` is given.
        split: the names in ``model_sequence(model)`` where stages 2.. begin (``plan_split`` checks and balances
            them); ``None``: ``split_model`` by ``balance``.
        recipe: autocast for every stage's forward and the loss, an fp16 ``ShardedGradScaler`` (one found-inf
            flag over the world) and clipping, as ``optimizer_step`` applies them; None: fp32, no clipping.
        overlap: ``OverlappedSchedule`` (receives posted ahead, sends waited at the end of the step); False:
            PyTorch's ``ScheduleGPipe``/``Schedule1F1B`` loop, the same actions in the same order, kept as the
            baseline ``bench.pipeline_bubble --engines pytorch`` measures against.

    Example::

        runner = build_pipeline_stage(DeepMLP(64, 8), stage_index=rank, num_stages=2, n_microbatches=4)
        result = runner.forward_backward(x, y)  # PipelineStepResult(loss, compute_seconds, send_recv_seconds, ...)
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if num_stages < 2:
        raise ValueError(f"a pipeline needs >= 2 stages, got {num_stages}: run data parallel (--parallel ddp) instead")
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
    if recipe is not None and recipe.scaler is not None and not isinstance(recipe.scaler, ShardedGradScaler):
        raise ValueError(
            "recipe.scaler must be a ShardedGradScaler: each stage holds a slice of the gradient, and every stage must "
            "skip a step whose gradient overflowed on any of them"
        )
    if schedule == "1f1b" and n_microbatches < num_stages:
        raise ValueError(
            f"1f1b needs n_microbatches >= stages ({n_microbatches} < {num_stages}): raise n_microbatches or use gpipe"
        )
    group_size = dist.get_world_size(group)
    if group_size != num_stages:
        raise ValueError(f"the pipeline group has {group_size} ranks for {num_stages} stages: one stage per rank")
    if split is None:
        _, prefix = sequential_of(model)
        module = split_model(model, num_stages, balance)[stage_index].to(device)
    else:  # the stage's modules under their names in the model: its keys need no prefix
        sequence = model_sequence(model)
        first, end = stage_ranges(sequence, num_stages, split)[stage_index]
        module, prefix = SequenceStage(sequence[first:end]).to(device), ""
    submod = module
    if dp_group is not None:
        submod = DistributedDataParallel(module, process_group=dp_group, bucket_cap_mb=bucket_cap_mb)
    stage = TimedStage(submod, stage_index, num_stages, torch.device(device), group=group, recipe=recipe)
    timed_loss = _timed(loss_fn, stage)
    if overlap:
        sched = OverlappedSchedule(stage, n_microbatches, order=schedule, loss_fn=timed_loss, scale_grads=True)
    else:
        sched = SCHEDULES[schedule](stage, n_microbatches=n_microbatches, loss_fn=timed_loss, scale_grads=True)
    return PipelineRunner(module, stage, sched, prefix, group, dp_group, schedule)


def _timed(loss_fn: Callable, stage: TimedStage) -> Callable:
    # The loss is computed by the schedule between the last stage's forward and backward: compute, not waiting.
    # Under the recipe's autocast, as accumulation_step computes it; scaled (fp16), since the schedule backwards it.
    def loss(output, target):
        start = time.perf_counter()
        try:
            with stage.autocast():
                value = loss_fn(output, target)
            return stage.recipe.scale(value)
        finally:
            stage.compute_seconds += time.perf_counter() - start

    return loss
