"""The recipe under ZeRO-2 and ZeRO-3 (gradients sharded across ranks) against our DDP, on 2 real gloo ranks.

What sharding changes for the recipe: no rank holds the whole gradient. Clipping must take the global norm over
every rank's shards (``clip_grad_norm_`` of the wrappers, app.parallel.zero.stage2.clip_sharded_grad_norm_), and
an fp16 overflow lands in one rank's shard only, so the GradScaler must agree across ranks (torch's
``ShardedGradScaler``) or the ranks would step differently. Each case trains 4 steps of MiniMLP in 2 micro-batches
per rank, SGD with momentum (AdamW would hide a wrong clip: it divides each gradient by its own RMS), against our
DDP with the same recipe; measured max |Δparam| 0 to 6e-8 over all cases (``TOL`` allows 1e-6).
The worker's own zero runs with the recipe: tests/integration/test_train_sharded.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from app.parallel.accum import StepRecipe, accumulation_step
from app.parallel.ddp import DistributedDataParallel as DDP
from app.parallel.zero.stage2 import ShardedGradDataParallel
from app.parallel.zero.stage3 import FullyShardedDataParallel
from app.worker.models import MiniMLP
from app.world import run_world

STEPS, PER_RANK, MICRO = 4, 16, 8
TOL = 1e-6
POISON_AT = 1  # the step whose gradient overflows on rank 1 only


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(2 * PER_RANK, 32, generator=g), torch.randint(0, 8, (2 * PER_RANK,), generator=g)
    return list(zip(x.chunk(2)[rank].split(MICRO), y.chunk(2)[rank].split(MICRO)))


def _build(kind: str, model):
    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    if kind == "ddp":
        return DDP(model), sgd(model.parameters())
    if kind == "zero2":
        wrapped = ShardedGradDataParallel(model, bucket_cap_mb=0.001)  # several buckets: several shards per rank
        return wrapped, wrapped.build_optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    wrapped = FullyShardedDataParallel(model)
    return wrapped, sgd(wrapped.parameters())


def _whole(kind: str, wrapped, model) -> torch.Tensor | None:
    """The whole model's parameters (on rank 0 for zero3, whose ranks hold shards)."""
    if kind != "zero3":
        return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    state = wrapped.full_state_dict()
    return torch.cat([state[n].reshape(-1) for n, _ in MiniMLP().named_parameters()]) if state else None


def _recipe(case: str, kind: str) -> StepRecipe:
    if case == "clip":
        return StepRecipe(grad_clip_norm=0.05)
    if case == "bf16":
        return StepRecipe(torch.bfloat16, grad_clip_norm=0.05)
    scaler = torch.amp.GradScaler("cpu") if kind == "ddp" else ShardedGradScaler("cpu")
    return StepRecipe(torch.float16, scaler, grad_clip_norm=0.05)


def _train(rank: int, world: int, case: str) -> dict:
    out = {}
    for kind in ("ddp", "zero2", "zero3"):
        torch.manual_seed(0)
        model = MiniMLP()
        wrapped, opt = _build(kind, copy.deepcopy(model))
        bare = wrapped.module
        recipe = _recipe(case, kind)
        run = {"params": [], "norm": [], "skipped": [], "scale": []}
        for step in range(STEPS):
            hook = None
            if case == "fp16" and step == POISON_AT and rank == 1:
                weight = bare.net[0].weight
                # zero3 keeps the layer's parameter as a view of its unit: poison the gradient through autograd
                hook = weight.register_hook(lambda g: g * float("inf"))
            result = accumulation_step(wrapped, opt, _batch(step, rank), F.cross_entropy, recipe=recipe)
            if hook is not None:
                hook.remove()
            run["params"].append(_whole(kind, wrapped, bare))
            run["norm"].append(result.grad_norm)
            run["skipped"].append(result.skipped)
            run["scale"].append(recipe.scaler.get_scale() if recipe.scaler else None)
        out[kind] = run
    return out


@pytest.fixture(scope="module", params=["clip", "bf16", "fp16"])
def runs(request) -> tuple[str, list[dict]]:
    return request.param, run_world(_train, 2, request.param, timeout=300)


@pytest.mark.parametrize("kind", ["zero2", "zero3"])
def test_the_recipe_under_sharded_gradients_trains_as_ddp(runs, kind):
    case, ranks = runs
    ddp, ours = ranks[0]["ddp"], ranks[0][kind]
    for step, (a, b) in enumerate(zip(ddp["params"], ours["params"])):
        assert (a - b).abs().max().item() <= TOL, f"{case} {kind} step {step}: {(a - b).abs().max().item():.3g}"
    # The global norm over the shards, before clipping, is the whole gradient's, on every rank alike.
    for rank in ranks:
        for want, got in zip(ddp["norm"], rank[kind]["norm"]):
            assert got == pytest.approx(want, rel=1e-5, nan_ok=True), (case, kind, ddp["norm"], rank[kind]["norm"])


@pytest.mark.parametrize("runs", ["fp16"], indirect=True)
def test_an_overflow_in_one_ranks_shard_skips_the_same_step_on_every_rank(runs):
    _, ranks = runs
    for kind in ("zero2", "zero3"):
        for rank in ranks:
            run = rank[kind]
            assert run["skipped"] == [False, True, False, False], (kind, run["skipped"])
            assert run["scale"][POISON_AT] == run["scale"][0] / 2, (kind, run["scale"])
        assert ranks[0][kind]["scale"] == ranks[1][kind]["scale"]
    zero2 = [rank["zero2"]["params"] for rank in ranks]  # whole on every rank: equal after the skip too
    assert all(torch.equal(a, b) for a, b in zip(*zero2))


# -- the worker: each ZeRO stage runs the recipe as parallel=ddp does, and resumes its schedule --------------------
# Warm-up over 4 steps then constant: the first half (steps=4) and the resumed whole (steps=8) share one schedule,
# so a resume that lost the schedule's position would train steps 5-8 at 1/4..1 of the lr instead of 1.
RECIPE = {"lr_schedule": "constant", "warmup_steps": 4, "grad_clip_norm": 0.05, "lr_reference_batch": 25}


@pytest.fixture(scope="module")
def ddp_recipe(tmp_path_factory):
    from tests.integration.test_train_sharded import _train as train_worker

    top = tmp_path_factory.mktemp("ddp-recipe")
    train_worker(top, 2, parallel="ddp", **RECIPE)
    return top


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_each_stage_runs_the_recipe_as_ddp_and_resumes_its_schedule(tmp_path, ddp_recipe, stage):
    import json

    from app.checkpoint_dir import MANIFEST, newest_sharded
    from app.worker.checkpoint.files import checkpoint_path, load_checkpoint
    from tests.integration.test_train_sharded import STEPS, TOLERANCE, _max_diff, sharded_params
    from tests.integration.test_train_sharded import _train as train_worker

    train_worker(tmp_path, 2, steps=STEPS // 2, parallel=stage, **RECIPE)
    train_worker(tmp_path, 2, steps=STEPS, parallel=stage, **RECIPE)  # resumes from the half-way checkpoint
    ddp = load_checkpoint(checkpoint_path(ddp_recipe, STEPS))["model"]
    diff = _max_diff(sharded_params(tmp_path), dict(ddp))
    assert diff < TOLERANCE, f"{stage} with the recipe, resumed: max |Δparam| {diff:.3g} vs ddp"
    extra = json.loads((newest_sharded(tmp_path) / MANIFEST).read_text())["extra"]
    assert extra["lr_scheduler"] == {"last_epoch": STEPS, "base_lr": pytest.approx(3e-3 * 50 / 25)}
