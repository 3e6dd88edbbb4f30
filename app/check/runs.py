"""The two sides of the comparison: N DDP ranks (``rank_main``, spawned) and one process (``run_reference``).

Both train the same model from the same start on the same samples with the same optimizer. Step ``s`` uses samples
``[s*G, (s+1)*G)`` of the data, ``G = ranks x accum x micro_batch``: rank ``r`` takes its contiguous share of them and
cuts it into ``accum`` micro-batches; the reference takes all ``G`` in one forward. Every loss is a mean over its
samples and the rank's loss is divided by ``accum``, so the ranks' averaged gradient is the gradient of the mean loss
over the ``G`` samples: the reference's, up to float rounding.

What each side returns is a list of ``StepRecord``: the loss, a digest of each parameter and buffer after the step,
and (rank 0 and the reference) the parameters themselves, so the parent compares without collectives.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from dataclasses import dataclass, field

import torch
from torch import nn

from app.check.inputs import build_loss
from app.parallel import wrap_model
from app.specs import build_model
from app.worker.models import parameter_checksum


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

    @property
    def global_batch(self) -> int:
        return self.world_size * self.accum * self.micro_batch


@dataclass
class StepRecord:
    loss: float  # this side's loss: the reference's on all G samples, a rank's on its share
    digest: str  # parameter_checksum's first 12 hex
    param_digests: dict[str, str]
    buffer_digests: dict[str, str]
    params: dict[str, torch.Tensor] | None = None  # kept by rank 0 and the reference only
    shard_losses: list[float] | None = None  # reference only: its loss on each rank's share, before its step
    no_grad: dict[str, int] | None = None  # reference only: parameter -> a rank whose micro-batch left it gradless
    grads: dict[str, torch.Tensor] | None = None  # reference only: the gradient this step applied


def micro_batches(setup: Setup, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s ``accum`` micro-batches of step ``step``."""
    start = step * setup.global_batch + rank * setup.accum * setup.micro_batch
    bounds = [start + k * setup.micro_batch for k in range(setup.accum + 1)]
    return [(setup.inputs[a:b], setup.targets[a:b]) for a, b in zip(bounds, bounds[1:])]


def build_optimizer(setup: Setup, params) -> torch.optim.Optimizer:
    if setup.optimizer == "sgd":
        return torch.optim.SGD(params, lr=setup.lr)
    return torch.optim.AdamW(params, lr=setup.lr)


def train_step(ddp: nn.Module, opt, micro: list, loss_fn, sync_context=None) -> float:
    """One optimizer step over ``micro``: the loss divided by K, gradients synced only by the last backward."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for i, (x, y) in enumerate(micro):
        # no_sync() on all but the last micro-batch; the forward runs inside it, as DDP decides there.
        last = i == len(micro) - 1
        with contextlib.nullcontext() if last or sync_context is None else sync_context():
            loss = loss_fn(ddp(x), y) / len(micro)
            loss.backward()
        total += loss.item()
    opt.step()
    return total


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _record(model: nn.Module, loss: float, keep: bool) -> StepRecord:
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return StepRecord(
        loss=loss,
        digest=parameter_checksum(model)[:12],
        param_digests={n: _digest(t) for n, t in params.items()},
        buffer_digests={n: _digest(t) for n, t in buffers.items()},
        params=params if keep else None,
    )


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
    for rank in range(setup.world_size):
        total = 0.0
        for x, y in micro_batches(setup, step, rank):
            probe.zero_grad(set_to_none=True)
            torch.manual_seed(_step_seed(setup, step, rank))
            loss = loss_fn(probe(x), y)
            loss.backward()
            total += loss.item() / setup.accum
            for name, p in probe.named_parameters():
                if p.requires_grad and p.grad is None:
                    no_grad.setdefault(name, rank)
        shard_losses.append(total)
    return shard_losses, no_grad


def run_reference(setup: Setup, probe: bool = True) -> list[StepRecord]:
    """One process, the whole global batch per step, from ``setup.initial_state``."""
    model = fresh_model(setup, setup.seed, load=True)
    loss_fn = build_loss(setup.loss_spec, setup.loss_kwargs)
    opt = build_optimizer(setup, model.parameters())
    records = []
    for step in range(setup.steps):
        shard_losses, no_grad = _probe_shards(model, setup, step, loss_fn) if probe else (None, None)
        g = setup.global_batch
        batch = [(setup.inputs[step * g : (step + 1) * g], setup.targets[step * g : (step + 1) * g])]
        torch.manual_seed(_step_seed(setup, step, 0))
        record = _record(model, train_step(model, opt, batch, loss_fn), keep=True)
        record.shard_losses, record.no_grad = shard_losses, no_grad
        record.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        records.append(record)
    return records


def rank_main(rank: int, world_size: int, setup: Setup, wrappers: list[str]) -> dict[str, list[StepRecord]]:
    """On every rank: for each wrapper, a fresh model, wrapped, trained ``setup.steps`` steps on this rank's share."""
    results = {}
    for wrapper in wrappers:
        # A different start on every rank but 0 (the reference's): the broadcast at construction must fix it.
        model = fresh_model(setup, setup.seed + 100 + rank, load=rank == 0)
        ddp = wrap_model(model, wrapper, **setup.wrapper_kwargs)
        loss_fn = build_loss(setup.loss_spec, setup.loss_kwargs)
        opt = build_optimizer(setup, ddp.parameters())
        records = []
        for step in range(setup.steps):
            torch.manual_seed(_step_seed(setup, step, rank))
            loss = train_step(ddp, opt, micro_batches(setup, step, rank), loss_fn, ddp.no_sync)
            records.append(_record(model, loss, keep=rank == 0))
        results[wrapper] = records
    return results
