"""Process-group setup and teardown, as a pair, from the variables torchrun sets.

torchrun exports RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every process it starts;
``init_process_group("env://")`` reads them. The device and backend follow from the hardware: CUDA → NCCL with
one GPU per local rank; CPU → gloo.

A rank that cannot reach the rendezvous endpoint (MASTER_ADDR:MASTER_PORT) within ``timeout_s`` raises
``RendezvousError`` with one line naming the endpoint, instead of c10d's multi-line C++ trace.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as e:
            last = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"cannot reach the rendezvous at {host}:{port} (MASTER_ADDR:MASTER_PORT) within "
                f"{timeout_s:g} s ({last}); check that rank 0 / the rendezvous is up and the "
                f"address is right, or raise rendezvous_timeout_seconds"
            )
        time.sleep(0.25)


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it: bind to port 0, read it, close)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def distributed(timeout_s: float = 60.0, force_cpu: bool = False):
    """``with distributed() as ctx:`` joins the process group and always leaves it: setup and teardown as a pair."""
    ctx = init_distributed(timeout_s, force_cpu)
    try:
        yield ctx
    finally:
        cleanup_distributed()


def init_distributed(timeout_s: float = 60.0, force_cpu: bool = False, require_cuda: bool = False) -> DistContext:
    """Join the process group described by torchrun's environment (a world of 1 without torchrun).

    ``timeout_s`` bounds reaching the endpoint and forming the group, and is the group's collective timeout.
    """
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device, backend = pick_device_and_backend(local_rank, force_cpu, require_cuda)
    if "WORLD_SIZE" not in os.environ and "MASTER_PORT" not in os.environ:
        # Plain `python -m ...`, no torchrun: a world of one whose store nobody else dials, so any free port will
        # do, and a fixed default (29500) would make two such runs at once collide.
        os.environ["MASTER_PORT"] = str(free_port())
    if "MASTER_ADDR" not in os.environ:  # plain `python -m ...`: a world of one on loopback
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ.setdefault("MASTER_PORT", "29500")
    host, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500"))
    if not _hosts_the_store(rank):
        wait_for_endpoint(host, port, timeout_s)
    try:
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    except (dist.DistError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RendezvousError(
            f"rank {rank} could not form the process group of {world_size} at {host}:{port} "
            f"(MASTER_ADDR:MASTER_PORT) within {timeout_s:g} s: {first}"
        ) from None
    return DistContext(rank, local_rank, world_size, device, backend)


def cleanup_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
