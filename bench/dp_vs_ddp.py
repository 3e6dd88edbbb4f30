"""``nn.DataParallel`` against DistributedDataParallel on the same GPUs, model and global batch: step time, peak memory
per GPU, and how much more GPU 0 holds than the others.

    .venv/bin/python -m bench.dp_vs_ddp                          # every visible GPU (needs >= 2)
    .venv/bin/python -m bench.dp_vs_ddp --gpus 2 --width 4096 --steps 30 --wrapper ours

DataParallel is one process: each forward scatters the batch over the GPUs, *replicates the module* onto every GPU
(a broadcast of all parameters, every step), runs the replicas in Python threads (one GIL), and gathers the outputs
on GPU 0, where the loss, the reduced gradients and the optimizer live. DDP is one process per GPU: parameters are
copied once, each rank computes its own loss, and only gradients cross, in buckets, overlapped with backward.

Writes ``bench/results/dp-vs-ddp.json`` (schema ``dp-vs-ddp.v1``, with provenance). On fewer than 2 GPUs it says so
in one line and exits 2: DataParallel on one device is the bare module.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from app.cli import OneLineParser

SCHEMA = "dp-vs-ddp.v1"


def build(width: int, depth: int):
    from app.worker.models import DeepMLP

    torch.manual_seed(0)
    return DeepMLP(width=width, depth=depth)


def timed_steps(model, opt, x, y, steps: int, warmup: int, devices: list[int]) -> list[float]:
    times = []
    for step in range(warmup + steps):
        for d in devices:
            torch.cuda.synchronize(d)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
        for d in devices:
            torch.cuda.synchronize(d)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times


def run_data_parallel(cfg: dict) -> dict:
    devices = list(range(cfg["gpus"]))
    model = build(cfg["width"], cfg["depth"]).cuda(0)
    dp = torch.nn.DataParallel(model, device_ids=devices)  # output_device defaults to device_ids[0]
    opt = torch.optim.SGD(dp.parameters(), lr=0.01)
    x = torch.randn(cfg["batch"], cfg["width"], device="cuda:0")  # DP scatters from GPU 0
    y = torch.randn(cfg["batch"], cfg["width"], device="cuda:0")  # the gathered output lands on GPU 0
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    times = timed_steps(dp, opt, x, y, cfg["steps"], cfg["warmup"], devices)
    return {"step_ms": 1000 * statistics.median(times), "peak_mib": [peak_mib(d) for d in devices]}


def ddp_on_rank(rank: int, world: int, cfg: dict) -> dict:
    from app.parallel import wrap_model

    model = build(cfg["width"], cfg["depth"]).cuda(rank)
    ddp = wrap_model(model, cfg["wrapper"])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    per_rank = cfg["batch"] // world  # the same global batch as DataParallel's
    x = torch.randn(per_rank, cfg["width"], device=f"cuda:{rank}")
    y = torch.randn(per_rank, cfg["width"], device=f"cuda:{rank}")
    torch.cuda.reset_peak_memory_stats(rank)
    times = timed_steps(ddp, opt, x, y, cfg["steps"], cfg["warmup"], [rank])
    return {"step_ms": 1000 * statistics.median(times), "peak_mib": peak_mib(rank)}


def peak_mib(device: int) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20


def gpu0_extra_share(peaks: list[float]) -> float:
    """How much more GPU 0 peaked at than the mean of the others: 0.0 = balanced, 0.5 = 50 % more."""
    return peaks[0] / statistics.fmean(peaks[1:]) - 1


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = OneLineParser(prog="bench.dp_vs_ddp", description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    p.add_argument("--width", type=int, default=2048, help="DeepMLP width (default 2048)")
    p.add_argument("--depth", type=int, default=8, help="DeepMLP depth (default 8)")
    p.add_argument("--batch", type=int, default=512, help="global batch, split over the GPUs (default 512)")
    p.add_argument("--steps", type=int, default=20, help="measured steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (default 3)")
    p.add_argument("--wrapper", choices=["torch", "ours"], default="torch", help="the DDP side (default torch)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/dp-vs-ddp.json)")
    args = p.parse_args(argv)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < 2:
        p.error(
            f"needs >= 2 CUDA GPUs, found {visible}: DataParallel splits one process's batch over GPUs (not run here)"
        )
    args.gpus = visible if args.gpus is None else args.gpus
    if not 2 <= args.gpus <= visible:
        p.error(f"--gpus {args.gpus}: choose 2..{visible}")
    if args.batch % args.gpus:
        p.error(f"--batch {args.batch} does not split over {args.gpus} GPUs: use a multiple of {args.gpus}")
    return p, args


def main(argv=None) -> int:
    from app.world import spawn_world
    from tools.provenance import describe_output, load_average, output_path, provenance

    parser, args = parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("gpus", "width", "depth", "batch", "steps", "warmup", "wrapper")}
    before = load_average()
    dp = run_data_parallel(cfg)
    torch.cuda.empty_cache()
    ranks = spawn_world(ddp_on_rank, args.gpus, cfg, backend="nccl", timeout=600)
    ddp = {"step_ms": max(r["step_ms"] for r in ranks), "peak_mib": [r["peak_mib"] for r in ranks]}
    for name, r in (("DataParallel", dp), (f"DDP ({args.wrapper})", ddp)):
        peaks = " ".join(f"{m:.0f}" for m in r["peak_mib"])
        print(
            f"{name:<14} step {r['step_ms']:8.2f} ms   peak MiB per GPU: {peaks}   "
            f"GPU 0 holds {gpu0_extra_share(r['peak_mib']):+.0%} vs the others"
        )
    print(f"DDP is {dp['step_ms'] / ddp['step_ms']:.2f}x faster per step")
    path = output_path(parser, args, "dp-vs-ddp")
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema": SCHEMA,
        **provenance(args, load_before=before),
        "gpu_names": [torch.cuda.get_device_name(d) for d in range(args.gpus)],
        "data_parallel": {**dp, "gpu0_extra_share": gpu0_extra_share(dp["peak_mib"])},
        "ddp": {**ddp, "gpu0_extra_share": gpu0_extra_share(ddp["peak_mib"])},
        "speedup_ddp_over_dp": dp["step_ms"] / ddp["step_ms"],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(describe_output(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
