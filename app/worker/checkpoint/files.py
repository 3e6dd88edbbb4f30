"""Checkpoint files that survive crashes: written atomically, validated on load, the last K kept.

Layout: ``<checkpoint_dir>/step-00000050.pt`` (zero-padded so names sort by step). One file holds::

    {"format": 1, "step": 50, "model_name": "mini_mlp", "world_size": 4,
     "model": <the *unwrapped* model's state_dict()>,   # loads into the bare model, no DDP prefix "module."
     "optimizer": <optimizer.state_dict()>,
     "data": {"epoch": 0, "consumed": 6400},            # sampler position, counted over all ranks
     "rng": {"cpu": [<uint8 tensor per rank>], "cuda": [...]},
     "generation": 2, "wall_time": 1764530000.0,        # worlds formed so far; when it was written (unix s)
     "global_batch": 128,                               # samples per step, to warn when a resume changes it
     "digest": "<sha256 over everything above>"}

Only tensors, dicts, lists, strings and numbers: ``torch.load(..., weights_only=True)`` loads it without running
pickled code. Writing: temp file in the same directory, flush + fsync, ``os.replace`` (atomic on POSIX), fsync the
directory; a crash at any moment leaves either the old set of files or the new one, never a half-written
``step-*.pt``. Loading: a file that ``torch.load`` rejects (truncated) or whose digest does not match (bits changed)
is reported with a warning naming it, renamed to ``step-XXXXXXXX.pt.corrupt`` (kept for inspection, no longer counted
as a checkpoint) and the next older one is tried. Pruning (``app.checkpoint_dir.prune``, the one policy for plain
and sharded checkpoints) keeps the newest ``keep`` up to and including the one just written and never deletes
anything newer: a torn file with a higher step never pushes a good one out.

The ``Checkpointer`` (``checkpointer.py``) is what the training loop uses; this module is the file format:
writing, listing, loading and validating ``step-*.pt`` files.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import mmap
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from app.checkpoint_dir import PLAIN, Found, find_checkpoints, plain_path, prune, set_aside
from app.cli import first_line
from app.files import write_atomically

log = logging.getLogger(__name__)

FORMAT = 1
REQUIRED = ("format", "step", "model_name", "model", "optimizer", "data", "rng", "digest")


checkpoint_path = plain_path  # this module's name for it, as its callers know it


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every plain checkpoint file in ``directory``, newest (highest step) first."""
    return [(f.step, f.path) for f in find_checkpoints(directory) if f.kind == PLAIN]


def digest(state: dict[str, Any], after: Callable[[torch.Tensor], None] | None = None) -> str:
    """sha256 over every value in ``state`` except "digest", walked in a fixed order; ``after(tensor)`` is called
    on each tensor once it is hashed.

    torch's zip format has no checksum of its own that ``torch.load`` verifies: a flipped bit inside a tensor
    would load silently. This catches it.
    """
    h = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy of its bytes
            if after is not None:
                after(value)
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                h.update(f"K{key!r}".encode())
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            h.update(f"L{len(value)}".encode())
            for item in value:
                walk(item)
        else:
            h.update(f"V{value!r}".encode())

    walk({k: v for k, v in state.items() if k != "digest"})
    return h.hexdigest()


