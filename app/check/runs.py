"""The two sides of the comparison: N ranks (``rank_main``, spawned) and one process (``run_reference``).

Both train the same model from the same start on the same samples with the same optimizer. Step ``s`` uses samples
``[s*G, (s+1)*G)`` of the data, ``G = ranks x accum x micro_batch``: rank ``r`` takes its contiguous share of them and
cuts it into ``accum`` micro-batches; the reference takes all ``G`` in one forward. Every loss is a mean over its
samples and the rank's loss is divided by ``accum``, so the ranks' averaged gradient is the gradient of the mean loss
over the ``G`` samples: the reference's, up to float rounding.

``parallel="pipeline"``: the N ranks are the N stages of one pipeline (``app.parallel.pipeline``, the worker's
``parallel=pipeline`` calls: ``build_pipeline_stage``, ``forward_backward``, ``optimizer_step``, the schedule). They
take the same ``G`` samples, streamed through the stages as ``ranks x accum`` micro-batches of ``micro_batch``, so
``--parallel`` changes how the ranks share the work, never the data or the reference. After each step the stages'
state dicts are merged on every rank and recorded as the whole model.

What each side returns is a list of ``StepRecord``: the loss, a digest of each parameter and buffer after the step,
and (rank 0 and the reference) the parameters themselves, so the parent compares without collectives.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim.lr_scheduler import LambdaLR

from app.check.inputs import build_loss
from app.parallel import wrap_model
from app.parallel.accum import StepRecipe, accumulation_step
from app.parallel.checksum import tensors_checksum
from app.parallel.zero import FullyShardedDataParallel, ShardedGradDataParallel, ZeroRedundancyOptimizer
from app.specs import build_model
from app.worker.models import parameter_checksum
from app.worker.recipe import AUTOCAST_DTYPES, lr_factor

KINDS = ("ddp", "zero1", "zero2", "zero3", "pipeline")  # what --parallel chooses; zero2/zero3: our wrappers only


@dataclass
class Recipe:
    """The worker's recipe, on both sides alike: autocast, clipping by the global norm, a warm-up + decay schedule."""

    autocast: str = "none"  # none | bf16 | fp16 (fp16: a GradScaler, sharded for zero2/zero3)
    grad_clip_norm: float = 0.0
    lr_schedule: str = "constant"  # constant | cosine | linear
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0

    def step_recipe(self, sharded_grads: bool, world_size: int = 1) -> StepRecipe:
        """``world_size``: for the reference, ``Setup.backward_weight_ratio``: its loss (a mean over all N x K x
        micro_batch samples) gives each sample that many times less weight than a rank's backward does, so its
        GradScaler starts that many times higher: both sides backward the same fp16 magnitudes and skip the same
        steps (the unscaled gradients are the same). ``sharded_grads``: each rank holds a slice of the gradient
        (zero2, zero3, the pipeline's stages): a ``ShardedGradScaler``, one found-inf flag over the ranks."""
        scaler = None
        if self.autocast == "fp16":
            init_scale = 2.0**16 * world_size  # GradScaler's default initial scale, x N for the reference
            scaler = ShardedGradScaler("cpu", init_scale) if sharded_grads else torch.amp.GradScaler("cpu", init_scale)
        return StepRecipe(AUTOCAST_DTYPES[self.autocast], scaler, self.grad_clip_norm)

    def schedule(self, optimizer: torch.optim.Optimizer, steps: int) -> LambdaLR:
        def factor(step: int) -> float:
            return lr_factor(
                step, schedule=self.lr_schedule, steps=steps, warmup_steps=self.warmup_steps,
                min_lr_ratio=self.min_lr_ratio,
            )  # fmt: skip

        return LambdaLR(optimizer, factor)


