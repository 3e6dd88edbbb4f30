"""What ZeRO saves and costs: per-rank bytes, peak memory, step time and communication of DDP and stages 1-3.

    python -m bench.zero_bench                          # worlds of 2 and 4, writes bench/results/zero.json + .png
    python -m bench.zero_bench --world-sizes 2 --repeats 3 --out runs/zero-quick.json
    python -m bench.zero_bench --bucket-cap-mb 25 --out runs/zero-one-bucket.json   # every wrapper one bucket

The model is a wide MLP trained with AdamW, so the optimizer state (two fp32 moments per parameter) is twice the
parameters: where sharding pays most. This process spawns each world (real ranks, gloo on loopback, one thread
per rank) and every rank runs every variant:

    ddp           app.parallel.ddp (gradient_as_bucket_view: the gradient exists once) + torch.optim.AdamW
    zero1         the same DDP + app.parallel.zero.stage1.ZeroRedundancyOptimizer(AdamW)
    torch zero1   torch's DDP (gradient_as_bucket_view) + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
    zero2         app.parallel.zero.stage2.ShardedGradDataParallel + its AdamW over the shards
    zero2 overlap the same with overlap_gather=True: the parameters' all-gather runs into the next forward
    zero3         app.parallel.zero.stage3.FullyShardedDataParallel (each Linear a unit) + AdamW over the shards
    zero3 prefetch the same with prefetch=1: the next unit's all-gather runs while this one computes
    torch fsdp2   torch.distributed.fsdp.fully_shard on each Linear, then the root + AdamW (it prefetches one unit)

Every bucketed wrapper (our DDP, zero1's, PyTorch's DDP, both zero2) gets the same --bucket-cap-mb, 1 MiB by default:
the model is 8 MiB, so at DDP's usual 25 MiB each wrapper has a single bucket, reduced only once backward is over,
and stage 2's overlap has one all-gather, needed by the very first layer: nothing could overlap anything.

Measured, per rank (the heavier rank's figure):
    bytes         parameters, gradients and optimizer state held after backward, each storage counted once
                  (a view costs nothing; stage 3's gathered copies are 0 bytes then), against the formula
                  Psi*(4 + 4 + 8)/N-style shares: fp32 params 4 B, fp32 grads 4 B, AdamW K = 8 B per element;
    peak RSS      growth of the process's peak resident set (Linux VmHWM, reset through /proc/self/clear_refs)
                  from before the variant's model copy is made to the end of 3 steps: tensors, activations,
                  buckets, gathered units and allocator slack together. tracemalloc would not see torch's tensors
                  (they are not allocated through Python's allocator), so RSS it is;
    step time     interleaved: each repeat runs every variant for --steps steps in a shuffled order (the same on all
                  ranks), back to back after one barrier (a barrier between steps would wait for stage 2's
                  all-gather still in flight, outside the timed step), the last step timed to the end of that
                  all-gather; a variant's figure is the median of its per-repeat medians, with its ratio to ddp;
    comm bytes    bytes handed to collectives per step (from the wrappers' counters), and the ring model's bytes
                  each rank sends: all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N of the buffer.

On this machine the cores are shared: read the ratios, not the milliseconds. GPU/NCCL never ran here.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app.world import spawn_world
from bench.ddp_bench import _proc_status, _reset_peak_rss, _return_freed_memory_to_the_os
from tools.provenance import describe_output, load_average, output_path, provenance

VARIANTS = ["ddp", "zero1", "torch zero1", "zero2", "zero2 overlap", "zero3", "zero3 prefetch", "torch fsdp2"]
LR = 1e-3


def wide_mlp(width: int, depth: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Variant:
    """One way of training: the thing to call, its optimizer, and how to read what it holds and sends."""

    def __init__(self, name: str, base: nn.Module, bucket_cap_mb: float):
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

        from app.parallel.ddp import DistributedDataParallel
        from app.parallel.zero.stage1 import ZeroRedundancyOptimizer
        from app.parallel.zero.stage2 import ShardedGradDataParallel
        from app.parallel.zero.stage3 import FullyShardedDataParallel

        self.name, self.model, cap = name, copy.deepcopy(base), bucket_cap_mb
        if name in ("ddp", "zero1"):
            self.wrapped = DistributedDataParallel(self.model, gradient_as_bucket_view=True, bucket_cap_mb=cap)
        elif name == "torch zero1":
            torch_ddp = nn.parallel.DistributedDataParallel
            self.wrapped = torch_ddp(self.model, gradient_as_bucket_view=True, bucket_cap_mb=cap)
        elif name.startswith("zero2"):
            self.wrapped = ShardedGradDataParallel(self.model, bucket_cap_mb=cap, overlap_gather=name != "zero2")
        elif name.startswith("zero3"):
            self.wrapped = FullyShardedDataParallel(self.model, prefetch=int(name != "zero3"))
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in self.model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            self.wrapped = fully_shard(self.model, mesh=mesh)
        if name == "zero1":
            self.opt = ZeroRedundancyOptimizer(self.wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        elif name == "torch zero1":
            self.opt = TorchZero(self.wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        elif name.startswith("zero2"):
            self.opt = self.wrapped.build_optimizer(torch.optim.AdamW, lr=LR)
        else:
            self.opt = torch.optim.AdamW(self.wrapped.parameters(), lr=LR)

    def forward_backward(self, x, y) -> None:
        self.opt.zero_grad(set_to_none=True)
        F.mse_loss(self.wrapped(x), y).backward()

    def step(self, x, y) -> None:
        self.forward_backward(x, y)
        self.opt.step()

    def finish(self) -> None:
        """Wait for what a step left in flight (stage 2's overlapped all-gather): the parameters are whole after."""
        if hasattr(self.wrapped, "wait_parameters"):
            self.wrapped.wait_parameters()

    def comm_bytes(self) -> dict[str, int] | None:
        """Cumulative bytes handed to each collective (ours only; PyTorch's wrappers keep no such counter)."""
        if self.name in ("ddp", "zero1"):
            reduced = self.wrapped.stats.bytes_reduced
            out = {"all_reduce": reduced}
            if self.name == "zero1":  # every owner broadcasts its partition once per step: the parameters' bytes
                params = sum(p.numel() * p.element_size() for p in self.model.parameters())
                out["broadcast"] = params * self.steps_taken
            return out
        if self.name.startswith(("zero2", "zero3")):
            return dict(self.wrapped.comm_bytes)
        return None

    steps_taken = 0

    def held_bytes(self) -> dict[str, int]:
        """Parameters, gradients and optimizer state this rank holds now, each storage counted once."""
        params = list(self.wrapped.parameters())
        if self.name.startswith("zero2"):
            params = [*self.model.parameters(), *self.wrapped.shard_parameters()]
        if self.name.startswith("zero3"):
            params = [*params, *(p for u in self.wrapped.units for p in u.flat_shard.params)]
        grads = [p.grad for p in params if p.grad is not None]
        state_dict = self.opt.optim.state if self.name in ("zero1", "torch zero1") else self.opt.state
        state = [v for s in state_dict.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return {"params": _storage_bytes(params), "grads": _storage_bytes(grads), "optimizer": _storage_bytes(state)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # fully_shard's DTensors: this rank's shard


def _storage_bytes(tensors) -> int:
    storages = {}
    for t in tensors:
        s = _local(t.detach()).untyped_storage()
        storages[s.data_ptr() if s.nbytes() else id(s)] = s.nbytes()
    return sum(storages.values())


def batch(step: int, size: int, width: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, width, generator=g), torch.randn(size, width, generator=g)


def measure_memory(rank: int, world: int, base: nn.Module, cfg: dict) -> dict:
    """Per variant, built alone: the bytes it holds after backward and its peak-RSS growth over 3 steps."""
    x, y = batch(rank, cfg["batch"], cfg["width"])
    out = {}
    # The first pass pays one-time costs (thread pools, gloo buffers, allocator arenas): run one variant first and
    # discard it.
    for name in ["warm-up", *VARIANTS]:
        gc.collect()
        _return_freed_memory_to_the_os()
        dist.barrier()
        resettable = _reset_peak_rss()
        before = _proc_status("VmRSS")
        variant = Variant("ddp" if name == "warm-up" else name, base, cfg["bucket_cap_mb"])
        for _ in range(2):
            variant.step(x, y)
        variant.forward_backward(x, y)
        held = variant.held_bytes()  # after backward: gradients exist, before the step frees nothing
        variant.opt.step()
        variant.finish()
        peak = _proc_status("VmHWM")
        mine = torch.tensor([held["params"], held["grads"], held["optimizer"], peak - before if resettable else -1])
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        if name != "warm-up":
            out[name] = {
                "params_bytes": int(mine[0]),
                "grads_bytes": int(mine[1]),
                "optimizer_bytes": int(mine[2]),
                "peak_rss_growth_bytes": int(mine[3]) if mine[3] >= 0 else None,
            }
        del variant
    return out


def warmed_variants(rank: int, base: nn.Module, cfg: dict, names: list[str]) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Each variant built from ``base`` and stepped ``cfg["warmup"]`` times untimed; this rank's batch."""
    variants = {name: Variant(name, base, cfg["bucket_cap_mb"]) for name in names}
    x, y = batch(rank, cfg["batch"], cfg["width"])
    for v in variants.values():
        for _ in range(cfg["warmup"]):
            v.step(x, y)
        v.finish()
    return variants, x, y


def measure_time(rank: int, world: int, base: nn.Module, cfg: dict) -> dict:
    variants, x, y = warmed_variants(rank, base, cfg, VARIANTS)
    start_bytes = {name: v.comm_bytes() for name, v in variants.items()}
    per_repeat: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for repeat in range(cfg["repeats"]):
        order = VARIANTS[:]
        random.Random(repeat).shuffle(order)  # the same order on every rank: collectives must match
        for name in order:
            dist.barrier()  # every rank starts together: the times are the steps', not the skew's
            ticks = [time.perf_counter()]
            for k in range(cfg["steps"]):
                variants[name].step(x, y)
                variants[name].steps_taken += 1
                if k == cfg["steps"] - 1:
                    variants[name].finish()  # nothing left in flight for the next variant's steps to wait for
                ticks.append(time.perf_counter())
            per_repeat[name].append(statistics.median(b - a for a, b in zip(ticks, ticks[1:])))
    steps = cfg["repeats"] * cfg["steps"]
    comm = {}
    for name, v in variants.items():
        now = v.comm_bytes()
        comm[name] = None if now is None else {k: (now[k] - start_bytes[name].get(k, 0)) // steps for k in now}
    return {"per_repeat_seconds": per_repeat, "comm_bytes_per_step": comm}


def rank_main(rank: int, world: int, cfg: dict) -> dict:
    torch.manual_seed(0)
    base = wide_mlp(cfg["width"], cfg["depth"])
    return {
        "memory": measure_memory(rank, world, base, cfg),
        "time": measure_time(rank, world, base, cfg),
        "psi": sum(p.numel() for p in base.parameters()),
    }


# -- in the parent: formulas, table, JSON, plot --------------------------------------------------------------------
def formula_bytes(name: str, psi: int, n: int) -> int:
    """fp32 params (4 B) + fp32 grads (4 B) + AdamW's two fp32 moments (K = 8 B) per element, by what is sharded."""
    p, g, k = 4 * psi, 4 * psi, 8 * psi
    return {
        "ddp": p + g + k,
        "zero1": p + g + k / n,
        "torch zero1": p + g + k / n,
        "zero2": p + (g + k) / n,
        "zero2 overlap": p + (g + k) / n,
        "zero3": (p + g + k) / n,
        "zero3 prefetch": (p + g + k) / n,
        "torch fsdp2": (p + g + k) / n,
    }[name]


def ring_wire_bytes(comm: dict | None, n: int) -> int | None:
    """Bytes each rank sends per step under the ring model, from the buffers handed to each collective."""
    if comm is None:
        return None
    share = (n - 1) / n
    factor = {"all_reduce": 2 * share, "reduce_scatter": share, "all_gather": share, "broadcast": share}
    return int(sum(factor[k] * v for k, v in comm.items()))


def summarise(world: int, report: dict) -> dict:
    psi = report["psi"]
    medians = {n: statistics.median(v) for n, v in report["time"]["per_repeat_seconds"].items()}
    out = {}
    for name in VARIANTS:
        mem = report["memory"][name]
        total = mem["params_bytes"] + mem["grads_bytes"] + mem["optimizer_bytes"]
        comm = report["time"]["comm_bytes_per_step"][name]
        out[name] = {
            **mem,
            "total_bytes": total,
            "formula_bytes": int(formula_bytes(name, psi, world)),
            "total_vs_formula": round(total / formula_bytes(name, psi, world), 4),
            "optimizer_vs_ddp": round(mem["optimizer_bytes"] / report["memory"]["ddp"]["optimizer_bytes"], 4),
            "step_seconds_median": medians[name],
            "step_seconds_per_repeat": report["time"]["per_repeat_seconds"][name],
            "step_time_vs_ddp": round(medians[name] / medians["ddp"], 3),
            "comm_bytes_per_step": comm,
            "ring_wire_bytes_per_rank_per_step": ring_wire_bytes(comm, world),
        }
    return out


def targets(results: dict) -> list[dict]:
    out = []
    for world, rows in results.items():
        n = int(world)
        share = rows["zero1"]["optimizer_vs_ddp"]
        out.append(
            {
                "target": f"world {n}: stage 1 optimizer state per rank within 5% of 1/N of DDP's",
                "value": share,
                "held": abs(share * n - 1) <= 0.05,
            }
        )
        for name, what, of, limit in (
            ("zero2", "stage 2", "ddp", 1.15),
            ("zero2 overlap", "stage 2 overlapped", "ddp", 1.10),
            ("zero3 prefetch", "stage 3 prefetching", "ddp", 1.5),
            ("zero3 prefetch", "stage 3 prefetching", "torch fsdp2", 0.5),
        ):
            ratio = round(rows[name]["step_seconds_median"] / rows[of]["step_seconds_median"], 3)
            target = f"world {n}: {what} step time within {limit}x {of}'s"
            out.append({"target": target, "value": ratio, "held": ratio <= limit})
    return out


def print_table(results: dict, psi: int) -> None:
    mib = 2**20
    print(f"wide MLP, Psi = {psi:,} parameters ({4 * psi / mib:.1f} MiB fp32), AdamW; per rank, heavier rank's figure")
    head = (
        f"{'N':>2} {'variant':<14} {'params':>8} {'grads':>8} {'optim':>8} {'total':>8} {'formula':>8} "
        f"{'peak RSS+':>9} {'step ms':>8} {'vs ddp':>7} {'comm MiB':>9} {'wire MiB':>9}"
    )
    print(head)
    for world, rows in results.items():
        for name, r in rows.items():
            comm = r["comm_bytes_per_step"]
            comm_s = f"{sum(comm.values()) / mib:9.2f}" if comm else f"{'-':>9}"
            wire = r["ring_wire_bytes_per_rank_per_step"]
            wire_s = f"{wire / mib:9.2f}" if wire is not None else f"{'-':>9}"
            peak = r["peak_rss_growth_bytes"]
            peak_s = f"{peak / mib:9.1f}" if peak is not None else f"{'-':>9}"
            print(
                f"{world:>2} {name:<14} {r['params_bytes'] / mib:8.2f} {r['grads_bytes'] / mib:8.2f} "
                f"{r['optimizer_bytes'] / mib:8.2f} {r['total_bytes'] / mib:8.2f} {r['formula_bytes'] / mib:8.2f} "
                f"{peak_s} {r['step_seconds_median'] * 1e3:8.1f} {r['step_time_vs_ddp']:6.2f}x {comm_s} {wire_s}"
            )
    print("(MiB; formula: fp32 params 4 B + grads 4 B + AdamW K = 8 B per element, the sharded terms / N)")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    mib = 2**20
    labels, x = [], 0
    for world, rows in results.items():
        for name, r in rows.items():
            bottom = 0.0
            for key, color in (("params_bytes", "#4c72b0"), ("grads_bytes", "#dd8452"), ("optimizer_bytes", "#55a868")):
                ax_mem.bar(x, r[key] / mib, bottom=bottom, color=color, label=key.split("_")[0] if x == 0 else None)
                bottom += r[key] / mib
            ax_mem.plot([x - 0.4, x + 0.4], [r["formula_bytes"] / mib] * 2, color="black", lw=1.5,
                        label="formula" if x == 0 else None)  # fmt: skip
            ax_time.bar(x, r["step_time_vs_ddp"], color="#8172b2")
            labels.append(f"{name}\nN={world}")
            x += 1
        x += 0.5
    ticks = [i + (i // len(VARIANTS)) * 0.5 for i in range(len(labels))]
    for ax in (ax_mem, ax_time):
        ax.set_xticks(ticks, labels, fontsize=7, rotation=60)
    ax_mem.set_ylabel("MiB per rank (after backward)")
    ax_mem.set_title("what each rank holds")
    ax_mem.legend(fontsize=8)
    ax_time.axhline(1.0, color="black", lw=0.8)
    ax_time.axhline(1.10, color="red", lw=0.8, ls="--", label="1.10x target (stage 2 overlapped)")
    ax_time.axhline(1.5, color="orange", lw=0.8, ls="--", label="1.5x target (stage 3 prefetching)")
    ax_time.set_ylabel("median step time / DDP's")
    ax_time.set_title("step time against DDP (interleaved repeats)")
    ax_time.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_run_args(p: argparse.ArgumentParser, repeats: int) -> None:
    """The model and the timed run: what this bench and bench.zero_phases share."""
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="worlds to run (default 2 4)")
    p.add_argument("--width", type=int, default=512, help="MLP width (default 512)")
    p.add_argument("--depth", type=int, default=8, help="Linear layers (default 8)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    p.add_argument("--repeats", type=int, default=repeats, help=f"interleaved repeats (default {repeats})")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant per repeat (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0, help="every wrapper's bucket size, MiB (default 1)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, repeats=5)
    p.add_argument("--timeout", type=float, default=900, help="seconds a world may take (default 900)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/zero.json)")
    args = p.parse_args(argv)
    for name in ("width", "depth", "batch", "repeats", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if any(n < 2 for n in args.world_sizes):
        p.error(f"--world-sizes must be >= 2 each, got {args.world_sizes}")
    return p, args


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    path = output_path(parser, args, "zero")
    before = load_average()
    cfg = {k: getattr(args, k) for k in ("width", "depth", "batch", "repeats", "steps", "warmup", "bucket_cap_mb")}
    results, psi = {}, None
    for world in args.world_sizes:
        report = spawn_world(rank_main, world, cfg, timeout=args.timeout)[0]  # rank 0's report
        psi = report["psi"]
        results[str(world)] = summarise(world, report)
    print_table(results, psi)
    checked = targets(results)
    for t in checked:
        print(f"{'HELD' if t['held'] else 'MISSED'}: {t['target']} ({t['value']})")
    doc = {
        "schema": "zero-bench.v1",
        **provenance(args, load_before=before),
        "model": {"kind": "wide_mlp", "width": args.width, "depth": args.depth, "psi": psi},
        "memory_method": "per-rank storage bytes after backward; peak = VmHWM growth (Linux /proc), not tracemalloc",
        "results": results,
        "targets": checked,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    plot(results, path.with_suffix(".png"))
    print(describe_output(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
