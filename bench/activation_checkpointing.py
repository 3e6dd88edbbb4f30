"""What activation checkpointing saves and costs: a process's peak RSS and step time, off vs units vs every:2.

    python -m bench.activation_checkpointing            # writes bench/results/activation-checkpointing.json
    python -m bench.activation_checkpointing --repeats 1 --steps 2 --out runs/ac-quick.json

The model is tiny_transformer made big enough for its activations to matter (dim 128, 8 blocks, batch 32 of 64
tokens), trained with AdamW on one process, one thread: checkpointing is a per-rank matter (each rank keeps its own
activations), so one rank shows what every rank saves. The worker's own functions choose and wrap the units
(``checkpointed_units``, ``checkpoint_modules``), as ``--activation-checkpointing`` does.

Each measurement is a fresh process (``--variant``), so no variant inherits another's allocator pages; the
repeats interleave the variants in a shuffled order and each figure is the median over repeats:

    peak RSS      the process's peak resident set (Linux VmHWM) over its timed steps, the whole process: torch,
                  the model, AdamW's state and the step's activations;
    step growth   that peak minus the RSS before the timed steps (VmHWM reset through /proc/self/clear_refs after
                  one warm-up step): what one step adds, which is where checkpointing acts;
    step time     median of the timed steps (forward, backward with its recomputation, optimizer step).

On this machine the cores are shared with other work: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

VARIANTS = ["off", "units", "every:2"]


def measure(variant: str, args: argparse.Namespace) -> dict:
    """One variant in this process: ``{"units", "peak_rss_bytes", "step_growth_bytes", "step_seconds"}``."""
    import torch
    import torch.nn.functional as F

    from app.parallel.activation_checkpointing import checkpoint_modules
    from app.worker.config import TrainConfig
    from app.worker.models import TinyTransformer
    from app.worker.workload import checkpointed_units
    from bench.ddp_bench import _proc_status, _reset_peak_rss, _return_freed_memory_to_the_os

    torch.set_num_threads(1)
    _return_freed_memory_to_the_os()  # large tensors get their own pages: RSS follows what a step allocates
    torch.manual_seed(0)
    model = TinyTransformer(dim=args.dim, heads=4, layers=args.layers, max_len=args.seq_len)
    units = checkpointed_units(TrainConfig(model="tiny_transformer", activation_checkpointing=variant), model)
    checkpoint_modules(units.values())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 64, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(1))

    def step() -> float:
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()  # warm-up: AdamW's state, thread pools and allocator arenas exist from here on
    _return_freed_memory_to_the_os()
    _reset_peak_rss()
    before = _proc_status("VmRSS")
    seconds = [step() for _ in range(args.steps)]
    peak = _proc_status("VmHWM")
    return {
        "units": list(units),
        "peak_rss_bytes": peak,
        "step_growth_bytes": peak - before,
        "step_seconds": statistics.median(seconds),
    }


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    """``measure(variant)`` in a fresh interpreter."""
    flags = ["--steps", args.steps, "--batch", args.batch, "--seq-len", args.seq_len, "--dim", args.dim]
    cmd = [sys.executable, "-m", "bench.activation_checkpointing", "--variant", variant, *map(str, flags)]
    out = subprocess.run([*cmd, "--layers", str(args.layers)], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for variant in VARIANTS:
        median = {k: statistics.median(r[k] for r in runs[variant]) for k in runs[variant][0] if k != "units"}
        rows.append({"variant": variant, "units": runs[variant][0]["units"], **median})
    off = rows[0]
    for row in rows:
        row["step_growth_vs_off"] = row["step_growth_bytes"] / off["step_growth_bytes"]
        row["step_time_vs_off"] = row["step_seconds"] / off["step_seconds"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per variant, interleaved")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process (after one warm-up)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--dim", type=int, default=128, help="the transformer's width")
    parser.add_argument("--layers", type=int, default=8, help="the transformer's blocks")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a child: measure one, print JSON
    parser.add_argument("--out", default=None, help="result file (default: bench/results/ for the documented run)")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args)))
        return

    from tools.provenance import describe_output, load_average, write_result

    before = load_average()
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    order = random.Random(0)
    for repeat in range(args.repeats):
        for variant in order.sample(VARIANTS, len(VARIANTS)):
            runs[variant].append(run_variant(variant, args))
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    rows = summarize(runs)
    header = ("variant", "units", "peak RSS MiB", "step growth MiB", "x off", "step ms", "x off")
    print("{:<9} {:>5} {:>12} {:>15} {:>6} {:>8} {:>6}".format(*header))
    for r in rows:
        print(
            f"{r['variant']:<9} {len(r['units']):>5} {r['peak_rss_bytes'] / 2**20:>12.1f} "
            f"{r['step_growth_bytes'] / 2**20:>15.1f} {r['step_growth_vs_off']:>6.2f} "
            f"{r['step_seconds'] * 1e3:>8.1f} {r['step_time_vs_off']:>6.2f}"
        )
    result = {"model": "tiny_transformer", "ranks": 1, "rows": rows, "runs": runs}
    path, _ = write_result(parser, args, "activation-checkpointing", result, before)
    print(describe_output(path))


if __name__ == "__main__":
    main()