@dataclass
class Setup:
    """Everything a rank needs, picklable: specs rather than objects, the data as tensors."""

    model_spec: str
    model_kwargs: dict
    loss_spec: str | None
    loss_kwargs: dict
    inputs: torch.Tensor  # steps x G samples, in the order the steps use them
    targets: torch.Tensor
    initial_state: dict  # the reference's starting state_dict: rank 0 loads it, the others get it by broadcast
    world_size: int
    accum: int
    micro_batch: int
    steps: int
    optimizer: str
    lr: float
    seed: int
    eval_mode: bool
    dtype: str = "float32"  # of the parameters and of floating-point data
    wrapper_kwargs: dict = field(default_factory=dict)
    parallel: str = "ddp"  # ddp | zero1 | zero2 | zero3 | pipeline: how the ranks share the state (KINDS)
    recipe: Recipe = field(default_factory=lambda: Recipe())
    pipeline_split: list[str] = field(default_factory=list)  # where stages 2.. begin (checked before any rank starts)
    pipeline_schedule: str = "gpipe"

    @property
    def global_batch(self) -> int:
        return self.world_size * self.accum * self.micro_batch

    @property
    def pipeline(self) -> bool:
        return self.parallel == "pipeline"

    @property
    def backward_weight_ratio(self) -> int:
        """How many times the weight a sample has in the reference's backward a rank's backward gives it: N for the
        data-parallel kinds (a rank's loss is the mean over its 1/N of the batch), N x K for the pipeline (each
        micro-batch's mean is backwarded whole; the schedule divides the gradients by the micro-batch count after)."""
        return self.world_size * self.accum if self.pipeline else self.world_size


@dataclass
class StepRecord:
    loss: float  # this side's loss: the reference's on all G samples, a rank's on its share
    digest: str  # parameter_checksum's first 12 hex
    param_digests: dict[str, str]
    buffer_digests: dict[str, str]
    params: dict[str, torch.Tensor] | None = None  # kept by rank 0 and the reference only
    buffers: dict[str, torch.Tensor] | None = None  # as params
    shard_losses: list[float] | None = None  # reference only: its loss on each rank's share, before its step
    no_grad: dict[str, int] | None = None  # reference only: parameter -> a rank whose micro-batch left it gradless
    grads: dict[str, torch.Tensor] | None = None  # reference only: the gradient this step applied


