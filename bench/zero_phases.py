"""Where ZeRO's step time goes: forward, backward, step and the waits on communication, per variant, side by side.

    python -m bench.zero_phases                     # worlds 2 and 4, writes bench/results/zero-phases.json
    python -m bench.zero_phases --world-sizes 2 --repeats 3

The model, variants and bucket cap are bench/zero_bench.py's. Each repeat runs every variant for --steps steps in a
shuffled order (the same on all ranks), back to back after one barrier; each step is cut at the end of forward,
of backward and of ``optimizer.step()``, and the wrappers' ``comm_seconds`` counters give the seconds this rank
waited on each collective inside the step (ours only: PyTorch's wrappers keep no such counter). Every figure is the
median over repeats of the per-repeat median, on rank 0. The last step of a repeat waits for stage 2's all-gather
still in flight: it is counted in that step's "step" phase, so "forward" of the other steps holds the overlapped
wait. On shared cores the phases are noisy: read them beside zero.json's step-time ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from app.world import spawn_world
from bench.zero_bench import Variant, add_run_args, warmed_variants, wide_mlp
from tools.provenance import describe_output, load_average, write_result

VARIANTS = ["ddp", "zero2", "zero2 overlap", "zero3", "zero3 prefetch", "torch fsdp2"]
PHASES = ["forward", "backward", "step", "all_gather_wait", "reduce_scatter_wait", "total"]


def timed_step(variant: Variant, x, y, last: bool) -> dict[str, float]:
    counters = getattr(variant.wrapped, "comm_seconds", None)
    before = dict(counters) if counters is not None else {}
    t0 = time.perf_counter()
    variant.opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(variant.wrapped(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    variant.opt.step()
    if last:
        variant.finish()
    t3 = time.perf_counter()
    waits = {f"{k}_wait": counters[k] - before[k] for k in ("all_gather", "reduce_scatter")} if before else {}
    return {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0, **waits}


def rank_main(rank: int, world: int, cfg: dict) -> dict:
    torch.manual_seed(0)
    base = wide_mlp(cfg["width"], cfg["depth"])
    variants, x, y = warmed_variants(rank, base, cfg, VARIANTS)
    per_repeat = {name: {p: [] for p in PHASES} for name in VARIANTS}
    for repeat in range(cfg["repeats"]):
        order = VARIANTS[:]
        random.Random(repeat).shuffle(order)
        for name in order:
            dist.barrier()
            steps = [timed_step(variants[name], x, y, k == cfg["steps"] - 1) for k in range(cfg["steps"])]
            for phase in PHASES:
                if phase in steps[0]:
                    per_repeat[name][phase].append(statistics.median(s[phase] for s in steps))
    return {name: {p: statistics.median(v) for p, v in phases.items() if v} for name, phases in per_repeat.items()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, repeats=7)
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/zero-phases.json)")
    return p, p.parse_args(argv)


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    before = load_average()
    cfg = {k: getattr(args, k) for k in ("width", "depth", "batch", "repeats", "steps", "warmup", "bucket_cap_mb")}
    results = {str(n): spawn_world(rank_main, n, cfg, timeout=900)[0] for n in args.world_sizes}
    print(f"{'N':>2} {'variant':<14} " + " ".join(f"{p[:14]:>14}" for p in PHASES) + "   (ms, rank 0, medians)")
    for world, rows in results.items():
        for name, r in rows.items():
            cells = " ".join(f"{r[p] * 1e3:14.1f}" if p in r else f"{'-':>14}" for p in PHASES)
            print(f"{world:>2} {name:<14} {cells}")
    path, _ = write_result(parser, args, "zero-phases", {"results_seconds": results}, before)
    print(describe_output(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
