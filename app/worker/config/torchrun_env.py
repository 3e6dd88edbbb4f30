"""Where this process sits in the world, as torchrun's environment describes it: ``WorldEnv``, torch-free.

torchrun exports RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK and TORCHELASTIC_RESTART_COUNT to every
process it starts; without torchrun the defaults are a world of one. Read once by ``app.train`` and handed to the
config checks, the metrics and the process group (``app.worker.dist``)::

    world = WorldEnv.from_environ()
    print(world.rank, world.world_size, world.min_world_size, world.max_world_size)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class WorldEnv:
    """Where this process sits, as torchrun (or nothing: a world of one) describes it.

    ``min_world_size``/``max_world_size`` are the elastic range: torchrun's ``--nnodes MIN:MAX`` times the processes
    per node (both the world size when the world is static). ``restart_count`` is TORCHELASTIC_RESTART_COUNT: how
    often this rank's agent has restarted its workers.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node: str = "0"
    restart_count: int = 0
    min_world_size: int = 1
    max_world_size: int = 1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorldEnv:
        """Read torchrun's variables.

        Example::

            >>> WorldEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
            WorldEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, node='0', restart_count=0, ...)
        """
        environ = os.environ if environ is None else environ
        rank = int(environ.get("RANK", "0"))
        local_rank = int(environ.get("LOCAL_RANK", "0"))
        world_size = int(environ.get("WORLD_SIZE", "1"))
        local_world_size = max(int(environ.get("LOCAL_WORLD_SIZE", "1")), local_rank + 1)
        low, high = _elastic_range(environ, world_size, local_world_size)
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node=environ.get("GROUP_RANK", "0"),
            restart_count=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            min_world_size=low,
            max_world_size=high,
        )


def _elastic_range(environ: Mapping[str, str], world_size: int, local_world_size: int) -> tuple[int, int]:
    # torchrun does not pass --nnodes on to its workers. It reads it from PET_NNODES when given that way (which the
    # workers inherit), else from its own command line: the worker's parent process.
    nnodes = environ.get("PET_NNODES")
    if not nnodes and "TORCHELASTIC_RUN_ID" in environ:
        nnodes = _parent_flag("--nnodes") or "1"  # torchrun's default
    if not nnodes:
        return world_size, world_size
    low, _, high = nnodes.partition(":")
    try:
        return int(low) * local_world_size, int(high or low) * local_world_size
    except ValueError:
        return world_size, world_size


def _parent_flag(flag: str) -> str | None:
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    for i, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
    return None
