"""DDP step time, side by side in one run: ours vs PyTorch's vs the lesson's loop, at world size 2 on CPU.

    make bench                                   # both models, writes bench/results/ddp-bench.json
    torchrun --standalone --nproc-per-node=2 -m bench.ddp_bench --repeats 7 --steps 10

Every variant trains its own copy of the model on the same batches. Variants are measured *interleaved*: repeat 1
runs every variant for ``--steps`` timed steps, then repeat 2 does the same, and so on; each variant's figure is
the median of its per-repeat medians. On a shared, noisy machine absolute times drift, so read the ratios (each
row against PyTorch's DDP, measured minutes apart at most), not the milliseconds.

Variants:
    no sync           no communication at all: the lower bound
    ours 25MB / 1MB   app.parallel.ddp with that bucket cap
    ours per-param    app.parallel.ddp with one bucket per parameter (every tensor pays the latency floor)
    torch 25MB        torch.nn.parallel.DistributedDataParallel
    lesson loop       after backward, all_reduce each p.grad in turn, then divide: no buckets, no overlap
    barrier only      after backward, dist.barrier(): what a step costs when ranks only wait for each other

Then the lesson's exercise: the share of the step spent on gradient sync (1 - no-sync / ours) at per-rank batch
1, 16 and 256 on the deep MLP.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app.dist import distributed
from app.models import DeepMLP, TinyTransformer, count_parameter_tensors
from app.parallel import wrap_model

RESULTS = Path(__file__).parent / "results" / "ddp-bench.json"
VARIANTS = ["no sync", "ours 25MB", "ours 1MB", "ours per-param", "torch 25MB", "lesson loop", "barrier only"]


class Variant:
    """One way of training: a model copy, its optimizer and what happens after backward."""

    def __init__(self, name: str, base: nn.Module):
        self.name = name
        model = copy.deepcopy(base)
        if name.startswith("ours"):
            cap = {"ours 25MB": 25, "ours 1MB": 1, "ours per-param": 1e-9}[name]
            model = wrap_model(model, "ours", bucket_cap_mb=cap)
        elif name == "torch 25MB":
            model = wrap_model(model, "torch", bucket_cap_mb=25)
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        self.world = dist.get_world_size()

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss_fn(self.model(x), y).backward()
        if self.name == "lesson loop":
            for p in self.model.parameters():  # the lesson's code: one blocking all-reduce per tensor
                dist.all_reduce(p.grad)
                p.grad /= self.world
        elif self.name == "barrier only":
            dist.barrier()
        self.opt.step()


def mlp_workload(batch: int):
    model = DeepMLP()
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, 512, generator=g), torch.randn(batch, 512, generator=g)
    return model, x, y, F.mse_loss


def transformer_workload(batch: int):
    model = TinyTransformer(dim=64, layers=6, max_len=32)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, 64, (batch, 32), generator=g)

    def loss_fn(out, target):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    return model, tokens, tokens.roll(-1, dims=1), loss_fn


def time_steps(variant: Variant, x, y, loss_fn, steps: int) -> float:
    """Median seconds per step over ``steps`` steps, the slowest rank's (a step is as slow as its slowest rank)."""
    times = []
    for _ in range(steps):
        dist.barrier()  # start together, so one rank's lateness is not billed to the next variant
        t0 = time.perf_counter()
        variant.step(x, y, loss_fn)
        times.append(time.perf_counter() - t0)
    median = torch.tensor([statistics.median(times)])
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def measure(names: list[str], workload, batch: int, repeats: int, steps: int, warmup: int) -> dict[str, list]:
    torch.manual_seed(0)
    base, x, y, loss_fn = workload(batch)
    variants = [Variant(n, base) for n in names]
    for v in variants:
        for _ in range(warmup):
            v.step(x, y, loss_fn)
    per_repeat: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(repeats):
        for v in variants:  # interleaved: drift in machine load hits every variant alike
            per_repeat[v.name].append(time_steps(v, x, y, loss_fn, steps))
    return per_repeat


def describe(model: nn.Module) -> dict:
    return {
        "parameter_tensors": count_parameter_tensors(model),
        "gradient_mib": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20, 2),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per variant (default 5)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per repeat (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"JSON output (default {RESULTS})")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with distributed(force_cpu=True) as ctx:
        return run(args, ctx.rank, ctx.world_size)


def run(args, rank: int, world: int) -> int:
    models = {"deep_mlp": (mlp_workload, 32), "tiny_transformer": (transformer_workload, 16)}
    report = {
        "schema": "ddp-bench.v1",
        "world_size": world,
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "host": platform.node(),
        "repeats": args.repeats,
        "steps": args.steps,
        "time_unit": "median seconds per step (slowest rank), median over interleaved repeats",
        "models": {},
        "sync_share": [],
    }
    for model_name, (workload, batch) in models.items():
        per_repeat = measure(VARIANTS, workload, batch, args.repeats, args.steps, args.warmup)
        medians = {n: statistics.median(v) for n, v in per_repeat.items()}
        torch_ms = medians["torch 25MB"]
        report["models"][model_name] = {
            **describe(workload(batch)[0]),
            "per_rank_batch": batch,
            "variants": {
                n: {"median_s": medians[n], "ratio_to_torch": medians[n] / torch_ms, "per_repeat_s": per_repeat[n]}
                for n in VARIANTS
            },
        }

    for batch in (1, 16, 256):
        per_repeat = measure(["no sync", "ours 25MB"], mlp_workload, batch, args.repeats, args.steps, args.warmup)
        no_sync, ours = (statistics.median(per_repeat[n]) for n in ("no sync", "ours 25MB"))
        report["sync_share"].append(
            {
                "model": "deep_mlp",
                "per_rank_batch": batch,
                "no_sync_s": no_sync,
                "ours_s": ours,
                "sync_share": max(0.0, 1 - no_sync / ours),
            }
        )

    if rank == 0:
        print_table(report)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


def print_table(report: dict) -> None:
    print(
        f"world size {report['world_size']} ({report['backend']}, CPU), {report['repeats']} interleaved repeats "
        f"x {report['steps']} steps; ms = median step time of the slowest rank\n"
    )
    names = list(report["models"])
    header = "| variant | " + " | ".join(f"{m} ms | ×torch" for m in names) + " |"
    print(header)
    print("|---|" + "---:|---:|" * len(names))
    for v in VARIANTS:
        cells = []
        for m in names:
            row = report["models"][m]["variants"][v]
            cells.append(f"{row['median_s'] * 1e3:.1f} | {row['ratio_to_torch']:.2f}")
        print(f"| {v} | " + " | ".join(cells) + " |")
    for m in names:
        info = report["models"][m]
        print(
            f"{m}: {info['parameter_tensors']} parameter tensors, {info['gradient_mib']} MiB of gradients, "
            f"per-rank batch {info['per_rank_batch']}"
        )
    mlp = report["models"]["deep_mlp"]["variants"]
    print(
        f"ours 25MB vs lesson loop on deep_mlp: {mlp['lesson loop']['median_s'] / mlp['ours 25MB']['median_s']:.2f}x "
        f"faster"
    )
    print(
        "\ngradient-sync share of the step (deep_mlp, ours 25MB): "
        + ", ".join(f"batch {s['per_rank_batch']}: {s['sync_share']:.0%}" for s in report["sync_share"])
    )


if __name__ == "__main__":
    sys.exit(main())
