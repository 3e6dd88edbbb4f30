"""What a ``checkpoint_dir`` holds, found by name, and the one retention policy for both kinds of checkpoint.

    <checkpoint_dir>/
      step-00000050.pt             a plain checkpoint (parallel=ddp, pipeline): one file, app.worker.checkpoint.files
      sharded-step-00000060/       a sharded one (parallel=zero1|zero2|zero3), app.parallel.zero.checkpoint:
        shard-00000-of-00002-*.pt    one file per rank of the world that saved it,
        manifest.json                written last: without it the directory is a save that did not finish
      manifest.json, shard-*.pt    the sharded layout before step directories: one checkpoint, at its manifest's step
      *.corrupt                    set aside by a resume that could not load it: kept for inspection, never counted

``find_checkpoints`` lists both kinds together, newest step first: a run that moved from ddp to zero3 resumes
from whichever is newer and keeps the newest ``keep_checkpoints`` of either kind. ``prune`` is that policy, called by
rank 0 once a save is complete; ``newest_sharded`` is where every reader of the sharded layout (``app.export``,
the compose drills) finds the newest complete sharded checkpoint.

Torch-free: the launcher's free-space check (app.cluster.launch) reads it before importing torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PLAIN, SHARDED = "plain", "sharded"
MANIFEST = "manifest.json"  # a sharded checkpoint's commit point: written last, atomically
_PLAIN_NAME = re.compile(r"^step-(\d{8,})\.pt$")
_SHARDED_NAME = re.compile(r"^sharded-step-(\d{8,})$")
STALE_TEMP_S = 60  # a writer's temporary file older than this is a crashed writer's, not a live one's


@dataclass(frozen=True)
class Found:
    """One checkpoint in a checkpoint_dir."""

    step: int  # -1: an old-layout manifest too damaged to say its step (tried last)
    kind: str  # PLAIN or SHARDED
    path: Path  # the file, or the directory holding the shards and manifest (the checkpoint_dir for the old layout)
    complete: bool = True  # False: a sharded directory without its manifest (a save that did not finish)
    old_layout: bool = False  # shards and manifest at the top of checkpoint_dir (``path``), beside everything else

    @property
    def named(self) -> Path:
        """What a log line names: the file, or a sharded checkpoint's manifest (its commit point)."""
        return self.path / MANIFEST if self.kind == SHARDED else self.path


def plain_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.pt"


def sharded_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"sharded-step-{step:08d}"


def find_checkpoints(directory: str | Path, *, incomplete: bool = False) -> list[Found]:
    """Every checkpoint in ``directory``, both kinds, newest step first (at one step, the sharded one first).

    ``incomplete``: also the sharded directories without a manifest (what resume skips and ``prune`` removes).
    """
    d = Path(directory)
    if not d.is_dir():
        return []
    found = []
    for name in os.listdir(d):
        if m := _PLAIN_NAME.match(name):
            found.append(Found(int(m[1]), PLAIN, d / name))
        elif (m := _SHARDED_NAME.match(name)) and (d / name).is_dir():
            complete = (d / name / MANIFEST).is_file()
            if complete or incomplete:
                found.append(Found(int(m[1]), SHARDED, d / name, complete))
    if (d / MANIFEST).is_file():  # the old layout: a user's existing checkpoint still counts (and resumes)
        found.append(Found(_old_layout_step(d / MANIFEST), SHARDED, d, old_layout=True))
    return sorted(found, key=lambda f: (f.step, f.kind == SHARDED), reverse=True)


def _old_layout_step(manifest: Path) -> int:
    try:
        return int(json.loads(manifest.read_text())["extra"]["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1  # still listed: resume tries it last and says why it cannot load it


def newest_sharded(directory: str | Path) -> Path | None:
    """The directory of the newest complete sharded checkpoint in ``directory`` (for the old layout, ``directory``
    itself), or None. Complete means its manifest is there; whether its shards match it, loading tells."""
    return next((f.path for f in find_checkpoints(directory) if f.kind == SHARDED), None)


def checkpoint_bytes(found: Found) -> int:
    """The bytes ``found`` takes on disk: the file, or every finished file of a sharded checkpoint."""
    if found.kind == PLAIN:
        return found.path.stat().st_size
    return sum(
        e.stat().st_size
        for e in os.scandir(found.path)
        if e.is_file() and not e.name.startswith(".") and (not found.old_layout or _is_part_of_old_layout(e.name))
    )


def _is_shard(name: str) -> bool:
    return name.startswith("shard-") and name.endswith(".pt")


def _is_part_of_old_layout(name: str) -> bool:
    return name == MANIFEST or _is_shard(name)


def prune(directory: str | Path, keep: int, newest: int) -> None:
    """Keep the ``keep`` newest checkpoints at or below step ``newest`` (the one just written), of both kinds
    together; delete the older ones, the unfinished sharded saves below it and crashed writers' temporary files.

    Only rank 0 calls it, once the new checkpoint is complete. Checkpoints above ``newest`` are left alone: this
    writer did not produce them, so they are unvalidated (a resume that skipped them sets them aside) or someone
    else's; counting them would let a torn save with a higher step delete the good one just written. A deletion
    the file system refuses is a warning, not a failed save: the new checkpoint is whole.
    """
    d = Path(directory)
    below = [f for f in find_checkpoints(d, incomplete=True) if f.step <= newest]
    complete = [f for f in below if f.complete]
    for found in complete[max(keep, 1) :] + [f for f in below if not f.complete]:
        _delete(found)
    for stale in d.glob(".step-*.pt.tmp-*"):  # left by a writer that crashed mid-write
        if stale.stat().st_mtime < time.time() - STALE_TEMP_S:
            stale.unlink(missing_ok=True)


def _delete(found: Found) -> None:
    try:
        if found.kind == PLAIN:
            found.path.unlink(missing_ok=True)
        elif not found.old_layout:
            # The manifest first: a deletion cut short leaves a directory that is no checkpoint, not a broken one.
            (found.path / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(found.path)
        else:  # the old layout, at the top of checkpoint_dir: its manifest, then the shards
            (found.path / MANIFEST).unlink(missing_ok=True)
            for e in os.scandir(found.path):
                if e.is_file() and _is_shard(e.name):
                    os.unlink(e.path)
    except OSError as e:
        log.warning("could not delete the older checkpoint %s (%s); delete it by hand", found.path, e.strerror)


def set_aside(found: Found) -> str:
    """Rename a checkpoint that would not load to ``<name>.corrupt`` (for the old layout: its manifest): kept for
    inspection, no longer counted or tried. Returns what was done, for the log line."""
    path = found.path / MANIFEST if found.old_layout else found.path
    aside = path.with_name(path.name + ".corrupt")
    try:
        os.replace(path, aside)
    except OSError as e:
        return f"could not rename it to {aside.name} ({e.strerror})"
    return f"renamed to {aside.name}"
