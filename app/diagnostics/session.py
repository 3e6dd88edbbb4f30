"""The flight recorder set up for one training run: who this rank is, where its dump goes, SIGUSR1, the desync check.

``start_recording`` is what the trainer calls once its process group is formed (every rank: it holds a collective,
the broadcast of the world's id that tells this world's dumps from a stale one's).

    start_recording(entries=4096, dump_dir="/ckpt/flight", desync_check=False)
"""

from __future__ import annotations

import os
import threading
import uuid

import torch.distributed as dist

from app.diagnostics import desync
from app.diagnostics.recorder import RECORDER, install_dump_signal


def start_recording(*, entries: int, dump_dir: str | None, desync_check: bool, job: str | None = None) -> str:
    """Configure ``RECORDER`` for this world; the world's id (rank 0's, agreed by a broadcast)."""
    chosen = [uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(chosen, src=0)
    job = os.environ.get("TORCHELASTIC_RUN_ID", "") if job is None else job
    RECORDER.configure(
        capacity=entries,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        dump_dir=dump_dir,
        job=job,
        world_id=chosen[0],
    )
    if entries and dump_dir and threading.current_thread() is threading.main_thread():
        install_dump_signal(RECORDER)  # (signal handlers can only be set from the main thread)
    if desync_check:
        desync.enable(RECORDER)
    return chosen[0]
