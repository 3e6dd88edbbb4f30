"""The ``Checkpointer`` (app/worker/checkpoint/checkpointer.py) on a world of 2: the cadence, a save and a resume of
either kind (the model, AdamW's state, the configured lr winning over the saved one, the data position, every rank's
own RNG stream, the generation, the steps redone), a resume across kinds, another model's checkpoint, and what a
damaged newest checkpoint leaves. Whole runs are in tests/integration/test_resume.py and test_train_sharded.py.

    .venv/bin/python -m pytest tests/unit/test_checkpointer.py
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.checkpoint_dir import find_checkpoints
from app.parallel.zero.stage2 import ShardedGradDataParallel
from app.worker.checkpoint.checkpointer import PROGRESS_FILE, Checkpointer, CheckpointMismatch, ShardedState
from app.worker.dist import DistContext
from app.world import run_world


class Position:
    """A data position, as the loop's batches give theirs: a ``Stateful``."""

    def __init__(self, step: int = 0):
        self.state = {"epoch": step // 3, "offset": step}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def build(parallel: str, seed: int, lr: float):
    """(what the Checkpointer is given as model and optimizer, the bare model)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    if parallel == "ddp":
        return model, torch.optim.AdamW(model.parameters(), lr=lr), model
    wrapped = ShardedGradDataParallel(model, bucket_cap_mb=0.0001)
    state = ShardedState(wrapped, wrapped.build_optimizer(torch.optim.AdamW, lr=lr), parallel)
    return state, state, model


def train(model, optimizer, rank: int, steps: range) -> None:
    opt = optimizer.optimizer if isinstance(optimizer, ShardedState) else optimizer
    net = optimizer.model if isinstance(optimizer, ShardedState) else model
    for step in steps:
        # A plain model here has no DDP around it: every rank trains on the same data, so they stay equal.
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + (rank if net is not model else 0)))
        opt.zero_grad()
        F.mse_loss(net(x), x[:, :2]).backward()
        opt.step()


def checkpointer(directory, rank, world, model, optimizer, batches, lr=0.01, name="mlp", **kw) -> Checkpointer:
    ctx = DistContext(rank, rank, world, torch.device("cpu"), "gloo")
    return Checkpointer(
        directory, every=2, keep=3, ctx=ctx, model=model, optimizer=optimizer, batches=batches,
        model_name=name, seed=7, lr=lr, global_batch=16, **kw,
    )  # fmt: skip


def save_then_resume(rank, world, directory, saved_as, resumed_as, resume_world):
    """Save at step 4 under ``saved_as``; resume under ``resumed_as`` (lr 0.05 configured) on ranks < resume_world."""
    model, opt, bare = build(saved_as, 0, 0.01)
    ckpt = checkpointer(directory, rank, world, model, opt, Position(4))
    train(bare, opt, rank, range(4))
    ckpt.note_progress(6)  # the world went on to step 6 before it was lost
    torch.manual_seed(100 + rank)
    ckpt.save(4)
    rng_after_save = torch.rand(3)
    expected = {k: v.detach().clone() for k, v in bare.state_dict().items()}
    model, opt, bare = build(resumed_as, 1, 0.05)
    position = Position()
    ckpt = checkpointer(directory, rank, world, model, opt, position, lr=0.05)
    torch.manual_seed(999)
    resumed = ckpt.resume()
    same_world_rng = torch.rand(3)
    optimizer = opt.optimizer if isinstance(opt, ShardedState) else opt
    return {
        "resumed": resumed,
        "generation": ckpt.generation,
        "equal": all(torch.equal(expected[k], v) for k, v in bare.state_dict().items()),
        "lrs": [g["lr"] for g in optimizer.param_groups],
        "state": sorted({k for s in optimizer.state.values() for k in s}),
        "position": position.state,
        "rng": (rng_after_save, same_world_rng),
    }


@pytest.mark.parametrize(
    ("saved_as", "resumed_as"), [("ddp", "ddp"), ("zero2", "zero2"), ("ddp", "zero2"), ("zero2", "ddp")]
)
def test_a_resume_brings_back_the_model_its_state_position_and_rng_with_the_configured_lr(
    saved_as, resumed_as, tmp_path
):
    results = run_world(save_then_resume, 2, str(tmp_path), saved_as, resumed_as, 2)
    for rank, r in enumerate(results):
        resumed = r["resumed"]
        assert resumed is not None and resumed.step == 4 and resumed.world_size == 2 and resumed.epoch == 1
        assert resumed.generation == 1 and r["generation"] == 2  # the world that wrote it was the first
        assert resumed.global_batch == 16 and resumed.wall_time is not None
        assert resumed.steps_redone == 2  # rank 0 had noted step 6
        assert r["equal"], (saved_as, resumed_as)
        assert r["lrs"] and set(r["lrs"]) == {0.05}  # the configured lr, not the saved 0.01
        assert r["state"] == ["exp_avg", "exp_avg_sq", "step"]
        assert r["position"] == {"epoch": 1, "offset": 4}
        # Each rank's own stream as it was at the save: what it draws next is what it drew after the save.
        assert torch.equal(*r["rng"]), rank
    assert not torch.equal(results[0]["rng"][0], results[1]["rng"][0])  # two ranks, two streams
    kind = "sharded-step-00000004" if saved_as != "ddp" else "step-00000004.pt"
    assert [f.path.name for f in find_checkpoints(tmp_path)] == [kind]


def resume_on_another_world(rank, world, directory):
    model, opt, _ = build("ddp", 1, 0.05)
    ckpt = checkpointer(directory, rank, world, model, opt, Position())
    resumed = ckpt.resume()
    return resumed.step, resumed.world_size, torch.rand(3)


def test_a_resume_on_another_world_size_draws_a_fresh_stream_per_rank_and_step(tmp_path):
    run_world(save_then_resume, 2, str(tmp_path), "ddp", "ddp", 2)
    step, saved_world, drawn = run_world(resume_on_another_world, 1, str(tmp_path))[0]
    assert (step, saved_world) == (4, 2)
    torch.manual_seed(7 + 0 + 1_000_003 * 4)  # seed + rank + 1_000_003 x step
    assert torch.equal(drawn, torch.rand(3))


def another_model(rank, world, directory, parallel):
    model, opt, bare = build(parallel, 0, 0.01)
    checkpointer(directory, rank, world, model, opt, Position(2)).save(2)
    model, opt, _ = build(parallel, 0, 0.01)
    try:
        checkpointer(directory, rank, world, model, opt, Position(), name="other").resume()
    except CheckpointMismatch as e:
        return str(e)
    return None


@pytest.mark.parametrize("parallel", ["ddp", "zero2"])
def test_a_checkpoint_of_another_model_is_a_mismatch_naming_both(parallel, tmp_path):
    for message in run_world(another_model, 2, str(tmp_path), parallel):
        assert message == (
            f"checkpoint_dir={str(tmp_path)!r} holds mlp checkpoints but model=other; use another checkpoint_dir or "
            f"model"
        )


def damaged_newest(rank, world, directory, parallel):
    model, opt, bare = build(parallel, 0, 0.01)
    ckpt = checkpointer(directory, rank, world, model, opt, Position(2))
    train(bare, opt, rank, range(2))
    ckpt.save(2)
    ckpt.batches = Position(4)
    ckpt.save(4)
    torch.distributed.barrier()
    if rank == 0:
        newest = find_checkpoints(directory)[0].path
        victim = newest if newest.is_file() else next(newest.glob("shard-00001-*.pt"))
        victim.write_bytes(victim.read_bytes()[:-20])
    torch.distributed.barrier()
    model, opt, _ = build(parallel, 1, 0.01)
    resumed = checkpointer(directory, rank, world, model, opt, Position()).resume()
    return resumed.step, sorted(p.name for p in Path(directory).iterdir())


@pytest.mark.parametrize("parallel", ["ddp", "zero2"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_resumes(parallel, tmp_path):
    (step, names), _ = run_world(damaged_newest, 2, str(tmp_path), parallel)
    assert step == 2
    if parallel == "ddp":
        assert names == ["step-00000002.pt", "step-00000004.pt.corrupt"]
    else:
        assert names == ["sharded-step-00000002", "sharded-step-00000004.corrupt"]


def test_saves_are_due_every_n_steps_and_at_the_end_and_never_without_a_directory(tmp_path):
    ckpt = Checkpointer(
        str(tmp_path), every=3, keep=1, ctx=None, model=None, optimizer=None, batches=None, model_name="m", seed=0,
        lr=0.1, global_batch=1,
    )  # fmt: skip
    assert [s for s in range(1, 10) if ckpt.should_save(s)] == [3, 6, 9]
    assert ckpt.should_save(4, final=True)
    ckpt.directory = ""
    assert not ckpt.should_save(3) and not ckpt.should_save(3, final=True)
    assert ckpt.resume() is None
    assert ckpt.last_good() == "No checkpoint was written."


def test_rank_0_notes_its_progress_and_the_other_ranks_write_nothing(tmp_path):
    def at(rank: int) -> Checkpointer:
        ctx = DistContext(rank, rank, 2, torch.device("cpu"), "gloo")
        return Checkpointer(
            str(tmp_path), every=1, keep=1, ctx=ctx, model=None, optimizer=None, batches=None, model_name="m",
            seed=0, lr=0.1, global_batch=1,
        )  # fmt: skip

    at(1).note_progress(5)
    assert not (tmp_path / PROGRESS_FILE).exists()
    at(0).note_progress(5)
    assert json.loads((tmp_path / PROGRESS_FILE).read_text()) == {"step": 5}
    assert sorted(p.name for p in tmp_path.iterdir()) == [PROGRESS_FILE]  # its temporary file renamed, not left


def incomplete_newest(rank, world, directory):
    model, opt, bare = build("zero2", 0, 0.01)
    ckpt = checkpointer(directory, rank, world, model, opt, Position(2))
    ckpt.save(2)
    ckpt.save(4)
    torch.distributed.barrier()
    if rank == 0:
        (Path(directory) / "sharded-step-00000004" / "manifest.json").unlink()  # a save that did not finish
    torch.distributed.barrier()
    model, opt, _ = build("zero2", 1, 0.01)
    return checkpointer(directory, rank, world, model, opt, Position()).resume().step


def test_a_sharded_save_without_its_manifest_is_skipped_with_a_warning(tmp_path, caplog):
    assert run_world(incomplete_newest, 2, str(tmp_path)) == [2, 2]
    assert (tmp_path / "sharded-step-00000004").is_dir()  # not set aside: an unfinished save, not a damaged one


def test_the_warning_for_an_unfinished_save_names_it(tmp_path, caplog):
    from app.checkpoint_dir import Found

    ckpt = checkpointer(str(tmp_path), 0, 1, None, None, None)
    found = Found(4, "sharded", tmp_path / "sharded-step-00000004", complete=False)
    with caplog.at_level(logging.WARNING):
        assert ckpt._resume_from(found) is None
    assert f"skipping {found.path}: no manifest.json, its save did not finish; trying the previous one" in caplog.text


def three_saves(rank, world, directory, parallel):
    model, opt, _ = build(parallel, 0, 0.01)
    ckpt = checkpointer(directory, rank, world, model, opt, Position(2))
    ckpt.keep = 2
    returned = [ckpt.save(step) for step in (2, 4, 6)]
    return [(str(r[0]), r[1] >= 0) if r is not None else None for r in returned], ckpt.last_good()


@pytest.mark.parametrize("parallel", ["ddp", "zero2"])
def test_a_save_returns_its_path_on_rank_0_and_keeps_the_newest_n(parallel, tmp_path):
    (returned0, last_good), (returned1, _) = run_world(three_saves, 2, str(tmp_path), parallel)
    names = [f"step-{s:08d}.pt" if parallel == "ddp" else f"sharded-step-{s:08d}/manifest.json" for s in (2, 4, 6)]
    assert returned0 == [(str(tmp_path / n), True) for n in names]
    assert returned1 == [None, None, None]
    assert [f.path.name for f in find_checkpoints(tmp_path)] == [Path(n).parts[0] for n in names[:0:-1]]
    assert last_good == f"Last good checkpoint kept: {tmp_path / names[-1]}."
    if parallel == "zero2":  # what a plain checkpoint holds beside the model, in the manifest's extra
        extra = json.loads((tmp_path / names[-1]).read_text())["extra"]
        want = {"step": 6, "model_name": "mlp", "parallel": "zero2", "world_size": 2, "generation": 1}
        assert {k: extra[k] for k in want} == want and extra["global_batch"] == 16
        assert extra["data"] == {"epoch": 0, "offset": 2} and len(extra["rng"]["cpu"]) == 2


def a_full_disk(rank, world, directory, parallel):
    import errno
    import os

    from app.parallel.zero import checkpoint as zero_checkpoint
    from app.worker.checkpoint import checkpointer as module
    from app.worker.checkpoint.checkpointer import CheckpointWriteError

    model, opt, _ = build(parallel, 0, 0.01)
    ckpt = checkpointer(directory, rank, world, model, opt, Position(2))
    ckpt.save(2)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    plain = module.save_checkpoint, zero_checkpoint.write_atomically
    module.save_checkpoint = full
    zero_checkpoint.write_atomically = full if rank == 1 else plain[1]
    try:
        ckpt.save(4)
    except CheckpointWriteError as e:
        return str(e)
    finally:
        module.save_checkpoint, zero_checkpoint.write_atomically = plain
    return None


@pytest.mark.parametrize("parallel", ["ddp", "zero2"])
def test_a_save_the_disk_refuses_is_one_error_on_every_rank_naming_the_cause_and_the_last_good_checkpoint(
    parallel, tmp_path
):
    messages = run_world(a_full_disk, 2, str(tmp_path), parallel)
    assert messages[0] == messages[1]
    kept = "step-00000002.pt" if parallel == "ddp" else "sharded-step-00000002/manifest.json"
    start = f"checkpoint_dir {tmp_path} could not take the checkpoint of step 4: No space left on device (ENOSPC)"
    assert messages[0].startswith(start), messages[0]
    assert messages[0].endswith(
        f"Free space or fix the permissions, or point checkpoint_dir elsewhere. Last good checkpoint kept: "
        f"{tmp_path / kept}."
    )
    if parallel == "zero2":  # and the file of the rank that failed first
        assert f", writing {tmp_path / 'sharded-step-00000004'}/shard-00001-of-00002-" in messages[0]


def an_older_plain_checkpoint_under_zero2(rank, world, directory):
    from app.worker.checkpoint.files import load_checkpoint, save_checkpoint

    model, opt, _ = build("ddp", 0, 0.01)
    checkpointer(directory, rank, world, model, opt, Position(2)).save(2)
    torch.distributed.barrier()
    if rank == 0:  # as an older trainer wrote it: without the names of its optimizer's parameters
        path = Path(directory) / "step-00000002.pt"
        state = load_checkpoint(path)
        state = {k: v for k, v in state.items() if k not in ("param_names", "digest", "format")}
        path.unlink()
        save_checkpoint(directory, state, keep=3)
    torch.distributed.barrier()
    model, opt, _ = build("zero2", 1, 0.01)
    try:
        checkpointer(directory, rank, world, model, opt, Position()).resume()
    except CheckpointMismatch as e:
        return str(e)
    return None


def test_a_plain_checkpoint_a_zero_stage_cannot_cut_is_a_mismatch_that_says_to_resume_with_ddp(tmp_path):
    for message in run_world(an_older_plain_checkpoint_under_zero2, 2, str(tmp_path)):
        assert message == (
            f"checkpoint_dir={str(tmp_path)!r}: step-00000002.pt cannot resume under parallel=zero2: it does not name "
            f"its optimizer's parameters (saved by an older trainer); resume with parallel=ddp"
        )


def fp16_then_other_precisions(rank, world, directory):
    """An fp16 run's save (its GradScaler at a scale it reached); a resume with a fresh scaler; one with none."""
    model, opt, _ = build("ddp", 0, 0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # the scale tensor is made at first use
    scaler.update(256.0)  # where a run's overflows had brought it
    checkpointer(directory, rank, world, model, opt, Position(4), grad_scaler=scaler).save(4)
    fresh = torch.amp.GradScaler("cpu")
    model, opt, _ = build("ddp", 1, 0.01)
    checkpointer(directory, rank, world, model, opt, Position(), grad_scaler=fresh).resume()
    model, opt, _ = build("ddp", 1, 0.01)
    without = checkpointer(directory, rank, world, model, opt, Position()).resume()  # a bf16 or fp32 resume
    return fresh.get_scale(), without.step


def test_an_fp16_runs_loss_scale_is_resumed_and_a_run_without_a_scaler_ignores_it(tmp_path):
    # Resumed at the initial scale instead, the first steps after a resume would skip or rescale where the
    # uninterrupted run did not; a resume in another precision has no scaler to give the state to.
    assert run_world(fp16_then_other_precisions, 1, str(tmp_path)) == [(256.0, 4)]
