"""Process-group setup and teardown, as a pair, from the variables torchrun sets.

torchrun exports RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_RESTART_COUNT for every process it starts; ``WorldEnv.from_environ()`` (app.worker.config, torch-free,
used here) reads them, once, for the whole worker. The device and backend follow from the hardware: CUDA → NCCL with one
GPU per local rank; CPU → gloo.

Two timeouts, two jobs: ``rendezvous_timeout_s`` is one deadline for reaching MASTER_ADDR:MASTER_PORT *and* forming
the group (a rank that cannot join says so in one line naming the endpoint, instead of c10d's multi-line C++ trace);
``collective_timeout_s`` is the formed group's timeout for every collective afterwards (a hung peer is detected after
it; it must outlast the slowest checkpoint write, during which the other ranks wait in a collective).

    with distributed(timeout_s=60) as ctx:     # joins the group, always leaves it
        print(ctx.rank, ctx.world_size, ctx.device)
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from app.cli import first_line
from app.net import TcpUnreachable, free_port, wait_for_tcp
from app.worker.config import WorldEnv  # torchrun's variables, read without torch (config errors stay fast)

# How long past the rendezvous deadline c10d may take to report its own timeout before the worker gives up for it:
# a TCP peer that accepts but never answers the store's handshake would otherwise hold a rank for minutes.
RENDEZVOUS_GRACE_SECONDS = 2.0


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class RendezvousError(RuntimeError):
    """This rank could not join the process group; the message names the endpoint and the timeout."""


def pick_device_and_backend(
    local_rank: int, force_cpu: bool = False, require_cuda: bool = False
) -> tuple[torch.device, str]:
    if require_cuda and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but no CUDA device is visible; use device=auto or device=cpu")
    if torch.cuda.is_available() and not force_cpu:
        # One process per GPU: without set_device every rank would put its NCCL communicator on GPU 0.
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def _hosts_the_store(rank: int) -> bool:
    # Under torchrun's c10d rendezvous the agent already serves the store (TORCHELASTIC_USE_AGENT_STORE=True) and
    # every worker is a client; otherwise (plain env://, or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) rank 0 serves it.
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def wait_for_endpoint(host: str, port: int, timeout_s: float) -> None:
    """Poll until ``host:port`` accepts a TCP connection (DNS may not resolve yet either), or raise.

    c10d would find out too, but reports it as a multi-line C++ trace, and retries for about twice the timeout.
    """
    try:
        wait_for_tcp(host, port, timeout_s)
    except TcpUnreachable as e:
        raise RendezvousError(
            f"cannot reach the rendezvous at {host}:{port} (MASTER_ADDR:MASTER_PORT) within "
            f"{timeout_s:g} s ({e.why}); check that rank 0 / the rendezvous is up and the "
            f"address is right, or raise rendezvous_timeout_seconds"
        ) from None


@contextlib.contextmanager
def distributed(timeout_s: float = 60.0, force_cpu: bool = False):
    """``with distributed() as ctx:`` joins the process group and always leaves it: setup and teardown as a pair."""
    ctx = init_distributed(timeout_s, force_cpu)
    try:
        yield ctx
        # Leave together. A rank whose last collective returned early (a broadcast's source does not wait for its
        # receivers) would otherwise tear its connections down while a peer still reads from them, and gloo's
        # thread on that peer aborts the process at exit ("terminate called without an active exception", seen
        # in about one `make demo` in ten on a loaded machine). Only on success: after an error a peer may be gone.
        dist.barrier()
    finally:
        cleanup_distributed()


def _default_master(world: WorldEnv) -> tuple[str, int]:
    if "WORLD_SIZE" not in os.environ and "MASTER_PORT" not in os.environ:
        # Plain `python -m ...`, no torchrun: a world of one whose store nobody else dials, so any free port will
        # do, and a fixed default (29500) would make two such runs at once collide.
        os.environ["MASTER_PORT"] = str(free_port())
    if "MASTER_ADDR" not in os.environ:  # plain `python -m ...`: a world of one on loopback
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ.setdefault("MASTER_PORT", "29500")
    return os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500"))


def init_distributed(
    timeout_s: float = 60.0,
    force_cpu: bool = False,
    require_cuda: bool = False,
    *,
    world: WorldEnv | None = None,
    collective_timeout_s: float | None = None,
) -> DistContext:
    """Join the process group described by torchrun's environment (a world of one without torchrun).

    Args:
        timeout_s: one deadline for reaching the endpoint and forming the group (rendezvous_timeout_seconds).
        force_cpu: gloo on CPU even when a GPU is visible.
        require_cuda: raise when no GPU is visible instead of falling back to CPU.
        world: this process's place, read once by the caller (default: read from the environment now).
        collective_timeout_s: the formed group's timeout for every collective (default: ``timeout_s``).

    Example::

        ctx = init_distributed(60, collective_timeout_s=300)
        try:
            ...
        finally:
            cleanup_distributed()
    """
    world = world or WorldEnv.from_environ()
    rank, world_size = world.rank, world.world_size
    device, backend = pick_device_and_backend(world.local_rank, force_cpu, require_cuda)
    host, port = _default_master(world)
    deadline = time.monotonic() + timeout_s
    if not _hosts_the_store(rank):
        wait_for_endpoint(host, port, timeout_s)
    where = f"rank {rank} could not form the process group of {world_size} at {host}:{port} (MASTER_ADDR:MASTER_PORT)"
    # The rest of the same deadline, not a fresh one: reaching the endpoint late must not double the wait.
    remaining = max(deadline - time.monotonic(), 0.5)
    guard = threading.Timer(remaining + RENDEZVOUS_GRACE_SECONDS, _give_up, [f"{where} within {timeout_s:g} s"])
    guard.daemon = True
    guard.start()
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=datetime.timedelta(seconds=remaining)))
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s or timeout_s),
            device_id=device if backend == "nccl" else None,
        )
        # From here the store serves the formed group (NCCL exchanges communicator ids through it lazily).
        store.set_timeout(datetime.timedelta(seconds=collective_timeout_s or timeout_s))
    except (dist.DistError, RuntimeError, ValueError) as e:
        raise RendezvousError(f"{where} within {timeout_s:g} s: {first_line(e)}") from None
    finally:
        guard.cancel()
    return DistContext(rank, world.local_rank, world_size, device, backend)


def exit_process(code: int) -> None:
    """End a rank's process with ``code`` once its output is flushed, skipping the interpreter's teardown.

    A rank that ran collectives still has gloo worker threads and completed works alive when Python shuts down;
    a thread that drops the last reference to a tensor then needs the GIL of a dying interpreter and is unwound out
    of C++ code that cannot be unwound: "terminate called without an active exception", exit 134 after a passing
    run (seen in CI for `make demo`, and after a join timeout at load 59 in the launcher). The teardown also takes
    seconds (4 s measured on a busy 2-core machine), which a SIGTERM'd container's grace period cannot spare.
    Everything that matters is on disk or printed by the time a rank calls this.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _give_up(message: str) -> None:
    print(f"error: {message}: no answer from the rendezvous endpoint", file=sys.stderr, flush=True)
    os._exit(1)


