"""Checkpoints on disk: atomic writes, the last K kept, corrupt files skipped, unusable directories refused."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import app.worker.checkpoint.files
from app.worker.checkpoint.files import (
    checkpoint_path,
    directory_problem,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)
from app.worker.models import MiniMLP


def state(step: int) -> dict:
    torch.manual_seed(step)
    model = MiniMLP()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return {
        "step": step,
        "model_name": "mini_mlp",
        "world_size": 1,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "data": {"epoch": 0, "consumed": step * 32},
        "rng": {"cpu": [torch.get_rng_state()], "cuda": []},
    }


def test_save_is_atomic_and_keeps_the_last_k(tmp_path):
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, state(step), keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 30]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000030.pt", "step-00000040.pt"]  # no temp files
    loaded = load_checkpoint(checkpoint_path(tmp_path, 40))
    assert loaded["step"] == 40 and loaded["data"] == {"epoch": 0, "consumed": 1280}
    bare = MiniMLP()
    bare.load_state_dict(loaded["model"])  # the bare model, no wrapper, no "module." prefix
    assert torch.equal(bare.net[0].weight, state(40)["model"]["net.0.weight"])


def test_truncated_newest_falls_back_to_previous(tmp_path, caplog):
    for step in (10, 20):
        save_checkpoint(tmp_path, state(step), keep=3)
    newest = checkpoint_path(tmp_path, 20)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a crash mid-copy, a full disk
    with caplog.at_level(logging.WARNING):
        path, loaded = load_latest(tmp_path)
    assert path == checkpoint_path(tmp_path, 10) and loaded["step"] == 10
    assert "step-00000020.pt is unusable" in caplog.text and "renamed to step-00000020.pt.corrupt" in caplog.text
    # Set aside for inspection, no longer a checkpoint: not counted towards keep, not tried again.
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]
    assert (tmp_path / "step-00000020.pt.corrupt").exists()


def test_a_file_the_weights_only_loader_refuses_is_named_so_and_the_previous_one_loads(tmp_path, caplog):
    import argparse

    save_checkpoint(tmp_path, state(10), keep=3)
    torch.save({**state(20), "extra": argparse.Namespace(x=1)}, checkpoint_path(tmp_path, 20))  # not just tensors
    with caplog.at_level(logging.WARNING):
        path, loaded = load_latest(tmp_path)
    assert path == checkpoint_path(tmp_path, 10) and loaded["step"] == 10
    assert "step-00000020.pt is unusable (refused by the weights-only loader: Unsupported global" in caplog.text
    assert "weights_only=False" not in caplog.text  # torch's advice, never ours for a file of unknown origin


def torn(directory, step: int) -> None:
    """A checkpoint cut in half, as a crash mid-copy or a full disk leaves it."""
    save_checkpoint(directory, state(step), keep=10)
    path = checkpoint_path(directory, step)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_torn_newer_checkpoint_never_pushes_good_ones_out(tmp_path):
    torn(tmp_path, 100)
    assert load_latest(tmp_path) is None  # what a run finds at start-up: nothing usable, so it trains from step 0
    for step in (50, 60):
        save_checkpoint(tmp_path, state(step), keep=2)
    path, loaded = load_latest(tmp_path)  # the next resume
    assert path == checkpoint_path(tmp_path, 60) and loaded["step"] == 60
    assert checkpoint_path(tmp_path, 50).exists() and checkpoint_path(tmp_path, 60).exists()
    assert (tmp_path / "step-00000100.pt.corrupt").exists()


def test_keep_1_never_deletes_the_checkpoint_just_written(tmp_path):
    torn(tmp_path, 100)  # newer than anything this run writes, and not looked at yet
    save_checkpoint(tmp_path, state(50), keep=1)
    assert checkpoint_path(tmp_path, 50).exists()
    path, loaded = load_latest(tmp_path)
    assert path == checkpoint_path(tmp_path, 50) and loaded["step"] == 50  # not step 0
    save_checkpoint(tmp_path, state(60), keep=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [60]  # keep=1 still keeps one


def test_flipped_bits_are_detected(tmp_path, caplog):
    for step in (10, 20):
        save_checkpoint(tmp_path, state(step), keep=3)
    newest = checkpoint_path(tmp_path, 20)
    data = bytearray(newest.read_bytes())
    # Inside a tensor's bytes: torch.load alone would not notice (the zip records carry no checked CRC).
    weight = state(20)["model"]["net.0.weight"].numpy().tobytes()
    at = bytes(data).index(weight[:64]) + 8
    data[at] ^= 0xFF
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        path, _ = load_latest(tmp_path)
    assert path == checkpoint_path(tmp_path, 10)
    assert "does not match its digest" in caplog.text


def test_empty_or_missing_dir_has_no_checkpoint(tmp_path):
    assert load_latest(tmp_path) is None
    assert load_latest(tmp_path / "nope") is None


def test_checkpoint_dir_is_created_and_probed(tmp_path):
    assert directory_problem(tmp_path / "a" / "b") is None and (tmp_path / "a" / "b").is_dir()
    assert list((tmp_path / "a" / "b").iterdir()) == []  # the probe file is gone
    (tmp_path / "file").write_text("")
    assert directory_problem(tmp_path / "file") == "it exists and is not a directory"
    assert directory_problem(tmp_path / "file" / "sub") == "cannot create it (Not a directory)"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only (0o555) directory anyway")
def test_read_only_checkpoint_dir_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    assert directory_problem(tmp_path / "ro") == "cannot write in it (Permission denied)"


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to an unprivileged user (the test above runs)")
def test_read_only_checkpoint_dir_is_refused_for_an_unprivileged_user():
    """What a container running as a non-root user meets on a volume it may not write: the probe says so.

    Root writes anywhere, so the probe runs in a child process that drops to uid/gid 65534 after its imports.
    """
    with tempfile.TemporaryDirectory() as top:
        os.chmod(top, 0o755)  # traversable by the unprivileged user (pytest's own tmp dirs are 0o700)
        ro, rw = Path(top) / "ro", Path(top) / "rw"
        ro.mkdir(mode=0o555)
        rw.mkdir(mode=0o777)
        os.chmod(rw, 0o777)  # the umask may have removed bits
        code = (
            "import os, sys; from app.worker.checkpoint.files import directory_problem; "
            f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY}); "
            "print(directory_problem(sys.argv[1])); print(directory_problem(sys.argv[2]))"
        )
        result = subprocess.run(
            [sys.executable, "-c", code, str(ro), str(rw)],
            cwd=Path(app.worker.checkpoint.files.__file__).parents[1],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["cannot write in it (Permission denied)", "None"]


# -- the write protocol: temp file → fsync → os.replace → fsync of the directory --------------------------------------
def test_a_crash_mid_write_leaves_the_previous_checkpoint_newest_and_loadable(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, state(10), keep=3)
    real_save = torch.save

    def crash_mid_write(obj, f):
        real_save(obj, f)
        f.truncate(f.tell() // 2)  # half the bytes reached the file, then the process died
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(app.worker.checkpoint.files.torch, "save", crash_mid_write)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, state(20), keep=3)
    monkeypatch.undo()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]  # no half-written file counts as a checkpoint
    path, loaded = load_latest(tmp_path)
    assert path == checkpoint_path(tmp_path, 10) and loaded["step"] == 10


def test_a_crash_before_the_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, state(10), keep=3)

    def crash(src, dst):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, state(20), keep=3)
    monkeypatch.undo()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]
    assert load_latest(tmp_path)[1]["step"] == 10


def test_the_bytes_are_durable_before_the_name_and_the_name_before_returning(tmp_path, monkeypatch):
    """The order that makes a save crash-safe, observed on the real system calls (which still run)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    final = save_checkpoint(tmp_path, state(10), keep=3)
    monkeypatch.undo()
    (_, synced_file), (_, tmp, renamed_to), (_, synced_dir) = events
    assert Path(synced_file) == Path(tmp) and Path(tmp).parent == tmp_path and Path(tmp) != final
    assert Path(renamed_to) == final and Path(synced_dir) == tmp_path
    assert load_checkpoint(final)["step"] == 10


