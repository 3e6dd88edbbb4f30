"""The lesson's proof, run for real: N ranks with DDP walk the same batches as one process, step by step.

    make demo                                   # 4 CPU ranks, 20 steps, our DDP
    make demo WORKERS=2 STEPS=10 WRAPPER=torch  # PyTorch's DDP instead of ours
    torchrun --standalone --nproc-per-node=4 -m app.demos.demo --steps 20 --bucket-cap-mb 0.01

Each step draws one global batch (the same on every rank, from a generator seeded by the step), gives rank r the
r-th equal slice, and trains. Rank 0 also trains a single-process *reference* copy of the model on the whole
global batch. Because every rank's loss is a mean over an equal-sized slice, the average of the ranks' gradients
is exactly the gradient of the mean loss over the whole batch: if the sync is right, the DDP parameters equal the
reference parameters after every step, up to float rounding. The table shows it step by step:

    ref loss     the reference's loss on the global batch
    rank0 loss   rank 0's loss on its slice
    worst gap    max over ranks of |rank r's loss - the reference model's loss on rank r's slice|
    max |dp|     max over all parameters of |DDP parameter - reference parameter| on rank 0
    same         whether every rank's parameters hash (sha256) to the same value

Ranks build their models from *different* seeds: the broadcast at construction is what makes them start equal.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from app.parallel import wrap_model
from app.worker.dist import distributed, exit_process
from app.worker.models import MiniMLP, parameter_checksum

PARAM_TOLERANCE = 1e-5  # float32 sums in a different order drift by ~1e-7 per step; 20 steps stay far below this
LOSS_TOLERANCE = 1e-5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--per-rank-batch", type=int, default=16, help="samples per rank per step (default 16)")
    p.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP bucket size in MiB (default 25)")
    p.add_argument(
        "--wrapper",
        choices=["ours", "torch"],
        default="ours",
        help="ours: app.parallel.ddp; torch: torch.nn.parallel.DistributedDataParallel",
    )
    p.add_argument("--lr", type=float, default=0.3, help="SGD learning rate (default 0.3)")
    args = p.parse_args(argv)
    for name in ("steps", "per_rank_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.bucket_cap_mb <= 0:
        p.error(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}")
    return args


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank: a generator seeded by the step, and a fixed linear target to learn."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 32, generator=g)
    w = torch.Generator().manual_seed(7)
    target = x @ torch.randn(32, 8, generator=w) / 32**0.5
    return x, target + 0.01 * torch.randn(size, 8, generator=g)


def main(argv=None) -> int:
    args = parse_args(argv)
    with distributed(force_cpu=True) as ctx:
        return run(args, ctx.rank, ctx.world_size)


def reference_step(reference, ref_opt, model, x, y, world: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Rank 0's one-process step on the whole batch: its loss, what each rank's shard loss should have been, and the
    largest parameter gap to the DDP model after the step (on other ranks: nothing, zeros)."""
    shard_losses = torch.zeros(world)
    if reference is None:
        return torch.zeros(()), shard_losses, 0.0
    b = x.shape[0] // world
    with torch.no_grad():
        out = reference(x)
        for r in range(world):
            shard_losses[r] = F.mse_loss(out[r * b : (r + 1) * b], y[r * b : (r + 1) * b])
    ref_opt.zero_grad(set_to_none=True)
    ref_loss = F.mse_loss(reference(x), y)
    ref_loss.backward()
    ref_opt.step()
    max_dp = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    return ref_loss, shard_losses, max_dp


def run(args: argparse.Namespace, rank: int, world: int) -> int:
    torch.manual_seed(rank)  # deliberately different per rank: the broadcast must fix it
    model = MiniMLP()
    ddp = wrap_model(model, args.wrapper, bucket_cap_mb=args.bucket_cap_mb)
    reference = copy.deepcopy(model) if rank == 0 else None  # after the broadcast: rank 0's weights
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr) if reference is not None else None
    b = args.per_rank_batch

    if rank == 0:
        print(
            f"{world} ranks ({args.wrapper} DDP, bucket {args.bucket_cap_mb} MiB), {args.steps} steps, "
            f"global batch {b * world} = {world} x {b}; reference: one process, whole batch"
        )
        print(
            f"{'step':>4}  {'ref loss':>10}  {'rank0 loss':>10}  {'worst gap':>9}  {'max |dp|':>9}  {'same':>4}  digest"
        )
    worst_param = worst_gap = 0.0
    all_same = True
    for step in range(args.steps):
        x, y = global_batch(step, b * world)
        xs, ys = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]

        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(ddp(xs), ys)
        loss.backward()  # gradients are averaged across ranks by the time this returns
        opt.step()

        ref_loss, shard_losses, max_dp = reference_step(reference, ref_opt, model, x, y, world)

        losses = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(losses, loss.detach().reshape(1))
        digests = [None] * world
        dist.all_gather_object(digests, parameter_checksum(model)[:12])

        if rank == 0:
            gap = max(abs(losses[r].item() - shard_losses[r].item()) for r in range(world))
            same = len(set(digests)) == 1
            worst_param, worst_gap = max(worst_param, max_dp), max(worst_gap, gap)
            all_same &= same
            print(
                f"{step:>4}  {ref_loss.item():>10.6f}  {losses[0].item():>10.6f}  {gap:>9.2e}  {max_dp:>9.2e}  "
                f"{'yes' if same else 'NO':>4}  {digests[0]}",
                flush=True,
            )

    ok = torch.tensor(
        [1 if rank != 0 or (worst_param <= PARAM_TOLERANCE and worst_gap <= LOSS_TOLERANCE and all_same) else 0]
    )
    dist.broadcast(ok, src=0)
    if rank == 0:
        verdict = "PASS" if ok.item() else "FAIL"
        print(
            f"{verdict}: {world} ranks equal the single-process reference for {args.steps} steps "
            f"(max |dp| {worst_param:.2e} <= {PARAM_TOLERANCE:.0e}, worst loss gap {worst_gap:.2e} <= "
            f"{LOSS_TOLERANCE:.0e}, parameters identical on all ranks: {'yes' if all_same else 'NO'})"
        )
    return 0 if ok.item() else 1


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: app.worker.dist.exit_process says why