def directory_problem(directory: str | Path) -> str | None:
    """Create ``directory`` if missing and write a probe file in it: None when checkpoints can be written there,
    else why not (one line). Run at start-up, so a bad path fails before training rather than at the first save."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "it exists and is not a directory"
    except OSError as e:
        return f"cannot create it ({e.strerror})"
    try:
        with tempfile.NamedTemporaryFile(dir=d, prefix=".write-test-"):
            pass
    except OSError as e:
        return f"cannot write in it ({e.strerror})"
    return None


def checkpoint_dir_problem(directory: str | Path, is_main: bool) -> str | None:
    """``directory_problem`` as rank 0 sees it, on every rank (a broadcast: every rank must call this)."""
    verdict = [directory_problem(directory) if is_main else None]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def save_checkpoint(directory: str | Path, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` (which must hold "step") atomically as ``step-XXXXXXXX.pt``; keep the newest ``keep``
    checkpoints of either kind (``app.checkpoint_dir.prune``)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {**state, "format": FORMAT}
    state["digest"] = digest(state)
    final = checkpoint_path(d, int(state["step"]))
    write_atomically(final, lambda f: torch.save(state, f))
    prune(d, keep, newest=int(state["step"]))
    return final


def load_checkpoint(path: str | Path, *, mapped: bool = False) -> dict[str, Any]:
    """Load and validate one checkpoint onto the CPU; raises ValueError (or torch's error) when it is unusable.

    ``mapped``: the tensors stay in the file, mapped (``torch.load(mmap=True)``), none of their pages resident once
    checked; the caller copies what it keeps, tensor by tensor (``copy_out``, ``release``). See [Note: a plain
    checkpoint loaded beside the model]."""
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED):
        raise ValueError("not a checkpoint of this trainer (keys missing)")
    if state["format"] != FORMAT:
        raise ValueError(f"checkpoint format {state['format']}, this trainer reads format {FORMAT}")
    if digest(state, after=release if mapped else None) != state["digest"]:
        raise ValueError("content does not match its digest (corrupted on disk)")
    return state


# [Note: a plain checkpoint loaded beside the model] A resuming DDP rank holds its model and its gradient buckets
# (built before the resume) when it reads the checkpoint, parameters and optimizer state (12 bytes a parameter with
# AdamW). Loaded whole, the file's copy of the parameters sits beside the model's for nothing: 20 bytes a parameter
# at once, above the 16 of training. Mapped instead, each tensor's pages are resident only while it is read: hashed
# for the digest, then dropped again (``release``); copied into the model, then dropped; the optimizer state copied
# out tensor by tensor (``copy_out``). The peak is the model, its buckets and the optimizer state: training's.
_MADV_DONTNEED = 4  # Linux's <sys/mman.h>
_PAGE = mmap.PAGESIZE  # madvise takes a page-aligned start: 4 KiB on x86-64, up to 64 KiB on arm64


def release(t: torch.Tensor) -> None:
    """Drop this process's pages under ``t``, a tensor of a file mapped by ``load_checkpoint(mapped=True)`` and
    never written: they stay in the page cache, and are read again if ``t`` is. A no-op where madvise is missing."""
    libc = _libc()
    if libc is None or not t.numel():
        return
    storage = t.untyped_storage()
    lo = storage.data_ptr() // _PAGE * _PAGE  # a page shared with a neighbour is read again if the neighbour is
    hi = storage.data_ptr() + storage.nbytes()
    libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


def copy_out(value: Any) -> Any:
    """``value`` with each tensor replaced by a copy in this process's memory, its mapped pages released as it goes
    (dicts, lists and tuples walked): what is kept of a mapped checkpoint once it is closed."""
    if isinstance(value, torch.Tensor):
        copy = value.clone()
        release(value)
        return copy
    if isinstance(value, dict):
        return {k: copy_out(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copy_out(v) for v in value)
    return value


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "madvise") else None
    except OSError:
        return None


def load_latest(directory: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in ``directory`` that loads and validates, or None.

    Each one rejected on the way is renamed ``<name>.corrupt``: kept for inspection, but no longer a checkpoint,
    so it neither counts towards ``keep`` nor gets tried again. Only rank 0 calls this.
    """
    for step, path in list_checkpoints(directory):
        try:
            return path, load_checkpoint(path)
        except Exception as e:  # noqa: BLE001 - any failure to read means "unusable": fall back to the previous
            reason = unusable_reason(e)
            aside = set_aside(Found(step, PLAIN, path))
            log.warning("checkpoint %s is unusable (%s); %s; trying the previous one", path, reason, aside)
    return None


def unusable_reason(e: Exception) -> str:
    """Why ``load_checkpoint`` failed, on one line (torch.load's own message runs to many)."""
    reason = first_line(e)
    if reason.startswith("Weights only load failed"):
        # torch's text goes on to advise weights_only=False: never the advice for a file of unknown origin.
        detail = first_line(str(e).partition("WeightsUnpickler error:")[2])
        reason = "refused by the weights-only loader" + (f": {detail.split(' Please')[0]}" if detail else "")
    return reason