def test_a_crashed_writers_temp_file_is_cleaned_and_a_live_writers_is_left(tmp_path):
    crashed = tmp_path / ".step-00000010.pt.tmp-4242"  # a writer that died mid-write an hour ago
    live = tmp_path / ".step-00000030.pt.tmp-4343"  # another process writing right now (a second job, a copy)
    for path in (crashed, live):
        path.write_bytes(b"half a checkpoint")
    hour_ago = os.path.getmtime(live) - 3600
    os.utime(crashed, (hour_ago, hour_ago))
    save_checkpoint(tmp_path, state(20), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "step-00000020.pt"]


@pytest.mark.parametrize("content", [None, b"not a checkpoint"], ids=["absent", "unreadable"])
def test_a_rank_that_cannot_read_rank_0s_choice_names_the_shared_storage(tmp_path, content):
    # checkpoint_dir on each node's own disk: rank 0 finds step 4, its peer has no such file (or another one).
    from types import SimpleNamespace

    from app.worker.checkpoint.checkpointer import Checkpointer

    path = tmp_path / "step-00000004.pt"
    if content is not None:
        path.write_bytes(content)
    ckpt = Checkpointer(
        str(tmp_path), every=2, keep=2, ctx=SimpleNamespace(rank=1), model=None, optimizer=None, batches=None,
        model_name="mini_mlp", seed=0, lr=0.1, global_batch=8,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"rank 1 cannot read .*checkpoint_dir must be storage shared by all ranks"):
        ckpt._load_on_peer(path)  # one line: the regex's `.` stops at a newline


