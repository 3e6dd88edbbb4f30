"""Run a function on N real ranks: spawned processes joined in a gloo process group on loopback.

``run_world(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every rank and returns the return
values, by rank. ``fn`` must be a module-level function (it is pickled by reference).

Starting a rank costs seconds (an interpreter importing torch, then the rendezvous), so a world of each size is
started once and reused by later calls: its ranks wait for the next function. The ranks are forked from Python's
fork server with torch imported once in it, as ``app.demos.world.spawn_world`` starts its ranks (see there why).
That start-up has its own deadline (``START_TIMEOUT_S``), generous because a loaded machine can take a minute or
more to start every rank and form the group; a call's ``timeout`` covers only the function, so a slow start never
eats into a test's own bound.

A rank that raises fails the call with its traceback; a rank that dies without a word (segfault, OOM killer) fails
it at once, naming the rank and its exit code; ranks still busy at the deadline are killed and the call fails as a
hang, so no test can block CI.
After any failure the world is torn down and the next call starts a fresh one.
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import queue
import tempfile
import time
import traceback

START_TIMEOUT_S = 300.0  # to start every rank and form the group; also the group's collective timeout
_ERROR_GRACE_S = 5.0  # after one rank fails, how long to wait for the others' reports before killing the world
_POLL_S = 1.0  # how often a waiting call checks that every rank is still alive


def _serve(rank: int, world_size: int, init_file: str, backend: str, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks: extra BLAS threads only add noise
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
        )
    except BaseException:
        results.put((rank, "err", traceback.format_exc()))
        return
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = pickle.loads(task)
        try:
            results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
        except BaseException:
            results.put((rank, "err", traceback.format_exc()))
    dist.destroy_process_group()


class _World:
    def __init__(self, world_size: int, backend: str):
        from app.demos.world import forkserver_context

        ctx = forkserver_context()
        self.world_size = world_size
        self._tmp = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._tmp.name, "store")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_serve, args=(r, world_size, init_file, backend, self._tasks[r], self._results), daemon=True
            )
            for r in range(world_size)
        ]
        self.ready = False
        for p in self._procs:
            p.start()

    def wait_ready(self, timeout: float) -> None:
        """Until every rank has joined the group; a rank that fails or dies on the way fails it at once."""
        ready: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(ready) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(self.world_size)) - ready)
                raise AssertionError(
                    f"ranks {missing} did not start and join the group within {timeout:.0f}s "
                    f"(the fork server importing torch, then the rendezvous)"
                )
            try:
                rank, kind, value = self._results.get(timeout=min(_POLL_S, deadline - now))
            except queue.Empty:
                self._fail_if_a_rank_died({r: ("ready", None) for r in ready})
                continue
            if kind == "err":
                raise AssertionError(f"rank {rank} could not start:\n{value}")
            ready.add(rank)
        self.ready = True

    def run(self, fn, args: tuple, timeout: float) -> list:
        if not self.ready:
            self.wait_ready(START_TIMEOUT_S)
        payload = pickle.dumps((fn, args))
        for q in self._tasks:
            q.put(payload)
        outcomes: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + timeout
        grace_end = None
        while len(outcomes) < self.world_size:
            now = time.monotonic()
            if grace_end is None and any(kind == "err" for kind, _ in outcomes.values()):
                grace_end = now + _ERROR_GRACE_S
            end = min(deadline, grace_end or deadline)
            if now >= end:
                break
            try:
                # Short polls: a rank killed outright (segfault, OOM killer, os._exit) never reports, and waiting
                # for it would turn a crash into a "hang" reported only at the deadline.
                rank, kind, value = self._results.get(timeout=min(_POLL_S, end - now))
            except queue.Empty:
                self._fail_if_a_rank_died(outcomes)
                continue
            outcomes[rank] = (kind, value)
        errors = {r: v for r, (k, v) in outcomes.items() if k == "err"}
        if errors:
            first = min(errors)
            raise AssertionError(f"rank {first} failed:\n{errors[first]}")
        if len(outcomes) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(outcomes))
            raise AssertionError(f"ranks {missing} still running after {timeout:.0f}s: hang")
        return [pickle.loads(outcomes[r][1]) for r in range(self.world_size)]

    def _fail_if_a_rank_died(self, outcomes: dict) -> None:
        # Called after a poll found the queue empty: a dead rank's last report, if it made one, has arrived.
        dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if r not in outcomes and p.exitcode is not None]
        if dead:
            rank, code = dead[0]
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise AssertionError(
                f"rank {rank} died ({how}) without reporting a result: a crash (segfault, OOM "
                f"killer, os._exit), not a hang"
            )

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        self._tmp.cleanup()


_worlds: dict[tuple[int, str], _World] = {}


def run_world(fn, world_size: int, *args, timeout: float = 120, backend: str = "gloo") -> list:
    key = (world_size, backend)
    world = _worlds.get(key)
    if world is None:
        world = _worlds[key] = _World(world_size, backend)
    try:
        return world.run(fn, args, timeout)
    except BaseException:
        # A failed or hung call may leave collectives half-matched: never reuse that world.
        _worlds.pop(key).close(graceful=False)
        raise


@atexit.register
def close_all() -> None:
    """Stop every world's ranks. At exit, and at the end of a pytest session (tests/conftest.py): a pytest-xdist
    worker leaves without running atexit, and its ranks would outlive the run."""
    while _worlds:
        _worlds.popitem()[1].close()
