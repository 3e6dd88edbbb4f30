"""A user's own training script: their model, data and loss, the cluster's DDP (``app.parallel.wrap_model``).

It is what a script must be to run under torchrun, and so under the cluster's launcher (``app.cluster.launch`` is
torchrun with readable exit codes): the world comes from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), the process group is set up and torn down as a pair, each rank trains on its share of the data.

    # here, 2 CPU ranks (the checkout's app/ and this folder on PYTHONPATH)
    PYTHONPATH=.:examples/user_model torchrun --standalone --nproc-per-node=2 examples/user_model/train.py --steps 50
    # the same under the cluster's launcher
    PYTHONPATH=.:examples/user_model python -m app.cluster.launch --standalone --nproc-per-node=2 \\
        examples/user_model/train.py --steps 50
    # on the cluster: compose.user.yaml + compose.user-script.yaml (docs/your-model.md, "On the cluster")

At the end every rank prints ``FINISHED rank=<r> world_size=<n> step=<s> checksum=<16 hex>``, the trainer's
format: equal checksums mean bit-identical parameters on every rank. No checkpoints: if the world re-forms (a
container lost mid-run), torchrun starts the script again and it trains from step 0.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from user_model.data import Blobs
from user_model.loss import smoothed_cross_entropy
from user_model.model import build_model

from app.parallel import wrap_model


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=int(os.environ.get("USER_STEPS", "200")), help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--wrapper", default="ours", help="ours | torch (app.parallel.wrap_model)")
    return p.parse_args()


def checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def train(args: argparse.Namespace, rank: int, world_size: int) -> None:
    torch.manual_seed(rank)  # different on purpose: wrap_model's broadcast must make every rank start as rank 0
    model = wrap_model(build_model(), args.wrapper)
    data = Blobs(seed=0)  # the same data set on every rank; the sampler gives each rank its own share
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step, epoch, losses = 0, 0, []
    while step < args.steps:
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for x, y in loader:
            loss = smoothed_cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # gradients are averaged over the ranks when this returns
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if step == args.steps:
                break
        epoch += 1
    if rank == 0:
        print(f"rank 0: loss {losses[0]:.4f} at step 1, {losses[-1]:.4f} at step {step}", flush=True)
    print(f"FINISHED rank={rank} world_size={world_size} step={step} checksum={checksum(model)}", flush=True)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")  # env://: the rank, world size and address torchrun set
    try:
        train(args, dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