def cleanup_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# What gloo and NCCL say when the other end of a collective is gone or silent, and the cause in a user's words.
_PEER_LOSS = (
    (
        re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+:? (Connection reset by peer|Connection closed by peer|Broken pipe)"),
        "the peer at {0} went away ({1})",
    ),
    (re.compile(r"(Connection reset by peer|Connection closed by peer|Broken pipe)"), "a peer went away ({0})"),
    (re.compile(r"[Tt]imed? ?out"), "a peer stopped answering within collective_timeout_seconds"),
    (re.compile(r"NCCL (?:error|communicator was aborted)"), "NCCL failed (a peer lost or its GPU faulted)"),
)


def lost_peer(error: BaseException) -> str | None:
    """The cause of a collective that failed because another rank went away, in one line; None for other errors
    (a bug's traceback must stay whole).

    Example::

        >>> lost_peer(RuntimeError("[gloo/pair.cc:537] Read error [172.19.0.6]:43736: Connection reset by peer."))
        'the peer at 172.19.0.6 went away (Connection reset by peer)'
    """
    if not (isinstance(error, dist.DistError) or "gloo" in str(error) or "NCCL" in str(error)):
        return None
    for pattern, cause in _PEER_LOSS:
        if match := pattern.search(str(error)):
            return cause.format(*match.groups())
    return None
