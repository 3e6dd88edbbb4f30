"""Resume on real ranks: a bad checkpoint_dir stops every rank at start-up, and a resumed run equals a straight one.

The proof: 20 steps straight and 10 steps + resume + 10 steps end with bit-identical parameters (same FINISHED
checksum, equal tensors), with gradient accumulation on and the sampler position restored mid-epoch. Resuming past
a truncated newest checkpoint (from the one before) ends identical too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import torch

from app.checkpoint_dir import MANIFEST, sharded_path
from app.worker.checkpoint.checkpointer import Checkpointer
from app.worker.checkpoint.files import checkpoint_path, list_checkpoints, load_checkpoint
from app.worker.models import MiniMLP, parameter_checksum
from app.world import run_world
from tests.trainer_run import describe, finish, finished, run_process, run_ranks, start_ranks, worker_args


def test_unusable_checkpoint_dir_stops_every_rank_before_training(tmp_path):
    """A file where the directory should be: one line naming checkpoint_dir, exit 2 on both ranks, at start-up
    (not a traceback at the first save while the other rank waits in a collective)."""
    (tmp_path / "ckpt").write_text("not a directory")
    procs = start_ranks(*worker_args("until_stopped", checkpoint_dir=tmp_path / "ckpt"))
    outs = finish(procs, timeout=90)
    assert [p.returncode for p in procs] == [2, 2], outs
    for _, err in outs:
        errors = [line for line in err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1, err
        assert errors[0].startswith(
            f"config error: checkpoint_dir='{tmp_path / 'ckpt'}' (set by flag "
            f"--checkpoint-dir): it exists and is not a directory on rank 0"
        ), err
        assert "Traceback" not in err and "training mini_mlp from step" not in err


def run(tmp_dir, steps: int) -> dict:
    # RUNS["resumable"]: 20 steps span two epochs, so the resume at step 10 lands mid-epoch, then crosses one.
    result = run_ranks(*worker_args("resumable", steps=steps, checkpoint_dir=tmp_dir))
    assert result.returncode == 0, describe(result)
    done = finished(result.stdout)
    assert set(done) == {0, 1}, describe(result)
    assert done[0]["checksum"] == done[1]["checksum"]  # the ranks agree
    return {"checksum": done[0]["checksum"], "step": int(done[0]["step"]), "log": result.stderr}


def test_resume_gives_the_same_parameters_as_a_straight_run(tmp_path):
    straight = run(tmp_path / "straight", 20)
    first = run(tmp_path / "resumed", 10)
    second = run(tmp_path / "resumed", 20)
    assert "resumed from" in second["log"] and "step-00000010.pt" in second["log"]
    assert (straight["step"], first["step"], second["step"]) == (20, 10, 20)
    assert second["checksum"] == straight["checksum"]
    a = load_checkpoint(checkpoint_path(tmp_path / "straight", 20))
    b = load_checkpoint(checkpoint_path(tmp_path / "resumed", 20))
    saved = MiniMLP()
    saved.load_state_dict(a["model"])
    assert parameter_checksum(saved)[:16] == straight["checksum"]  # FINISHED names the model the checkpoint holds
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["data"] == b["data"]

    # Now the newest checkpoint of a 10-step run is torn: every rank resumes from step 5 instead, and still ends
    # with exactly the straight run's parameters.
    torn = tmp_path / "torn"
    shutil.copytree(tmp_path / "resumed", torn)
    for step, path in list_checkpoints(torn):
        if step > 10:
            path.unlink()
    ten = checkpoint_path(torn, 10)
    ten.write_bytes(ten.read_bytes()[:1000])
    again = run(torn, 20)
    assert "step-00000010.pt is unusable" in again["log"]
    assert "step-00000005.pt" in again["log"]
    assert again["checksum"] == straight["checksum"]


def test_plain_ddp_sets_a_damaged_sharded_checkpoint_aside_naming_its_shard_and_resumes_the_one_before(tmp_path):
    """parallel=ddp resuming a ZeRO run's checkpoint_dir (every rank consolidates the shards): a newest checkpoint
    whose shard changed after its manifest was written is set aside with a warning naming that shard and why, and
    the checkpoint before it loads (the zero2 route to the same fallback: tests/integration/test_train_sharded.py)."""
    zero = run_ranks(*worker_args("fixed_global_batch", steps=8, checkpoint_dir=tmp_path, parallel="zero2"))
    assert zero.returncode == 0, describe(zero)  # sharded checkpoints at steps 4 and 8
    newest = sharded_path(tmp_path, 8)
    shard = newest / json.loads((newest / MANIFEST).read_text())["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes() + b"\0")
    ddp = run_ranks(*worker_args("fixed_global_batch", steps=8, checkpoint_dir=tmp_path, parallel="ddp"))
    assert ddp.returncode == 0, describe(ddp)
    assert re.search(
        rf"WARNING checkpoint {re.escape(str(newest))} is unusable \({re.escape(str(shard))}: sha256 \w+\.\.\. "
        r"does not match the manifest's .*\); renamed to sharded-step-00000008\.corrupt; trying the previous one",
        ddp.stderr,
    ), ddp.stderr
    assert re.search(r"resumed from \S+/sharded-step-00000004/manifest\.json \(step 4", ddp.stderr), ddp.stderr


def _rng_round_trip(rank: int, world: int, directory: str) -> dict:
    """Each rank draws from its own CPU stream, a checkpoint is written, the stream moves on, and a resume must put
    every rank back exactly where it was when the checkpoint was written."""
    import torch.distributed as dist

    from app.worker.data import GlobalBatches, teacher_classification
    from app.worker.dist import DistContext

    ctx = DistContext(rank, rank, world, torch.device("cpu"), dist.get_backend())

    def checkpointer(lr: float) -> Checkpointer:
        torch.manual_seed(0)
        model = MiniMLP()
        batches = GlobalBatches(teacher_classification(256, 0), 64, 32, rank, world, 0, ctx.device)
        run = {"model_name": "mini_mlp", "seed": 0, "lr": lr, "global_batch": 64}
        return Checkpointer(
            directory,
            every=5,
            keep=2,
            ctx=ctx,
            model=model,
            optimizer=torch.optim.AdamW(model.parameters()),
            batches=batches,
            **run,
        )

    writer = checkpointer(lr=1e-3)
    torch.manual_seed(100 + rank)
    torch.rand(3 + rank)  # each rank somewhere else in its own stream
    saved = torch.get_rng_state()
    writer.save(5)
    dist.barrier()  # rank 0's file is on disk before anyone resumes
    reader = checkpointer(lr=5e-3)  # a new process, resumed with a new --lr; its stream moved on from the seed
    torch.rand(1000)
    resumed = reader.resume()
    return {
        "step": resumed.step,
        "restored": torch.equal(torch.get_rng_state(), saved),
        "next": torch.rand(1),
        "lr": [group["lr"] for group in reader.optimizer.param_groups],
    }


def test_resume_restores_every_ranks_own_rng_stream(tmp_path):
    out = run_world(_rng_round_trip, 2, str(tmp_path))
    assert [o["step"] for o in out] == [5, 5]
    assert [o["restored"] for o in out] == [True, True]
    assert not torch.equal(out[0]["next"], out[1]["next"])  # rank 1 got its own stream back, not rank 0's
    assert [o["lr"] for o in out] == [[5e-3], [5e-3]]  # the new --lr trains, not the one the checkpoint saved
    # One CPU stream per rank and no CUDA state from a CPU world: a GPU run resuming the file restores CUDA streams
    # only from states a GPU world saved (a placeholder per rank would be handed to torch.cuda.set_rng_state).
    rng = load_checkpoint(checkpoint_path(tmp_path, 5))["rng"]
    assert len(rng["cpu"]) == 2 and rng["cuda"] == [], rng["cuda"]


def test_a_checkpoint_dir_of_another_model_is_a_config_error_exit_2(tmp_path):
    first = run_process(*worker_args("one_process", checkpoint_dir=tmp_path, steps=2), timeout=120)
    assert first.returncode == 0, describe(first)
    other = run_process(
        *worker_args("one_process", checkpoint_dir=tmp_path, steps=4, model="tiny_transformer"), timeout=120
    )
    assert other.returncode == 2, describe(other)
    assert f"config error: checkpoint_dir='{tmp_path}' holds mini_mlp checkpoints but model=tiny_transformer" in (
        other.stderr
    )


@pytest.fixture
def small_disk(tmp_path):
    """A real file system that fills up: a 200 KiB tmpfs (room for about two MiniMLP checkpoints with AdamW)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_checkpoint_disk_stops_every_rank_with_one_line_and_keeps_the_last_good_checkpoint(small_disk):
    ckpt = small_disk / "ckpt"
    procs = start_ranks(*worker_args("nan_drill", inject_nan_at_step=0, checkpoint_dir=ckpt, keep_checkpoints=5))
    outs = finish(procs, timeout=180)
    assert [p.returncode for p in procs] == [74, 74], outs  # STORAGE_FAILED: the launcher does not retry it
    for _, err in outs:
        errors = [line for line in err.splitlines() if " ERROR " in line or line.startswith("error")]
        assert len(errors) == 1, err
        assert f"checkpoint_dir {ckpt} could not take the checkpoint of step" in errors[0], err
        assert "No space left on device (ENOSPC)" in errors[0] and "Last good checkpoint kept" in errors[0], err
        assert "Traceback" not in err and "went away" not in err, err
    kept = sorted(p.name for p in ckpt.iterdir())
    assert kept and not [name for name in kept if ".tmp-" in name], kept  # no half-written file left behind
    newest = max(p for p in ckpt.glob("step-*.pt"))
    assert newest.name in errors[0]
    state = load_checkpoint(newest)  # checks the digest: the last good one is whole
    assert state["step"] % 5 == 0
