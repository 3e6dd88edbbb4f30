"""A function on N local ranks joined in one process group: ``spawn_world`` (a fresh world) and ``run_world`` (kept).

    spawn_world(fn, 2, cfg)     # two ranks: fn(rank, 2, cfg) on each; their return values, by rank; then they end
    run_world(fn, 2, cfg)       # the same on a world of 2 kept for the next call (the tests: one start per size)

Each rank is ``python -m app.world`` (``serve`` below) started by ``app.world.template.start_module`` (forked from a
template that has imported torch, or its own interpreter with ``LAUNCH_FORK=0``), given the caller's environment as it
is at the world's start. It joins the group (gloo on CPU; NCCL with GPU r for rank r) through a file store in a
temporary folder, then takes functions over a Unix socket until told to stop. ``fn`` must be a module-level function (it
goes by reference): one in the caller's ``__main__`` works when that was run as ``python -m package.module``, whose
top-level code each rank then imports: guard the world's start with ``if __name__ == "__main__":``, as multiprocessing
asks (a world started while a rank imports it is refused: without that, every rank would start a world of its own).

A rank that raises fails the call with its traceback (``WorldFailed``); one that dies without a word (segfault, OOM
killer) fails it at once, naming the rank and its exit code; ranks still busy at the deadline are killed and the call
fails as a hang, so nothing blocks. A kept world that failed is torn down; the next call starts a fresh one.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import io
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Client, Connection, wait

from app.world.template import start_module

START_TIMEOUT_S = 300.0  # to start every rank and form the group (a loaded machine takes a minute); also collectives'
_ERROR_GRACE_S = 5.0  # after one rank fails, how long to wait for the others' reports before killing the world
_POLL_S = 1.0  # how often a waiting call checks that every rank is still alive


class WorldFailed(RuntimeError):
    """A rank raised, died, or hung; ``str()`` names the rank and carries its traceback."""


CALLER_PATH = "APP_WORLD_CALLER_PATH"  # the caller's sys.path, for the ranks to import what it imports
_unpickling: list[bool] = []  # non-empty while a rank imports the caller's function (and maybe its main module)


class World:
    """``world_size`` ranks in one process group, waiting for functions to run."""

    def __init__(self, world_size: int, backend: str = "gloo"):
        if _unpickling:
            raise WorldFailed("a world started while a rank imported its function: guard it with if __name__ == ...")
        self.world_size = world_size
        self._tmp = tempfile.TemporaryDirectory(prefix="ddp-world-")
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(os.path.join(self._tmp.name, "tasks"))
        self._server.listen(world_size)
        main = getattr(getattr(sys.modules["__main__"], "__spec__", None), "name", "")  # `python -m pkg.mod`: pkg.mod
        common = [os.path.join(self._tmp.name, "tasks"), str(world_size), backend, self._tmp.name, main]
        # Every rank from template 0: one torch import per process for every world, as a fork server's; a template per
        # rank (the trainers' way, for their string-hash seeds) cost the tests a torch import per rank index.
        # The caller's import path goes with them: a model in the directory a user runs `python -m app.check` from
        # is found by the ranks as by the caller (they start in the checkout, like every process started here).
        env = dict(os.environ) | {CALLER_PATH: os.pathsep.join(sys.path)}
        self._procs = [start_module("app.world", str(r), *common, env=env, pipes=False) for r in range(world_size)]
        self._conns: dict[int, Connection] = {}
        self.ready = False

    def _messages(self, waiting: set[int], deadline: float, what: str) -> dict[int, tuple[str, object]]:
        """One message from each rank in ``waiting``, or fail: a rank that dies on the way at once, every rank still
        silent at ``deadline`` (then ``what`` says what they were doing). After one rank's error the others get
        ``_ERROR_GRACE_S`` more to report."""
        got: dict[int, tuple[str, object]] = {}
        while len(got) < len(waiting):
            if any(kind == "err" for kind, _ in got.values()):
                deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
            if time.monotonic() >= deadline:
                break
            # Short polls: a rank killed outright (segfault, OOM killer, os._exit) never reports, and waiting for
            # it would turn a crash into a "hang" reported only at the deadline.
            for ready in wait([self._server, *self._conns.values()], timeout=_POLL_S):
                if ready is self._server:
                    conn = Connection(self._server.accept()[0].detach())
                    self._conns[conn.recv()] = conn  # a rank's first word: its number
                    continue
                rank = next(r for r, c in self._conns.items() if c is ready)
                try:
                    got[rank] = ready.recv()
                except EOFError:
                    self._conns.pop(rank).close()  # it closed the socket: dying; the check below names it
            self._fail_if_a_rank_died(got)
        errors = {r: v for r, (kind, v) in got.items() if kind == "err"}
        if errors:
            first = min(errors)
            raise WorldFailed(f"rank {first} failed:\n{errors[first]}")
        missing = sorted(waiting - set(got))
        if missing:
            raise WorldFailed(f"ranks {missing} still {what} after the deadline: a hang")
        return got

    def _fail_if_a_rank_died(self, reported: dict) -> None:
        dead = [(r, p.poll()) for r, p in enumerate(self._procs) if r not in reported and p.poll() is not None]
        if dead:
            rank, code = dead[0]
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise WorldFailed(
                f"rank {rank} died ({how}) without reporting a result: a crash (segfault, OOM killer, os._exit), "
                f"not a hang"
            )

    def run(self, fn, args: tuple, timeout: float) -> list:
        """``fn(rank, world_size, *args)`` on every rank; the return values by rank. ``timeout`` covers only
        ``fn``: the world's start has its own (``START_TIMEOUT_S``), so a slow start never eats into it."""
        everyone = set(range(self.world_size))
        if not self.ready:
            self._messages(everyone, time.monotonic() + START_TIMEOUT_S, "starting and joining the group")
            self.ready = True
        task = pickle.dumps((fn, args))
        for rank in everyone:
            self._conns[rank].send_bytes(task)
        done = self._messages(everyone, time.monotonic() + timeout, f"running {fn.__name__}")
        return [pickle.loads(done[r][1]) for r in range(self.world_size)]

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for conn in self._conns.values():
                with contextlib.suppress(OSError):  # a rank gone already
                    conn.send_bytes(b"")  # the ranks' cue to leave the group and end
            deadline = time.monotonic() + 10
            while any(p.poll() is None for p in self._procs) and time.monotonic() < deadline:
                time.sleep(0.05)
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for conn in self._conns.values():
            conn.close()
        self._server.close()
        self._tmp.cleanup()


