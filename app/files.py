"""The one atomic write: a file is whole or absent, also across a crash (temporary file, fsync, rename, fsync).

Checkpoints (plain and sharded), the launcher's job records and ``make up``'s env file all write through it::

    from app.files import write_atomically, write_text_atomically
    write_atomically(path, lambda f: torch.save(state, f))   # returns what the writer returned
    write_text_atomically(path, "KEY=value\\n")

Torch-free: the launcher calls it before, or without, importing torch.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable: without it a crash may keep the file's bytes but lose its name."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Any:
    """``write(file)`` into a temporary file beside ``path``, then fsync, rename over ``path`` and fsync the directory.

    A reader sees the old file or the new one, never half of one; a writer that raises (a full disk) leaves the old
    file as it was and no temporary file behind. Returns what ``write`` returned.
    """
    path = Path(path)
    # Beside it: os.replace must not cross file systems. The pid alone does not make the name unique: containers that
    # share a volume run their launchers as the same pid, and two of them write the job's finish record at once.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "xb") as f:  # x: never into another writer's file
            result = write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes on disk before the rename makes them visible
        os.replace(tmp, path)
        fsync_directory(path.parent)
        return result
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """``text`` (UTF-8) written to ``path`` by ``write_atomically``."""
    write_atomically(path, lambda f: f.write(text.encode("utf-8")))