def test_rank_0_notes_the_last_step_it_reached_which_a_resume_counts_as_redone(tmp_path):
    # progress.json is how a resume knows how many steps the lost world had trained past its checkpoint
    # (ddp_steps_redone_total): rank 0 writes it, the others and a run without checkpoint_dir do not.
    import json
    from types import SimpleNamespace

    from app.worker.checkpoint.checkpointer import Checkpointer

    def checkpointer(directory: str, rank: int) -> Checkpointer:
        ctx = SimpleNamespace(rank=rank, is_main=rank == 0)
        return Checkpointer(
            directory, every=2, keep=2, ctx=ctx, model=None, optimizer=None, batches=None,
            model_name="mini_mlp", seed=0, lr=0.1, global_batch=8,
        )  # fmt: skip

    (tmp_path / "peer").mkdir()
    checkpointer(str(tmp_path / "peer"), 1).note_progress(7)
    assert not any((tmp_path / "peer").iterdir())
    checkpointer("", 0).note_progress(7)  # no checkpoint_dir: nothing anywhere, no error
    checkpointer(str(tmp_path), 0).note_progress(7)
    checkpointer(str(tmp_path), 0).note_progress(9)
    assert json.loads((tmp_path / "progress.json").read_text()) == {"step": 9}


def _rss() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS (Linux)")
def test_a_mapped_load_checks_the_digest_without_keeping_the_file_in_memory(tmp_path):
    # A resuming DDP rank already holds its model: the checkpoint's copy of it must not sit beside it (issue 37).
    from app.worker.checkpoint.files import copy_out, release

    big = {**state(1), "model": {"weight": torch.randn(16 * 2**20)}}  # 64 MiB
    path = save_checkpoint(tmp_path, big, keep=1)
    before = _rss()
    mapped = load_checkpoint(path, mapped=True)  # every byte read: the digest is checked
    assert _rss() - before < 8 * 2**20
    weight = mapped["model"]["weight"]
    kept = torch.empty_like(weight).copy_(weight)
    release(weight)
    assert torch.equal(kept, big["model"]["weight"]) and _rss() - before < 72 * 2**20  # the copy, not the file too
    assert torch.equal(copy_out(mapped["optimizer"])["state"][0]["exp_avg"], big["optimizer"]["state"][0]["exp_avg"])
    del mapped, weight, kept
    with pytest.raises(ValueError, match="digest"):  # still checked: a flipped byte in the tensor's bytes
        raw = bytearray(path.read_bytes())
        at = raw.find(big["model"]["weight"][:4].numpy().tobytes())
        raw[at] ^= 0xFF
        path.write_bytes(bytes(raw))
        load_checkpoint(path, mapped=True)
