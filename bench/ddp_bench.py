"""DDP step time, memory and compression, side by side in one run: ours vs PyTorch's, at world size 2 on CPU.

    make bench                                   # both models, writes bench/results/ddp-bench.json
    torchrun --standalone --nproc-per-node=2 -m bench.ddp_bench --repeats 7 --steps 10

Every variant trains its own copy of the model on the same batches. Variants are measured *interleaved*: repeat 1
runs every variant for ``--steps`` timed steps, then repeat 2 does the same in another order, and so on; each
variant's figure is the median of its per-repeat medians. On a shared, noisy machine absolute times drift, so
read the ratios (each row against PyTorch's DDP, measured minutes apart at most), not the milliseconds.

Variants (step time):
    no sync           no communication at all: the lower bound
    ours 25MB / 1MB   app.parallel.ddp with that bucket cap
    ours 25MB no recorder   ... with the flight recorder off (app.diagnostics.recorder): its cost is the difference
    ours per-param    app.parallel.ddp with one bucket per parameter (every tensor pays the latency floor)
    torch 25MB        torch.nn.parallel.DistributedDataParallel (fp32 on the wire)
    lesson loop       after backward, all_reduce each p.grad in turn, then divide: no buckets, no overlap
    barrier only      after backward, dist.barrier(): what a step costs when ranks only wait for each other
    ours bf16 / fp16  ours 25MB with the bf16 / fp16 compression hook (half the bytes on the wire)
    ours bf16 view    ... and gradient_as_bucket_view=True (no copy back from the bucket)
    ours / torch view gradient_as_bucket_view=True
    ours / torch find_unused, ours / torch static_graph: the graph walk per step, and static_graph's reuse of it
    ours compiled     ours 25MB, the model compiled whole and cut at its buckets (app.parallel.compile's
                      compile_at_buckets, what the worker does; --compile-backend)
    ours compiled units   ours 25MB over the model's units compiled one by one (compile_units: stages 2 and 3's way)
    torch compiled    torch.compile(torch 25MB): the wrapper compiled whole, its graph cut at the buckets by dynamo's
                      DDPOptimizer, as PyTorch documents; both compile at the warm-up steps, which are not timed

    # compiled vs not, alone: what docs/benchmarks.md's compile block is rendered from
    torchrun --standalone --nproc-per-node=2 -m bench.ddp_bench --no-extras \
        --variants "ours 25MB,ours compiled,ours compiled units,torch compiled" --out bench/results/ddp-compile.json

Then: memory (bytes held by gradients + buckets, and the peak RSS growth of training, ours vs PyTorch's with and
without gradient_as_bucket_view); the loss after ``--loss-steps`` steps with bf16 / fp16 compression against fp32;
the lesson's exercise: the share of the step spent on gradient sync (1 - no-sync / ours) at per-rank batch 1, 16
and 256 on the deep MLP.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app.diagnostics.recorder import RECORDER
from app.parallel import wrap_model
from app.parallel.compile import BACKENDS, compile_at_buckets, compile_units, default_units
from app.parallel.ddp.comm_hooks import HOOKS
from app.worker.allocator import return_freed_memory_to_the_os, trim
from app.worker.dist import distributed, exit_process
from app.worker.models import DeepMLP, TinyTransformer, count_parameter_tensors
from tools.provenance import describe_output, load_average, output_path, provenance

# variant -> (wrapper, constructor arguments, comm hook); None: not wrapped (the loop decides what syncs)
CONFIGS = {
    "no sync": None,
    "ours 25MB": ("ours", {"bucket_cap_mb": 25}, None),
    "ours 25MB no recorder": ("ours", {"bucket_cap_mb": 25}, None),  # the flight recorder off: what it costs
    "ours 1MB": ("ours", {"bucket_cap_mb": 1}, None),
    "ours per-param": ("ours", {"bucket_cap_mb": 1e-9}, None),
    "torch 25MB": ("torch", {"bucket_cap_mb": 25}, None),
    "lesson loop": None,
    "barrier only": None,
    "ours bf16": ("ours", {"bucket_cap_mb": 25}, "bf16"),
    "ours fp16": ("ours", {"bucket_cap_mb": 25}, "fp16"),
    "ours bf16 view": ("ours", {"bucket_cap_mb": 25, "gradient_as_bucket_view": True}, "bf16"),
    "ours view": ("ours", {"bucket_cap_mb": 25, "gradient_as_bucket_view": True}, None),
    "torch view": ("torch", {"bucket_cap_mb": 25, "gradient_as_bucket_view": True}, None),
    "ours find_unused": ("ours", {"bucket_cap_mb": 25, "find_unused_parameters": True}, None),
    "torch find_unused": ("torch", {"bucket_cap_mb": 25, "find_unused_parameters": True}, None),
    "ours static_graph": ("ours", {"bucket_cap_mb": 25, "static_graph": True}, None),
    "torch static_graph": ("torch", {"bucket_cap_mb": 25, "static_graph": True}, None),
    "ours compiled": ("ours", {"bucket_cap_mb": 25}, None),
    "ours compiled units": ("ours", {"bucket_cap_mb": 25}, None),
    "torch compiled": ("torch", {"bucket_cap_mb": 25}, None),
}
# torch.compile: ours whole cut at its buckets, or per unit; torch's wrapper whole
COMPILED = ("ours compiled", "ours compiled units", "torch compiled")
VARIANTS = list(CONFIGS)
MEMORY_VARIANTS = {  # (wrapper, gradient_as_bucket_view)
    "ours": ("ours", False),
    "ours view": ("ours", True),
    "torch": ("torch", False),
    "torch view": ("torch", True),
}
LOSS_VARIANTS = {"torch fp32": ("torch", None), "ours fp32": ("ours", None), "ours bf16": ("ours", "bf16"),
                 "ours fp16": ("ours", "fp16")}  # fmt: skip


class Variant:
    """One way of training: a model copy, its optimizer and what happens after backward."""

    def __init__(self, name: str, base: nn.Module, lr: float = 1e-4, backend: str = "inductor"):
        self.name = name
        model = copy.deepcopy(base)
        if name == "ours compiled units":
            compile_units(default_units(model).values(), backend)
        config = CONFIGS.get(name)
        if config is not None:
            wrapper, kwargs, hook = config
            model = wrap_model(model, wrapper, **kwargs)
            if hook is not None:
                model.register_comm_hook(None, HOOKS[hook])
        if name == "ours compiled":
            compile_at_buckets(model, backend)  # after wrapping: the cuts are the wrapper's bucket caps
        self.opt = torch.optim.SGD(model.parameters(), lr=lr)
        self.model = torch.compile(model, backend=backend) if name == "torch compiled" else model
        self.world = dist.get_world_size()

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn) -> float:
        # The recorder is on for every other variant, as in training; off for this one step (its ring is kept).
        capacity = RECORDER.capacity
        if self.name == "ours 25MB no recorder":
            RECORDER.capacity = 0
        try:
            return self._step(x, y, loss_fn)
        finally:
            RECORDER.capacity = capacity

    def _step(self, x: torch.Tensor, y: torch.Tensor, loss_fn) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = loss_fn(self.model(x), y)
        loss.backward()
        if self.name == "lesson loop":
            for p in self.model.parameters():  # the lesson's code: one blocking all-reduce per tensor
                dist.all_reduce(p.grad)
                p.grad /= self.world
        elif self.name == "barrier only":
            dist.barrier()
        self.opt.step()
        return loss.detach()


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


def measure(
    names: list[str], workload, batch: int, repeats: int, steps: int, warmup: int, backend: str = "inductor"
) -> tuple[dict[str, list], dict[str, float]]:
    """Per variant: its per-repeat medians, and the seconds of its untimed warm-up steps (a compiled one's compile)."""
    torch.manual_seed(0)
    base, x, y, loss_fn = workload(batch)
    variants = [Variant(n, base, backend=backend) for n in names]
    warmup_s: dict[str, float] = {}
    for v in variants:
        t0 = time.perf_counter()
        for _ in range(warmup):  # a compiled variant compiles here (its first step), untimed
            v.step(x, y, loss_fn)
        warmup_s[v.name] = time.perf_counter() - t0
    per_repeat: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        # Interleaved, so drift in machine load hits every variant alike; in a new order each repeat (the same on
        # every rank: seeded by the repeat), so no variant always follows the same one and inherits its caches,
        # allocator state or gloo backlog.
        order = list(variants)
        random.Random(r).shuffle(order)
        for v in order:
            per_repeat[v.name].append(time_steps(v, x, y, loss_fn, steps))
    return per_repeat, warmup_s


def describe(model: nn.Module) -> dict:
    return {
        "parameter_tensors": count_parameter_tensors(model),
        "gradient_mib": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20, 2),
    }


