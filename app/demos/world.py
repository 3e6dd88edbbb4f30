"""Run a function on a fresh local world of processes, one rank each: what the demos and benches spawn.

``spawn_world(fn, 2, cfg)`` starts two processes, joins them in one process group (gloo on CPU, NCCL with one GPU per
rank) through a file store in a temporary folder, runs ``fn(rank, world_size, cfg)`` on each and returns what each
returned, by rank. The tests have their own pool of reusable worlds (``tests/world.py``); this one is a plain
``torch.multiprocessing.spawn`` that a reader can follow.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
from pathlib import Path

import torch

from app.worker.startup import defer_dynamo_import


def _rank_entry(rank: int, world: int, folder: str, backend: str, fn, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share this machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank, or every NCCL communicator lands on GPU 0
    dist.init_process_group(
        backend,
        init_method=f"file://{folder}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    # torch.optim's first optimizer would import torch._dynamo: seconds of CPU in every rank, for nothing compiled
    # (app/worker/startup.py; TRAINER_DEFER_DYNAMO=0 keeps torch's import).
    defer_dynamo_import()
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    Path(folder, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def spawn_world(fn, world_size: int, *args, timeout: float = 300.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes in one process group; results by rank.

    Args:
        fn: a module-level function (the processes import it by name).
        world_size: how many ranks.
        timeout: seconds before the ranks are killed and ``TimeoutError`` is raised.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank r on GPU r).

    A rank that raises makes this raise ``torch.multiprocessing.ProcessRaisedException`` with its traceback.

    Example::

        losses = spawn_world(train, 2, cfg)  # [rank 0's return value, rank 1's]
    """
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as folder:
        ctx = mp.spawn(_rank_entry, args=(world_size, folder, backend, fn, args), nprocs=world_size, join=False)
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world_size} ranks still running after {timeout:.0f}s: a hang")
        return [pickle.loads(Path(folder, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]
