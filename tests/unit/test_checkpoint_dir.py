"""What a checkpoint_dir holds (app.checkpoint_dir): both kinds listed together by step, the one retention policy,
the older sharded layout still counted, an unfinished sharded save never taken for a checkpoint. Files only: the
runs that write them are tests/integration/test_train_sharded.py's."""

from __future__ import annotations

import json
import os
from pathlib import Path

from app.checkpoint_dir import (
    MANIFEST,
    PLAIN,
    SHARDED,
    checkpoint_bytes,
    find_checkpoints,
    newest_sharded,
    plain_path,
    prune,
    set_aside,
    sharded_path,
)


def plain(directory: Path, step: int, size: int = 10) -> Path:
    path = plain_path(directory, step)
    path.write_bytes(b"p" * size)
    return path


def sharded(directory: Path, step: int, *, manifest: bool = True, shard_bytes: int = 20) -> Path:
    """A sharded checkpoint's directory: two shards, and its manifest unless the save "died" before it."""
    d = sharded_path(directory, step)
    d.mkdir()
    for rank in range(2):
        (d / f"shard-{rank:05d}-of-00002-abcd.pt").write_bytes(b"s" * shard_bytes)
    if manifest:
        (d / MANIFEST).write_text(json.dumps({"extra": {"step": step}}))
    return d


def old_layout(directory: Path, step: int) -> None:
    """Shards and manifest at the top of checkpoint_dir: what a sharded save wrote before step directories."""
    for rank in range(2):
        (directory / f"shard-{rank:05d}-of-00002-ef01.pt").write_bytes(b"o" * 30)
    (directory / MANIFEST).write_text(json.dumps({"extra": {"step": step}}))


def listed(directory: Path, **kwargs) -> list[tuple[int, str]]:
    return [(f.step, f.kind) for f in find_checkpoints(directory, **kwargs)]


def test_both_kinds_are_listed_together_newest_step_first_and_an_unfinished_save_is_no_checkpoint(tmp_path):
    plain(tmp_path, 2)
    plain(tmp_path, 4)
    sharded(tmp_path, 6)
    sharded(tmp_path, 8, manifest=False)  # a save killed before its manifest
    (tmp_path / "sharded-step-00000003.corrupt").mkdir()  # set aside by an earlier resume
    (tmp_path / "progress.json").write_text("{}")
    assert listed(tmp_path) == [(6, SHARDED), (4, PLAIN), (2, PLAIN)]
    assert listed(tmp_path, incomplete=True) == [(8, SHARDED), (6, SHARDED), (4, PLAIN), (2, PLAIN)]
    assert newest_sharded(tmp_path) == sharded_path(tmp_path, 6)
    assert find_checkpoints(tmp_path / "absent") == [] and newest_sharded(tmp_path / "absent") is None


def test_the_old_layout_is_one_sharded_checkpoint_at_its_manifests_step(tmp_path):
    old_layout(tmp_path, 5)
    plain(tmp_path, 4)
    sharded(tmp_path, 3)
    (old,) = [f for f in find_checkpoints(tmp_path) if f.old_layout]
    assert (old.step, old.kind, old.path, old.named) == (5, SHARDED, tmp_path, tmp_path / MANIFEST)
    assert listed(tmp_path) == [(5, SHARDED), (4, PLAIN), (3, SHARDED)]
    assert newest_sharded(tmp_path) == tmp_path  # consolidate / load_sharded read the manifest at the top
    assert checkpoint_bytes(old) == 2 * 30 + (tmp_path / MANIFEST).stat().st_size  # its files, not the others
    (tmp_path / MANIFEST).write_text("{not json")
    assert listed(tmp_path)[-1] == (-1, SHARDED)  # still there (tried last, its error said), never lost silently


def test_prune_keeps_the_newest_n_of_either_kind_and_deletes_the_older_ones_whole(tmp_path):
    for step in (2, 4):
        plain(tmp_path, step)
    for step in (6, 8):
        sharded(tmp_path, step)
    sharded(tmp_path, 5, manifest=False)  # an unfinished save below the newest: removed
    prune(tmp_path, keep=3, newest=8)
    assert listed(tmp_path, incomplete=True) == [(8, SHARDED), (6, SHARDED), (4, PLAIN)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "sharded-step-00000006",
        "sharded-step-00000008",
        "step-00000004.pt",
    ]
    plain(tmp_path, 10)
    prune(tmp_path, keep=1, newest=10)  # back to plain ddp, keep 1: the sharded ones go too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010.pt"]


def test_prune_leaves_what_is_above_the_step_just_written_and_what_was_set_aside(tmp_path):
    sharded(tmp_path, 4)
    sharded(tmp_path, 6)
    sharded(tmp_path, 12, manifest=False)  # a lost world's save in progress, above this writer's step
    plain(tmp_path, 14)  # unvalidated: a torn file with a higher step must not push the good one out
    aside = sharded(tmp_path, 5).rename(tmp_path / "sharded-step-00000005.corrupt")
    prune(tmp_path, keep=1, newest=6)
    assert listed(tmp_path, incomplete=True) == [(14, PLAIN), (12, SHARDED), (6, SHARDED)]
    assert aside.is_dir() and len(list(aside.iterdir())) == 3  # kept whole, for inspection


def test_prune_deletes_the_old_layout_once_it_is_older_than_the_newest_n_and_only_its_files(tmp_path):
    old_layout(tmp_path, 4)
    (tmp_path / "progress.json").write_text("{}")
    sharded(tmp_path, 6)
    prune(tmp_path, keep=2, newest=6)
    assert listed(tmp_path) == [(6, SHARDED), (4, SHARDED)]  # still among the newest 2: kept
    sharded(tmp_path, 8)
    prune(tmp_path, keep=2, newest=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "progress.json",
        "sharded-step-00000006",
        "sharded-step-00000008",
    ]


def test_a_damaged_checkpoint_is_set_aside_under_a_name_no_listing_counts(tmp_path):
    d = sharded(tmp_path, 6)
    p = plain(tmp_path, 4)
    old_layout(tmp_path, 2)
    said = [set_aside(f) for f in find_checkpoints(tmp_path)]
    assert said == [
        "renamed to sharded-step-00000006.corrupt",
        "renamed to step-00000004.pt.corrupt",
        "renamed to manifest.json.corrupt",
    ]
    assert find_checkpoints(tmp_path, incomplete=True) == []
    assert not d.exists() and not p.exists() and (tmp_path / "sharded-step-00000006.corrupt" / MANIFEST).is_file()


def test_the_size_of_a_sharded_checkpoint_is_its_finished_files(tmp_path):
    d = sharded(tmp_path, 6, shard_bytes=100)
    (d / ".shard-00001-of-00002-abcd.pt.tmp-77").write_bytes(b"t" * 5000)  # a writer's temporary file
    (found,) = find_checkpoints(tmp_path)
    assert checkpoint_bytes(found) == 200 + (d / MANIFEST).stat().st_size
    os.remove(d / MANIFEST)
    assert find_checkpoints(tmp_path) == []
