"""The worker's checkpoints: ``checkpointer.py`` (the ``Checkpointer``: resume, cadence, RNG state, plain or sharded
saves) over ``files.py`` (the plain file format: written atomically, validated on load, the last K kept)."""

from app.worker.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointMismatch,
    CheckpointWriteError,
    Resumed,
    ShardedState,
)

__all__ = ["CheckpointMismatch", "CheckpointWriteError", "Checkpointer", "Resumed", "ShardedState"]