def gradient_bytes(model: nn.Module) -> int:
    """Bytes held by gradients and DDP buckets together, each storage counted once (a view costs nothing)."""
    if hasattr(model, "gradient_bytes"):  # ours knows its buckets
        return model.gradient_bytes()
    storages = {}
    for p in model.parameters():
        if p.grad is not None:
            storages[p.grad.untyped_storage().data_ptr()] = p.grad.untyped_storage().nbytes()
    held = sum(storages.values())
    if isinstance(model, nn.parallel.DistributedDataParallel) and not model.gradient_as_bucket_view:
        # PyTorch's buckets are out of Python's reach; its logging data gives their sizes (the gradients are
        # separate tensors then, so the buckets add to them).
        data = model._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
        held += sum(int(b) for b in str(sizes).split(","))
    return held


def _proc_status(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:  # Linux: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _return_freed_memory_to_the_os() -> None:
    """Make RSS follow tensor allocations (app.worker.allocator, as the worker does): a second variant must not
    reuse the first's freed pages and show no growth."""
    return_freed_memory_to_the_os(128 * 1024)
    trim()


def measure_memory(workload, batch: int, steps: int = 3) -> dict[str, dict]:
    """Per variant: gradient + bucket bytes after ``steps`` steps, and how far the peak RSS rose while training."""
    _return_freed_memory_to_the_os()
    out = {}
    # The first pass pays one-time costs (thread pools, allocator arenas, gloo buffers) whichever variant runs
    # first: it is run again and only the second pass counts.
    for name, (wrapper, view) in [("warm-up", MEMORY_VARIANTS["torch"]), *MEMORY_VARIANTS.items()]:
        torch.manual_seed(0)
        base, x, y, loss_fn = workload(batch)
        gc.collect()
        _return_freed_memory_to_the_os()
        dist.barrier()
        resettable = _reset_peak_rss()
        before = _proc_status("VmRSS")
        model = wrap_model(base, wrapper, bucket_cap_mb=25, gradient_as_bucket_view=view)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)  # no momentum: no optimizer state to count
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
        peak = _proc_status("VmHWM")
        mine = torch.tensor([gradient_bytes(model), peak - before if resettable and peak and before else -1])
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the heavier rank's figure
        out[name] = {"grad_bucket_bytes": int(mine[0]), "peak_rss_growth_bytes": int(mine[1]) if mine[1] >= 0 else None}
        del model, opt, base
        out.pop("warm-up", None)
        gc.collect()
    return out