def micro_batches(setup: Setup, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s ``accum`` micro-batches of step ``step``; under the pipeline, every rank's are all
    ``ranks x accum`` micro-batches of the step (each stage runs every one)."""
    if setup.pipeline:
        return [pair for r in range(setup.world_size) for pair in _share(setup, step, r)]
    return _share(setup, step, rank)


def _share(setup: Setup, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    start = step * setup.global_batch + rank * setup.accum * setup.micro_batch
    bounds = [start + k * setup.micro_batch for k in range(setup.accum + 1)]
    return [(setup.inputs[a:b], setup.targets[a:b]) for a, b in zip(bounds, bounds[1:])]


def optimizer_class(setup: Setup) -> type[torch.optim.Optimizer]:
    return torch.optim.SGD if setup.optimizer == "sgd" else torch.optim.AdamW


def build_optimizer(setup: Setup, params) -> torch.optim.Optimizer:
    return optimizer_class(setup)(params, lr=setup.lr)


def wrap_kind(setup: Setup, model: nn.Module, wrapper: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model`` wrapped as ``setup.parallel`` shares it over the ranks, and the optimizer that kind steps with."""
    if setup.parallel == "zero2":
        wrapped = ShardedGradDataParallel(model)
        return wrapped, wrapped.build_optimizer(optimizer_class(setup), lr=setup.lr)
    if setup.parallel == "zero3":
        wrapped = FullyShardedDataParallel(model)
        return wrapped, build_optimizer(setup, wrapped.parameters())  # the fp32 shards
    wrapped = wrap_model(model, wrapper, **setup.wrapper_kwargs)
    if setup.parallel == "zero1":
        return wrapped, ZeroRedundancyOptimizer(
            wrapped.parameters(), optimizer_class=optimizer_class(setup), lr=setup.lr
        )
    return wrapped, build_optimizer(setup, wrapped.parameters())


def train_step(model: nn.Module, opt, micro: list, loss_fn, recipe: StepRecipe, schedule: LambdaLR) -> float:
    """One optimizer step over ``micro`` as the worker takes it (``accumulation_step``: no_sync() on all but the
    last micro-batch, each loss weighted by its share, the recipe), then the schedule's step; the mean loss."""
    result = accumulation_step(model, opt, micro, loss_fn, check_finite=False, recipe=recipe)
    schedule.step()
    return result.loss


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _record(model: nn.Module, loss: float, keep: bool, state: dict | None = None, names=None) -> StepRecord:
    """What a side holds after a step. ``state``: the whole model's state dict where ``model`` holds a shard, and
    ``names`` its parameter names, read before the wrapper took the parameters over."""
    if state is None:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        digest = parameter_checksum(model)[:12]
    else:
        params = {n: state[n] for n in names}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # this rank's own: never sharded
        digest = tensors_checksum(params.values())[:12]  # parameter_checksum's hash, of the gathered model
    return StepRecord(
        loss=loss,
        digest=digest,
        param_digests={n: _digest(t) for n, t in params.items()},
        buffer_digests={n: _digest(t) for n, t in buffers.items()},
        params=params if keep else None,
        buffers=buffers if keep else None,
    )


def _gathered_state(wrapped: nn.Module) -> dict | None:
    """ZeRO-3: the whole model's state on every rank (gathered on rank 0, then broadcast: small models only)."""
    if not isinstance(wrapped, FullyShardedDataParallel):
        return None
    box = [wrapped.full_state_dict()]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def fresh_model(setup: Setup, seed: int, load: bool) -> nn.Module:
    """The model as the spec builds it from ``seed``, in ``setup.dtype``; with ``load``, at the reference's start."""
    torch.manual_seed(seed)
    model = build_model(setup.model_spec, setup.model_kwargs).to(getattr(torch, setup.dtype))
    if load:
        model.load_state_dict(setup.initial_state)
    model.train(not setup.eval_mode)
    return model


def _step_seed(setup: Setup, step: int, rank: int) -> int:
    # Each rank its own stream (dropout masks must differ across ranks in real training), each step reseeded so two
    # runs of the same side draw the same numbers: only randomness torch's seed does not control makes them differ.
    return setup.seed + 1 + step + 10_000 * rank


def _probe_shards(model: nn.Module, setup: Setup, step: int, loss_fn) -> tuple[list[float], dict[str, int]]:
    """On a copy of the reference before its step: each rank's share's loss, and the parameters that some rank's
    micro-batch leaves without a gradient (what DDP without ``find_unused_parameters`` cannot sync)."""
    probe = copy.deepcopy(model)
    shard_losses, no_grad = [], {}
    recipe = setup.recipe.step_recipe(sharded_grads=False)  # the ranks' forward, its rounding included
    for rank in range(1 if setup.pipeline else setup.world_size):  # a pipeline's ranks all run every micro-batch
        total = 0.0
        micro = micro_batches(setup, step, rank)
        for x, y in micro:
            probe.zero_grad(set_to_none=True)
            torch.manual_seed(_step_seed(setup, step, rank))
            with recipe.autocast("cpu"):
                loss = loss_fn(probe(x), y)
            loss.backward()
            total += loss.item() / len(micro)
            for name, p in probe.named_parameters():
                if p.requires_grad and p.grad is None:
                    no_grad.setdefault(name, rank)
        shard_losses.append(total)
    return shard_losses * (setup.world_size if setup.pipeline else 1), no_grad


def reference_batch(setup: Setup, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What one process trains on at ``step``: the whole global batch, in one forward."""
    g = setup.global_batch
    return [(setup.inputs[step * g : (step + 1) * g], setup.targets[step * g : (step + 1) * g])]


def run_reference(setup: Setup, probe: bool = True) -> list[StepRecord]:
    """One process, the whole global batch per step, from ``setup.initial_state``."""
    model = fresh_model(setup, setup.seed, load=True)
    loss_fn = build_loss(setup.loss_spec, setup.loss_kwargs)
    opt = build_optimizer(setup, model.parameters())
    recipe = setup.recipe.step_recipe(sharded_grads=False, world_size=setup.backward_weight_ratio)
    schedule = setup.recipe.schedule(opt, setup.steps)
    records = []
    for step in range(setup.steps):
        shard_losses, no_grad = _probe_shards(model, setup, step, loss_fn) if probe else (None, None)
        batch = reference_batch(setup, step)
        torch.manual_seed(_step_seed(setup, step, 0))
        record = _record(model, train_step(model, opt, batch, loss_fn, recipe, schedule), keep=True)
        record.shard_losses, record.no_grad = shard_losses, no_grad
        record.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        records.append(record)
    return records


def rank_main(rank: int, world_size: int, setup: Setup, wrappers: list[str]) -> dict[str, list[StepRecord]]:
    """On every rank: for each wrapper, a fresh model, wrapped, trained ``setup.steps`` steps on this rank's share."""
    if setup.pipeline:
        return {wrapper: _pipeline_records(rank, world_size, setup) for wrapper in wrappers}
    results = {}
    for wrapper in wrappers:
        # A different start on every rank but 0 (the reference's): the broadcast at construction must fix it.
        model = fresh_model(setup, setup.seed + 100 + rank, load=rank == 0)
        names = [n for n, _ in model.named_parameters()]
        wrapped, opt = wrap_kind(setup, model, wrapper)
        loss_fn = build_loss(setup.loss_spec, setup.loss_kwargs)
        recipe = setup.recipe.step_recipe(sharded_grads=setup.parallel in ("zero2", "zero3"))
        schedule = setup.recipe.schedule(opt, setup.steps)
        records = []
        for step in range(setup.steps):
            torch.manual_seed(_step_seed(setup, step, rank))
            loss = train_step(wrapped, opt, micro_batches(setup, step, rank), loss_fn, recipe, schedule)
            records.append(_record(model, loss, keep=rank == 0, state=_gathered_state(wrapped), names=names))
        results[wrapper] = records
    return results


def _pipeline_records(rank: int, world_size: int, setup: Setup) -> list[StepRecord]:
    """Rank ``rank`` as stage ``rank`` of one pipeline, stepped as the worker's ``PipelineStep`` steps: forward and
    backward through the stages, the recipe's ``optimizer_step``, the schedule. Recorded: the merged whole model."""
    from app.parallel.pipeline import build_pipeline_stage, merge_state_dicts  # PyTorch's pipelining: on use

    # Every stage from the reference's start: a pipeline broadcasts nothing, the worker builds it from one seed.
    model = fresh_model(setup, setup.seed, load=True)
    whole = copy.deepcopy(model)  # the stages' merged state lands here after each step, to be recorded
    runner = build_pipeline_stage(
        model, stage_index=rank, num_stages=world_size, n_microbatches=world_size * setup.accum,
        schedule=setup.pipeline_schedule, loss_fn=build_loss(setup.loss_spec, setup.loss_kwargs),
        split=setup.pipeline_split, recipe=setup.recipe.step_recipe(sharded_grads=True),
    )  # fmt: skip
    opt = build_optimizer(setup, runner.module.parameters())
    schedule = setup.recipe.schedule(opt, setup.steps)
    first, last = runner.stage.is_first, runner.stage.is_last
    records = []
    for step in range(setup.steps):
        torch.manual_seed(_step_seed(setup, step, rank))
        ((x, y),) = reference_batch(setup, step)  # cut into the micro-batches by the schedule, in order
        result = runner.forward_backward(x if first else None, y if last else None)
        runner.optimizer_step(opt)
        schedule.step()
        parts: list = [None] * world_size
        torch.distributed.all_gather_object(parts, {k: v.cpu() for k, v in runner.state_dict().items()})
        whole.load_state_dict(merge_state_dicts(parts))
        records.append(_record(whole, result.loss, keep=rank == 0))
    return records