def spawn_world(fn, world_size: int, *args, timeout: float = 300.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh ranks in one process group; results by rank.

    Args:
        fn: a module-level function (the ranks import it by name).
        world_size: how many ranks.
        timeout: seconds ``fn`` may run before the ranks are killed and ``WorldFailed`` is raised.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank r on GPU r).

    Example::

        losses = spawn_world(train, 2, cfg)  # [rank 0's return value, rank 1's]
    """
    world = World(world_size, backend)
    ok = False
    try:
        result = world.run(fn, args, timeout)
        ok = True
        return result
    finally:
        world.close(graceful=ok)


_kept: dict[tuple[int, str], World] = {}


def run_world(fn, world_size: int, *args, timeout: float = 120, backend: str = "gloo") -> list:
    """``spawn_world`` on a world kept for the next call of the same size and backend (started on first use)."""
    key = (world_size, backend)
    world = _kept.get(key)
    if world is None:
        world = _kept[key] = World(world_size, backend)
    try:
        return world.run(fn, args, timeout)
    except BaseException:
        # A failed or hung call may leave collectives half-matched: never reuse that world.
        _kept.pop(key).close(graceful=False)
        raise


@atexit.register
def close_all() -> None:
    """Stop every kept world's ranks. At exit, and at the end of a pytest session (tests/conftest.py): a
    pytest-xdist worker leaves without running atexit, and its ranks would outlive the run."""
    while _kept:
        _kept.popitem()[1].close()


# -- in each rank ---------------------------------------------------------------------------------------------------
class _Unpickler(pickle.Unpickler):
    """The caller's ``__main__`` is another module here: its functions are found under its real name."""

    def __init__(self, data: bytes, main: str):
        super().__init__(io.BytesIO(data))
        self.main = main

    def find_class(self, module: str, name: str):
        return super().find_class(self.main if module == "__main__" and self.main else module, name)


def serve(rank: int, path: str, world_size: int, backend: str, folder: str, main: str) -> None:
    """A rank: join the group, then run each function sent until an empty message."""
    import torch
    import torch.distributed as dist

    from app.worker.startup import defer_dynamo_import

    sys.path[:0] = [p for p in os.environ.get(CALLER_PATH, "").split(os.pathsep) if p and p not in sys.path]
    conn = Client(path, "AF_UNIX")
    conn.send(rank)
    try:
        torch.set_num_threads(1)  # several ranks share this machine's cores: more BLAS threads only fight
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, or every NCCL communicator lands on GPU 0
        timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
        dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank, world_size=world_size,
                                timeout=timeout)  # fmt: skip
        # torch.optim's first optimizer would import torch._dynamo: seconds of CPU in every rank, for nothing
        # compiled (app/worker/startup.py; TRAINER_DEFER_DYNAMO=0 keeps torch's import).
        defer_dynamo_import()
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while task := conn.recv_bytes():
        try:
            _unpickling.append(True)
            try:
                fn, args = _Unpickler(task, main).load()
            finally:
                _unpickling.clear()
            conn.send(("ok", pickle.dumps(fn(rank, world_size, *args))))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
    dist.destroy_process_group()
