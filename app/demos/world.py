"""Run a function on a fresh local world of processes, one rank each: what the demos and benches spawn.

``spawn_world(fn, 2, cfg)`` starts two processes, joins them in one process group (gloo on CPU, NCCL with one GPU per
rank) through a file store in a temporary folder, runs ``fn(rank, world_size, cfg)`` on each and returns what each
returned, by rank. The tests have their own pool of reusable worlds (``tests/world.py``); this one is a plain
``torch.multiprocessing.start_processes`` that a reader can follow.

The ranks are forked from Python's fork server with torch already imported in it (``"forkserver"``, torch preloaded):
a spawned rank is a fresh interpreter that spends seconds of CPU importing torch before it does anything, and the
demos, benches and ``app.check`` start worlds of 2-4 ranks, several per command. The fork server is a clean
single-threaded process started once, so its children are as fresh as spawned ones but for torch's import; CUDA is
not initialised in it, so NCCL ranks can still pick their GPU. Each rank is given the caller's environment as it is
at the call (a forked rank would otherwise see the fork server's, from when it started).
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

# What the fork server imports once, before it forks any rank.
PRELOAD = ["torch", "torch.distributed"]


def forkserver_context():
    """multiprocessing's "forkserver" context, torch preloaded in the server: what every local world here forks
    its ranks from (this module, tests/world.py, bench/accum.py)."""
    import multiprocessing

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when the fork server loads torch's OpenMP runtime
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs: it is started once per process
    return ctx


def _rank_entry(rank: int, world: int, folder: str, backend: str, env: dict, fn, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)

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
        # Leave together: a rank done first (fn ran no collective, or its last one returned early) would close its
        # connections while a peer still sets them up or reads from them, and that peer fails (seen in CI).
        dist.barrier()
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

    forkserver_context()  # start_processes below uses that context
    with tempfile.TemporaryDirectory() as folder:
        entry_args = (world_size, folder, backend, dict(os.environ), fn, args)
        ctx = mp.start_processes(_rank_entry, entry_args, world_size, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world_size} ranks still running after {timeout:.0f}s: a hang")
        return [pickle.loads(Path(folder, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]
