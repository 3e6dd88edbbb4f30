"""Process-group setup and teardown, as a pair, from the variables torchrun sets.

torchrun exports RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every process it starts;
``init_process_group("env://")`` reads them. The device and backend follow from the hardware: CUDA → NCCL with
one GPU per local rank; CPU → gloo.
"""

from __future__ import annotations

import datetime
import os
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


def pick_device_and_backend(local_rank: int, force_cpu: bool = False) -> tuple[torch.device, str]:
    if torch.cuda.is_available() and not force_cpu:
        # One process per GPU: without set_device every rank would put its NCCL communicator on GPU 0.
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(timeout_s: float = 60.0, force_cpu: bool = False) -> DistContext:
    """Join the process group described by torchrun's environment (a world of 1 without torchrun)."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device, backend = pick_device_and_backend(local_rank, force_cpu)
    if "MASTER_ADDR" not in os.environ:  # plain `python -m ...`: a world of one on loopback
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if backend == "nccl" else None)
    return DistContext(rank, local_rank, world_size, device, backend)


def cleanup_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
