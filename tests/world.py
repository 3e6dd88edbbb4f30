"""Run a function on N real ranks: spawned processes joined in a gloo process group on loopback.

``run_world(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in every rank and returns the list of
return values, by rank. A rank that raises fails the test with its traceback; ranks still running at the deadline
are killed and the test fails as a hang, so no test can block CI.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from pathlib import Path


def _entry(fn, rank: int, world_size: int, init_file: str, out_dir: str, args: tuple, backend: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks: oversubscribed BLAS threads only add noise
    out = Path(out_dir) / f"rank{rank}"
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=60))
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        out.with_suffix(".pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        out.with_suffix(".err").write_text(traceback.format_exc())
        raise SystemExit(1)


def run_world(fn, world_size: int, *args, timeout: float = 120, backend: str = "gloo") -> list:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, init_file, tmp, args, backend), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = _now() + timeout
        for p in procs:
            p.join(max(0.0, deadline - _now()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = {r: (Path(tmp) / f"rank{r}.err").read_text() for r in range(world_size)
                  if (Path(tmp) / f"rank{r}.err").exists()}
        if errors:
            first = min(errors)
            raise AssertionError(f"rank {first} failed:\n{errors[first]}")
        if hung:
            raise AssertionError(f"ranks {hung} still running after {timeout:.0f}s: hang")
        return [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


def _now() -> float:
    return datetime.datetime.now().timestamp()
