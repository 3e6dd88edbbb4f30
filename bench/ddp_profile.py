"""Where a DDP step's time goes, phase by phase: ours vs PyTorch's DDP vs no DDP, in one pair of processes.

    torchrun --standalone --nproc-per-node=2 -m bench.ddp_profile            # writes bench/results/ddp-profile.json
    torchrun --standalone --nproc-per-node=2 -m bench.ddp_profile --repeats 9 --models deep_mlp --out /tmp/p.json

A step is cut into four phases, timed on each rank with ``perf_counter``:

    forward    model(x) and the loss (for a wrapper: its pre- and post-forward work too);
    backward   from ``loss.backward()`` to the end of the autograd graph: the gradient computation, plus the
               wrapper's per-parameter hooks (copies into buckets, all-reduce launches);
    wait       from the end of the graph to ``backward()`` returning: the wrapper's finalize (waiting for the
               all-reduces still in flight, writing averages into ``p.grad``); ~0 without DDP;
    optimizer  ``zero_grad`` and ``step``.

The end of the graph is found without touching either wrapper's internals: a hook on the loss queues an autograd
callback when backward starts, and callbacks run in the order queued, so it runs before the one both reducers
queue later (ours at its first gradient hook, PyTorch's at its last). Variants are measured interleaved, in a
new order each repeat (the same order on both ranks); a phase's figure is the median over repeats of the slowest
rank's per-repeat median. The machine may be shared: read the ratios to PyTorch's row, not the milliseconds.

Variants: ``no DDP`` (the bare model: no communication), ``ours`` and ``torch`` (25 MiB buckets, fp32 on the wire),
``ours bf16`` and ``torch bf16`` (the same, with ``app.parallel.ddp.comm_hooks.bf16_compress_hook``). Beside them, one
all-reduce of the model's gradients alone in fp32, bf16 and fp16 (gloo's), and in bf16 by exchange (ours): the most
a 16-bit wire can save here.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from app.parallel import wrap_model
from app.parallel.ddp.buckets import GradBucket
from app.parallel.ddp.comm_hooks import HOOKS, Exchange
from app.worker.dist import distributed, exit_process
from bench.ddp_bench import describe, mlp_workload, transformer_workload
from bench.provenance import describe_output, load_average, output_path, provenance

PHASES = ("forward", "backward", "wait", "optimizer")
# variant -> (wrapper, comm hook)
VARIANTS = {"no DDP": ("none", None), "ours": ("ours", None), "torch": ("torch", None), "ours bf16": ("ours", "bf16"),
            "torch bf16": ("torch", "bf16")}  # fmt: skip
WORKLOADS = {"deep_mlp": (mlp_workload, 32), "tiny_transformer": (transformer_workload, 16)}


class Profiled:
    """One variant: its own copy of the model and optimizer, and a step that returns its four phase times."""

    def __init__(self, name: str, base: nn.Module):
        wrapper, hook = VARIANTS[name]
        self.name = name
        self.model = wrap_model(copy.deepcopy(base), wrapper, bucket_cap_mb=25)
        if hook is not None:
            self.model.register_comm_hook(None, HOOKS[hook])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self._graph_end = 0.0

    def _mark_graph_end(self) -> None:
        self._graph_end = time.perf_counter()

    def _on_loss_grad(self, grad: torch.Tensor) -> None:
        # The first thing backward runs: queue our callback ahead of the reducer's (see the module docstring).
        torch.autograd.Variable._execution_engine.queue_callback(self._mark_graph_end)

    def step(self, x, y, loss_fn) -> list[float]:
        t0 = time.perf_counter()
        loss = loss_fn(self.model(x), y)
        loss.register_hook(self._on_loss_grad)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return [t1 - t0, self._graph_end - t1, t2 - self._graph_end, t3 - t2]


def profile_variants(names: list[str], workload, batch: int, repeats: int, steps: int, warmup: int) -> dict:
    """Per variant and phase, the per-repeat medians (slowest rank) over ``repeats`` interleaved repeats."""
    torch.manual_seed(0)
    base, x, y, loss_fn = workload(batch)
    variants = [Profiled(n, base) for n in names]
    for v in variants:
        for _ in range(warmup):
            v.step(x, y, loss_fn)
    per_repeat = {n: {p: [] for p in (*PHASES, "step")} for n in names}
    for r in range(repeats):
        order = list(variants)
        random.Random(r).shuffle(order)  # seeded by the repeat: the same order on every rank
        for v in order:
            times = []
            for _ in range(steps):
                dist.barrier()  # start together: one rank's lateness is not billed to the next step
                times.append(v.step(x, y, loss_fn))
            # Per phase the median over steps, then the slowest rank's; the step total likewise (not the sum of
            # the phase medians, which may come from different steps).
            medians = [statistics.median(col) for col in zip(*times)] + [statistics.median(map(sum, times))]
            mine = torch.tensor(medians, dtype=torch.float64)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            for phase, value in zip((*PHASES, "step"), mine.tolist()):
                per_repeat[v.name][phase].append(value)
    return per_repeat


WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def allreduce_alone(numel: int, repeats: int, calls: int = 3) -> dict:
    """Seconds of one all-reduce of ``numel`` gradients (the model's) per wire dtype, nothing else running: what a
    16-bit bucket can save at most. gloo's all-reduce in each dtype, and ours by exchange (``Exchange``: what our
    compressed buckets use) in bf16. Interleaved per repeat; the slowest rank's mean of ``calls``, median over
    repeats. gloo sums 16-bit types more slowly per element than fp32, so half the bytes is not half the time."""
    buffers = {name: torch.randn(numel).to(dtype) for name, dtype in WIRE_DTYPES.items()}
    # A bucket of our wrapper's, compressed to bf16, holding the same gradients: what Exchange averages in a step.
    bucket = GradBucket(0, [nn.Parameter(torch.empty(numel))], [0], is_last=True, wire_dtype=torch.bfloat16)
    buffers["bf16 exchange"] = bucket.buffer().copy_(buffers["bf16"])
    times: dict[str, list[float]] = {name: [] for name in buffers}
    for _ in range(repeats):
        for name, buf in buffers.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                if name == "bf16 exchange":
                    Exchange(bucket, dist.group.WORLD).wait()
                else:
                    dist.all_reduce(buf)
            mine = torch.tensor((time.perf_counter() - t0) / calls, dtype=torch.float64)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            times[name].append(mine.item())
    return {name: {"median_s": statistics.median(v), "per_repeat_s": v} for name, v in times.items()}


def summarise(per_repeat: dict) -> dict:
    torch_step = statistics.median(per_repeat["torch"]["step"]) if "torch" in per_repeat else None
    out = {}
    for name, phases in per_repeat.items():
        medians = {p: statistics.median(v) for p, v in phases.items()}
        out[name] = {
            "median_s": medians,
            "step_ratio_to_torch": medians["step"] / torch_step if torch_step else None,
            "per_repeat_s": phases,
        }
    return out


def print_table(report: dict) -> None:
    """The docs' block (tools/renderers/ddp.py renders it from the JSON), printed: one table, one format."""
    from tools.report import render

    print(render("ddp-profile", report))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats per variant (default 7)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per repeat (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    ap.add_argument("--models", default="deep_mlp,tiny_transformer", help="comma-separated subset of the models")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default: bench/results/ddp-profile.json)")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    names = args.variants.split(",")
    for bad, known, flag in ((set(models) - set(WORKLOADS), WORKLOADS, "--models"), (set(names) - set(VARIANTS),
                             VARIANTS, "--variants")):  # fmt: skip
        if bad:
            ap.error(f"{flag}: unknown {', '.join(sorted(bad))}; choose from {', '.join(known)}")
    torch.set_num_threads(1)  # as bench/ddp_bench.py: two ranks on a 2-core machine, one core each
    with distributed(force_cpu=True) as ctx:
        load_before = load_average()
        report = {"world_size": ctx.world_size, "repeats": args.repeats, "steps": args.steps, "models": {}}
        for model in models:
            workload, batch = WORKLOADS[model]
            per_repeat = profile_variants(names, workload, batch, args.repeats, args.steps, args.warmup)
            built = workload(batch)[0]
            report["models"][model] = {
                **describe(built),
                "per_rank_batch": batch,
                "variants": summarise(per_repeat),
                "allreduce_alone": allreduce_alone(sum(p.numel() for p in built.parameters()), args.repeats),
            }
        if ctx.rank == 0:
            report = {"schema": "ddp-profile.v1", **provenance(args, load_before=load_before), **report}
            print_table(report)
            out = output_path(ap, args, "ddp-profile")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
            print("\n" + describe_output(out))
    return 0


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: app.worker.dist.exit_process says why
