"""The training recipe (app.parallel.accum.StepRecipe, app.worker.recipe) on real gloo ranks, against one process.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/integration/test_recipe.py -q

One world of 2 ranks (``world``) runs every recipe through our DDP and PyTorch's on its half of each global batch,
in 2 micro-batches, and the same global batch in one bare process: bf16 autocast, clipping by global norm, warm-up +
cosine with the linear scaling rule, and an fp16 GradScaler with an inf forced into rank 1's gradient at one step.
The tolerances below are measured (the figures in each test's comment, over 4 steps of MiniMLP) with room to spare.
A second test runs the worker itself: stopped at step 4 and resumed on 2 ranks and on 1, it equals the straight run.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn.functional as F

from app.parallel import wrap_model
from app.parallel.accum import StepRecipe, accumulation_step
from app.worker.checkpoint.files import checkpoint_path, load_checkpoint
from app.worker.config import TrainConfig
from app.worker.models import MiniMLP
from app.worker.recipe import LRSchedule, lr_factor
from app.world import run_world
from tests.trainer_run import describe, finish, finished, run_process, start_ranks, worker_args

STEPS, GLOBAL, MICRO = 4, 32, 8  # per rank of 2: 16 samples in 2 micro-batches of 8
FP32_TOL = 1e-6  # fp32 paths: summation order only
BF16_TOL = 2e-3  # bf16 autocast, one big batch: another split, another bf16 rounding (measured below)
FP16_TOL = 5e-4  # fp16 autocast + GradScaler against fp32 (measured below)
SCHEDULE = TrainConfig(
    lr=1e-3, steps=STEPS, lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1, lr_reference_batch=16
)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL, 32, generator=g), torch.randint(0, 8, (GLOBAL,), generator=g)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in getattr(model, "module", model).parameters()])


def train(base, rank, world, wrapper, recipe, make_opt, *, schedule=False, poison_at=None, micro=None) -> dict:
    """``STEPS`` steps of ``base``'s copy on this rank's share; returns what a user would compare, per step."""
    model = copy.deepcopy(base)
    net = wrap_model(model, wrapper) if wrapper != "none" else model
    opt = make_opt(model.parameters())
    sched = LRSchedule(opt, SCHEDULE, GLOBAL) if schedule else None
    out = {"params": [], "lr": [], "norm": [], "skipped": [], "scale": [], "syncs": [], "adam_step": []}
    for step in range(STEPS):
        x, y = batch(step)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        size = micro or (MICRO if world > 1 else GLOBAL)
        hook = None
        if step == poison_at and rank == world - 1:  # an overflow on the last rank only, before the all-reduce
            hook = model.net[0].weight.register_hook(lambda g: g * float("inf"))
        calls = getattr(getattr(net, "stats", None), "sync_calls", 0)
        lr = opt.param_groups[0]["lr"]
        r = accumulation_step(net, opt, list(zip(xs.split(size), ys.split(size))), F.cross_entropy, recipe=recipe)
        if hook is not None:
            hook.remove()
        if sched is not None:
            sched.step()
        out["params"].append(flat(model))
        out["lr"].append(lr)
        out["norm"].append(r.grad_norm)
        out["skipped"].append(r.skipped)
        out["scale"].append(recipe.scaler.get_scale() if recipe.scaler else None)
        out["syncs"].append((r.syncs, getattr(getattr(net, "stats", None), "sync_calls", 0) - calls))
        out["adam_step"].append(int(opt.state[model.net[0].weight].get("step", 0)))
    return out


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


CASES = {
    # name: (recipe factory, optimizer, schedule?). Clipping under SGD: AdamW would hide a missing clip.
    "bf16": (lambda: StepRecipe(torch.bfloat16), sgd, False),
    "fp32": (lambda: StepRecipe(), sgd, False),
    "clip": (lambda: StepRecipe(grad_clip_norm=0.05), sgd, False),
    "noclip": (lambda: StepRecipe(), sgd, False),
    "schedule": (lambda: StepRecipe(grad_clip_norm=1.0), adamw, True),
    # fp16 with its GradScaler and the same clipping: only right if the scaler unscales before the clip.
    "fp16_clip": (lambda: StepRecipe(torch.float16, torch.amp.GradScaler("cpu"), grad_clip_norm=0.05), sgd, False),
}


def _recipes(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    base = MiniMLP()
    out = {}
    for name, (recipe, opt, schedule) in CASES.items():
        out[name, "one"] = train(base, 0, 1, "none", recipe(), opt, schedule=schedule)
        if name == "bf16":  # the same global batch in the ranks' micro-batches: the same bf16 matmuls
            out[name, "one_micro"] = train(base, 0, 1, "none", recipe(), opt, micro=MICRO)
        for wrapper in ("ours", "torch"):
            out[name, wrapper] = train(base, rank, world, wrapper, recipe(), opt, schedule=schedule)
    fp16 = lambda: StepRecipe(torch.float16, torch.amp.GradScaler("cpu"), grad_clip_norm=1.0)  # noqa: E731 - a table
    for wrapper in ("ours", "torch"):
        out["fp16", wrapper] = train(base, rank, world, wrapper, fp16(), adamw, poison_at=1)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_world(_recipes, 2, timeout=240)


def worst(a: dict, b: dict) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a["params"], b["params"]))


@pytest.mark.parametrize("wrapper", ["ours", "torch"])
def test_bf16_autocast_on_2_ranks_equals_one_process(world, wrapper):
    # Measured max |Δparam| over 4 SGD steps: 0.0 against one process accumulating the same micro-batches (the
    # same bf16 matmuls, fp32 sums); 7.6e-4 against one big batch of 32 (bf16 rounds other sums), where bf16
    # itself is 1.5e-3 from fp32; fp32 paths 1.5e-8.
    for rank in world:
        assert worst(rank["bf16", wrapper], rank["bf16", "one_micro"]) < FP32_TOL
        assert worst(rank["bf16", wrapper], rank["bf16", "one"]) < BF16_TOL
        assert worst(rank["fp32", wrapper], rank["fp32", "one"]) < FP32_TOL
        # bf16 really ran: it differs from fp32 by far more than fp32 paths differ from each other.
        assert worst(rank["bf16", wrapper], rank["fp32", wrapper]) > 100 * FP32_TOL
        assert [s for s, _ in rank["bf16", wrapper]["syncs"]] == [1] * STEPS  # K=2 micro-batches, one sync a step
    assert [s for _, s in world[0]["bf16", "ours"]["syncs"]] == [1] * STEPS  # the wrapper's own count agrees


@pytest.mark.parametrize("wrapper", ["ours", "torch"])
def test_clipping_by_global_norm_on_2_ranks_equals_one_process(world, wrapper):
    # Measured max |Δparam|: ~1e-8 (fp32). The global norm is the averaged gradient's, equal on every rank.
    for rank in world:
        clipped, one = rank["clip", wrapper], rank["clip", "one"]
        assert worst(clipped, one) < FP32_TOL
        assert all(n > 0.05 for n in clipped["norm"])  # every step was clipped ...
        assert clipped["norm"] == pytest.approx(one["norm"], rel=1e-5)  # ... by the one-process norm
        assert worst(clipped, rank["noclip", wrapper]) > 1e-3  # and clipping changed the result
    assert world[0]["clip", wrapper]["norm"] == world[1]["clip", wrapper]["norm"]


@pytest.mark.parametrize("wrapper", ["ours", "torch"])
def test_fp16_with_its_scaler_unscales_before_clipping(world, wrapper):
    # Measured against fp32 with the same clipping: max |Δparam| 8.2e-5, norms within 4e-4 relative. Clipping the
    # scaled gradient instead would shrink every step 65536-fold.
    for rank in world:
        fp16, fp32 = rank["fp16_clip", wrapper], rank["clip", "one"]
        assert worst(fp16, fp32) < FP16_TOL
        assert fp16["norm"] == pytest.approx(fp32["norm"], rel=2e-3)
        assert fp16["skipped"] == [False] * STEPS and [s for s, _ in fp16["syncs"]] == [1] * STEPS


@pytest.mark.parametrize("wrapper", ["ours", "torch"])
def test_warmup_then_cosine_on_2_ranks_equals_one_process(world, wrapper):
    # lr_reference_batch=16 with a global batch of 32: the peak is 2 × lr; measured max |Δparam| ~1e-8.
    peak = SCHEDULE.lr * GLOBAL / SCHEDULE.lr_reference_batch
    kw = {"schedule": "cosine", "steps": STEPS, "warmup_steps": 2, "min_lr_ratio": 0.1}
    expected = [peak * lr_factor(s, **kw) for s in range(STEPS)]
    assert expected == pytest.approx([peak / 2, peak, peak, peak * 0.1])
    for rank in world:
        assert rank["schedule", wrapper]["lr"] == pytest.approx(expected, rel=1e-12)
        assert rank["schedule", "one"]["lr"] == rank["schedule", wrapper]["lr"]
        assert worst(rank["schedule", wrapper], rank["schedule", "one"]) < FP32_TOL


@pytest.mark.parametrize("wrapper", ["ours", "torch"])
def test_an_fp16_overflow_on_one_rank_skips_the_same_step_on_every_rank(world, wrapper):
    runs = [rank["fp16", wrapper] for rank in world]
    for run in runs:
        assert run["skipped"] == [False, True, False, False]
        assert torch.equal(run["params"][1], run["params"][0])  # the skipped step changed nothing
        assert not torch.equal(run["params"][2], run["params"][1])  # the next one trains again
        assert run["scale"][1] == run["scale"][0] / 2  # halved once, by the one update() of the step
        assert run["adam_step"] == [1, 1, 2, 3]  # AdamW's step count did not advance on the skip
        assert [s for s, _ in run["syncs"]] == [1] * STEPS  # mixed precision adds no gradient sync
    assert runs[0]["scale"] == runs[1]["scale"]
    for a, b in zip(runs[0]["params"], runs[1]["params"]):
        assert torch.equal(a, b)


# -- the worker: the recipe in a checkpoint, resumed on the same and on another world size -------------------------
RECIPE = {
    "autocast": "fp16",
    "grad_clip_norm": 0.5,
    "lr_schedule": "cosine",
    "warmup_steps": 2,
    "min_lr_ratio": 0.1,
    "lr_reference_batch": 64,
    "steps": 8,
    "checkpoint_every": 4,
}


def _ranks(directory, world_size: int) -> dict:
    if world_size == 1:
        result = run_process(*worker_args("resumable", **RECIPE, checkpoint_dir=directory, wrapper="none"))
        assert result.returncode == 0, describe(result)
        return finished(result.stdout)
    procs = start_ranks(*worker_args("resumable", **RECIPE, checkpoint_dir=directory), world_size=world_size)
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0] * world_size, outs
    return finished("".join(out for out, _ in outs))


def test_a_resumed_recipe_equals_the_straight_run_on_any_world_size(tmp_path):
    straight = _ranks(tmp_path / "straight", 2)
    final = load_checkpoint(checkpoint_path(tmp_path / "straight", 8))
    for world_size in (2, 1):  # effective_batch=128 holds the global batch (and so the scaled lr) at both
        resumed = tmp_path / f"resumed-{world_size}"
        resumed.mkdir()
        shutil.copy(checkpoint_path(tmp_path / "straight", 4), checkpoint_path(resumed, 4))
        done = _ranks(resumed, world_size)
        again = load_checkpoint(checkpoint_path(resumed, 8))
        assert again["lr_scheduler"] == final["lr_scheduler"] == {"last_epoch": 8, "base_lr": 3e-3 * 128 / 64}
        assert again["optimizer"]["param_groups"][0]["lr"] == final["optimizer"]["param_groups"][0]["lr"]
        assert again["grad_scaler"] == final["grad_scaler"]  # the scale and its growth tracker continued
        if world_size == 2:  # the same world: bit-identical
            assert done[0]["checksum"] == straight[0]["checksum"]
        drift = max(float((again["model"][k] - t).abs().max()) for k, t in final["model"].items())
        # The same world: bit-identical. World 1 measured 0.0 too: its 4 micro-batches are the 2 ranks' 2 + 2, so
        # the fp16 matmuls are the same; the bound allows what another split would round differently.
        assert drift == 0 if world_size == 2 else drift < FP16_TOL


def test_an_old_checkpoint_loads_and_a_changed_lr_rescales_the_schedule(tmp_path):
    factor = lr_factor(3, schedule="cosine", steps=STEPS, warmup_steps=2, min_lr_ratio=0.1)
    for old, changed in run_world(_resume_lrs, 2, str(tmp_path)):
        assert old == pytest.approx(SCHEDULE.lr * 2 * factor)  # the peak is lr × 32 / 16, the schedule at step 3
        assert changed == pytest.approx(2 * SCHEDULE.lr * 2 * factor)  # lr doubled on resume: the new peak


def _resume_lrs(rank: int, world: int, directory: str) -> tuple[float, float]:
    """The lr after resuming (a) a checkpoint written before schedules existed (no ``lr_scheduler``: the schedule is
    put at its step), (b) one with the schedule's state, by a run whose configured lr is twice the old one."""
    import dataclasses

    import torch.distributed as dist

    from app.worker.checkpoint.checkpointer import Checkpointer
    from app.worker.data import GlobalBatches, teacher_classification
    from app.worker.dist import DistContext

    ctx = DistContext(rank, rank, world, torch.device("cpu"), dist.get_backend())

    def checkpointer(cfg: TrainConfig | None, folder: str) -> tuple[Checkpointer, LRSchedule | None]:
        model = MiniMLP()
        opt = torch.optim.AdamW(model.parameters(), lr=SCHEDULE.lr)
        sched = LRSchedule(opt, cfg, GLOBAL) if cfg else None
        batches = GlobalBatches(teacher_classification(256, 0), GLOBAL, MICRO, rank, world, 0, ctx.device)
        run = {"model_name": "mini_mlp", "seed": 0, "lr": (cfg or SCHEDULE).lr, "global_batch": GLOBAL}
        ckpt = Checkpointer(
            folder, every=1, keep=2, ctx=ctx, model=model, optimizer=opt, batches=batches, lr_schedule=sched, **run
        )
        return ckpt, sched

    checkpointer(None, f"{directory}/old")[0].save(3)
    dist.barrier()  # rank 0's file is on disk before anyone resumes
    ckpt, sched = checkpointer(SCHEDULE, f"{directory}/old")
    assert ckpt.resume().step == 3
    old = sched.lr
    ckpt.directory = f"{directory}/new"
    ckpt.save(3)
    dist.barrier()
    ckpt, changed = checkpointer(dataclasses.replace(SCHEDULE, lr=2 * SCHEDULE.lr), f"{directory}/new")
    assert ckpt.resume().step == 3 and changed.scheduler.last_epoch == 3
    return old, changed.lr


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_after_warm_up_the_lr_falls_from_the_peak_to_its_floor_by_the_last_step(schedule):
    # 11 steps, 3 of warm-up (1/3, 2/3, 1), then 8 from the peak (step 4) to min_lr_ratio (step 11), evenly spaced
    # in progress: each step's place in the decay is the steps done since warm-up ended.
    import math

    from app.worker.recipe import lr_factor

    got = [lr_factor(s, schedule=schedule, steps=11, warmup_steps=3, min_lr_ratio=0.1) for s in range(11)]
    decay = [1 - k / 7 if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * k / 7)) for k in range(8)]
    assert got == pytest.approx([1 / 3, 2 / 3, 1, *(0.1 + 0.9 * d for d in decay)]), got