def compare_losses(steps: int) -> dict[str, dict]:
    """Train the tiny transformer on a learnable rule with each wire format; the loss after ``steps`` steps."""
    torch.manual_seed(0)
    base = TinyTransformer(dim=64, layers=6, max_len=32)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (wrapper, hook) in LOSS_VARIANTS.items():
        model = wrap_model(copy.deepcopy(base), wrapper, bucket_cap_mb=25)
        if hook is not None:
            model.register_comm_hook(None, HOOKS[hook])
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for step in range(steps):
            g = torch.Generator().manual_seed(step * world + rank)
            tokens = torch.randint(0, 64, (16, 32), generator=g)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(tokens).reshape(-1, 64), ((3 * tokens + 1) % 64).reshape(-1))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        last = torch.stack(losses[-3:]).mean().reshape(1)  # the last 3 steps: less noise than one batch
        dist.all_reduce(last)
        out[name] = {"final_loss": last.item() / world, "first_loss": losses[0].item()}
    fp32 = out["torch fp32"]["final_loss"]
    for row in out.values():
        row["vs_torch_fp32"] = row["final_loss"] / fp32 - 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9, help="interleaved repeats per variant (default 9)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per repeat (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    ap.add_argument("--loss-steps", type=int, default=40, help="training steps of the compression loss check")
    ap.add_argument("--models", default="deep_mlp,tiny_transformer", help="comma-separated subset of the models")
    ap.add_argument("--variants", default="all", help="comma-separated subset of the variants (torch 25MB always)")
    ap.add_argument("--no-extras", action="store_true", help="step times only: no memory, loss or sync-share")
    ap.add_argument(
        "--compile-backend",
        default="inductor",
        choices=BACKENDS,
        help="torch.compile's backend for the compiled variants",
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default: bench/results/ddp-bench.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with distributed(force_cpu=True) as ctx:
        return run(args, ap, ctx.rank, ctx.world_size)


def run(args, parser, rank: int, world: int) -> int:
    load_before = load_average()
    models = {"deep_mlp": (mlp_workload, 32), "tiny_transformer": (transformer_workload, 16)}
    models = {m: models[m] for m in args.models.split(",")}
    variants = VARIANTS if args.variants == "all" else ["torch 25MB", *(v for v in args.variants.split(",") if v)]
    variants = list(dict.fromkeys(variants))  # each once, in the order given
    report = {
        "schema": "ddp-bench.v2",
        "world_size": world,
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "steps": args.steps,
        "time_unit": "median seconds per step (slowest rank), median over interleaved repeats",
        "compile_backend": args.compile_backend,  # of the compiled variants, when run
        "models": {},
        "memory": {},
        "compression_loss": {},
        "sync_share": [],
    }
    for model_name, (workload, batch) in models.items():
        per_repeat, warmup_s = measure(
            variants, workload, batch, args.repeats, args.steps, args.warmup, args.compile_backend
        )
        medians = {n: statistics.median(v) for n, v in per_repeat.items()}
        torch_ms = medians["torch 25MB"]
        report["models"][model_name] = {
            **describe(workload(batch)[0]),
            "per_rank_batch": batch,
            "variants": {
                n: {
                    "median_s": medians[n],
                    "ratio_to_torch": medians[n] / torch_ms,
                    "per_repeat_s": per_repeat[n],
                    "warmup_s": warmup_s[n],  # this rank's (rank 0's): a compiled variant's compile is in it
                }
                for n in variants
            },
        }
        if not args.no_extras:
            report["memory"][model_name] = measure_memory(workload, batch)
    if not args.no_extras:
        extras(args, report)

    if rank == 0:
        report = {"schema": report.pop("schema"), **provenance(args, load_before=load_before), **report}
        print_table(report)
        out = output_path(parser, args, "ddp-bench")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print("\n" + describe_output(out))
    return 0


def extras(args, report: dict) -> None:
    """The compression loss check and the lesson's sync-share exercise."""
    report["compression_loss"] = {
        "model": "tiny_transformer",
        "steps": args.loss_steps,
        **compare_losses(args.loss_steps),
    }

    for batch in (1, 16, 256):
        per_repeat, _ = measure(["no sync", "ours 25MB"], mlp_workload, batch, args.repeats, args.steps, args.warmup)
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


def print_table(report: dict) -> None:
    print(
        f"world size {report['world_size']} ({report['backend']}, CPU), {report['repeats']} interleaved repeats "
        f"x {report['steps']} steps; ms = median step time of the slowest rank; load average before/after "
        f"{report['machine']['load_average_before']} / {report['machine']['load_average_after']}\n"
    )
    names = list(report["models"])
    header = "| variant | " + " | ".join(f"{m} ms | ×torch" for m in names) + " |"
    print(header)
    print("|---|" + "---:|---:|" * len(names))
    for v in report["models"][names[0]]["variants"]:
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
    mlp = report["models"].get("deep_mlp", {}).get("variants", {})
    if "lesson loop" in mlp and "ours 25MB" in mlp:
        print(
            f"ours 25MB vs lesson loop on deep_mlp: "
            f"{mlp['lesson loop']['median_s'] / mlp['ours 25MB']['median_s']:.2f}x faster"
        )
    if "ours bf16" in mlp:
        print(f"ours bf16 / torch 25MB (fp32) on deep_mlp: {mlp['ours bf16']['ratio_to_torch']:.2f}x (target <= 0.85x)")
    if report["memory"]:
        print_memory(report["memory"])
    if report["compression_loss"]:
        print_losses(report["compression_loss"])
    if report["sync_share"]:
        print(
            "\ngradient-sync share of the step (deep_mlp, ours 25MB): "
            + ", ".join(f"batch {s['per_rank_batch']}: {s['sync_share']:.0%}" for s in report["sync_share"])
        )


def print_memory(memory: dict) -> None:
    print("\nmemory, after 3 steps (heavier rank): gradients + buckets | peak RSS growth while training, MiB")
    names = list(memory)
    print("| variant | " + " | ".join(f"{m} grads+buckets | {m} peak RSS +" for m in names) + " |")
    print("|---|" + "---:|---:|" * len(names))
    for v in MEMORY_VARIANTS:
        cells = []
        for m in names:
            row = memory[m][v]
            rss = row["peak_rss_growth_bytes"]
            cells.append(f"{row['grad_bucket_bytes'] / 2**20:.1f} | {'n/a' if rss is None else f'{rss / 2**20:.1f}'}")
        print(f"| {v} | " + " | ".join(cells) + " |")


def print_losses(losses: dict) -> None:
    print(f"\nloss after {losses['steps']} steps ({losses['model']}, AdamW, learnable rule), mean of the last 3:")
    for name in LOSS_VARIANTS:
        row = losses[name]
        print(
            f"  {name:11s} {row['final_loss']:.4f}  ({row['vs_torch_fp32']:+.2%} vs torch fp32; "
            f"first {row['first_loss']:.3f})"
        )


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: app.worker.dist.exit_process says why
