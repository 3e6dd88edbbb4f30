"""Gradient accumulation across real ranks: every claim of ``app.parallel.accum`` measured, then a throughput sweep.

    make accum                                                     # world size 2 on CPU, 1.5-2 minutes
    .venv/bin/python -m bench.accum --steps 4 --accum-steps 1,2,4  # a quicker sweep
    .venv/bin/python -m bench.accum --width 512 --micro-batch 32   # more compute per sync (slower: minutes)

This process spawns ``--world-size`` ranks (real processes, gloo on loopback) and prints what they measured:

    equivalence   one batch vs 4 micro-batches of 4, in one process and under DDP (ours and PyTorch's);
                  2×8 vs 4×4 (both accumulated), with the tolerance that needs and why
    syncs         our DDP's own counter (``ddp.stats.sync_calls``): 1 per effective step with sync on last, K when
                  syncing every micro-batch, and K again when the forward runs outside ``no_sync()`` (the trap)
    wrong scale   the loss not divided by K: how far the parameters land from the reference after one step
    AdamW         the optimizer state advances once per effective step, not once per micro-batch
    sweep         fixed micro-batch, K in 1..16: samples/s, median step time and syncs, sync on last vs every

It writes the sweep and the checks to ``bench/results/accum-curve.json`` (schema ``accum-curve.v1``, with the commit,
settings and machine load of the run: ``tools/provenance.py``) and a plot, ``accum-curve.png``, beside it; with other
flags than the defaults to ``runs/`` instead, unless ``--out`` names the JSON. Exit status: 1 if a claim does not
hold, 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from app.parallel import wrap_model
from app.parallel.accum import accumulation_step, effective_batch_size
from app.worker.models import DeepMLP, MiniMLP
from tools.provenance import describe_output, load_average, output_path, provenance

SCHEMA = "accum-curve.v1"
TOLERANCE = 1e-4  # the bar for "equal": max |Δgrad| and max |Δparam| against one big batch
# 2×8 and 4×4 are both fp32 sums of the same 16 per-sample gradients in a different order (two partial means of 8
# vs four of 4). fp32 addition is not associative, so they differ by rounding: a few ulp of the largest gradient
# (measured ~1e-8). 1e-6 leaves a wide margin yet is 100× tighter than TOLERANCE; the same comparison in float64
# lands near 1e-17, which shows the gap is rounding, not a bug.
SPLIT_TOLERANCE = 1e-6
K = 4  # micro-batches per rank in the claims below
MICRO = 4  # samples per micro-batch in the claims below


# -- run inside each rank ------------------------------------------------------------------------------------------
def classification_batch(step: int, size: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank (a generator seeded by the step): MiniMLP's 32 features → 8 classes."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, 32, generator=g, dtype=dtype), torch.randint(0, 8, (size,), generator=g)


def split(x: torch.Tensor, y: torch.Tensor, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(x.split(micro), y.split(micro)))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def max_diff(a: torch.nn.Module, b: torch.nn.Module, grads: bool) -> float:
    pairs = zip(unwrap(a).parameters(), unwrap(b).parameters())
    return max(((p.grad - q.grad) if grads else (p - q)).abs().max().item() for p, q in pairs)


def max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def compare(
    model,
    *,
    rank: int,
    world: int,
    steps: int = 3,
    ref_micro: int | None = None,
    make_opt=sgd,
    dtype=torch.float32,
    **step_kwargs,
) -> dict:
    """Train a copy of ``model``'s module on each whole global batch (or, with ``ref_micro``, by accumulating
    micro-batches of that size) and ``model`` by accumulating K micro-batches of MICRO on this rank's slice.

    Returns the worst max |Δgrad| and max |Δparam| over the steps and the ranks, and the optimizer's step count.
    """
    ref = copy.deepcopy(unwrap(model))
    ref_opt, opt = make_opt(ref.parameters()), make_opt(model.parameters())
    dgrad = dparam = 0.0
    for step in range(steps):
        x, y = classification_batch(step, K * MICRO * world, dtype)
        if ref_micro is None:  # the reference: one process, the whole effective batch at once
            ref_opt.zero_grad(set_to_none=True)
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
        else:
            accumulation_step(ref, ref_opt, split(x, y, ref_micro), F.cross_entropy)
        mine = split(x.chunk(world)[rank], y.chunk(world)[rank], MICRO)
        accumulation_step(model, opt, mine, F.cross_entropy, **step_kwargs)
        dgrad, dparam = max(dgrad, max_diff(ref, model, grads=True)), max_diff(ref, model, grads=False)
    dgrad, dparam = max_over_ranks([dgrad, dparam])
    counts = [int(s["step"]) for s in opt.state.values() if "step" in s]
    return {
        "max_abs_dgrad": dgrad,
        "max_abs_dparam": dparam,
        "optimizer_steps": steps,
        "state_step": [min(counts), max(counts)] if counts else None,
    }


def equivalence(rank: int, world: int, base: torch.nn.Module) -> dict:
    n = K * MICRO * world
    out = {
        "single_16_vs_4x4": compare(copy.deepcopy(base), rank=0, world=1),
        f"ddp_{n}_vs_{world}x{K}x{MICRO}": compare(wrap_model(copy.deepcopy(base), "ours"), rank=rank, world=world),
        f"torch_ddp_{n}_vs_{world}x{K}x{MICRO}": compare(
            wrap_model(copy.deepcopy(base), "torch"), rank=rank, world=world
        ),
    }
    for dtype in (torch.float32, torch.float64):  # 2×8 vs 4×4, both accumulated
        name = "2x8_vs_4x4" + ("" if dtype == torch.float32 else "_float64")
        out[name] = compare(copy.deepcopy(base).to(dtype), rank=0, world=1, ref_micro=8, dtype=dtype)
    return out


def forward_outside_no_sync_step(ddp, optimizer, micro_batches, loss_fn) -> None:
    """The trap: only backward() inside no_sync(). The forward already armed the sync, so every micro-batch syncs."""
    optimizer.zero_grad(set_to_none=True)
    for i, (x, y) in enumerate(micro_batches):
        loss = loss_fn(ddp(x), y) / len(micro_batches)
        with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            loss.backward()
    optimizer.step()


def sync_counts(rank: int, world: int, base: torch.nn.Module, steps: int = 3) -> dict:
    out = {}
    for variant in ("sync_on_last", "sync_every_micro_batch", "forward_outside_no_sync"):
        ddp = wrap_model(copy.deepcopy(base), "ours")
        opt = sgd(ddp.parameters())
        counted = 0
        for step in range(steps):
            x, y = classification_batch(step, K * MICRO * world)
            mine = split(x.chunk(world)[rank], y.chunk(world)[rank], MICRO)
            if variant == "forward_outside_no_sync":
                forward_outside_no_sync_step(ddp, opt, mine, F.cross_entropy)
            else:
                every = variant == "sync_every_micro_batch"
                counted += accumulation_step(ddp, opt, mine, F.cross_entropy, sync_every_micro_batch=every).syncs
        out[variant] = {
            "sync_calls": ddp.stats.sync_calls,
            "step_result_syncs": counted,
            "bytes_reduced": ddp.stats.bytes_reduced,
            "optimizer_steps": steps,
            "accum_steps": K,
        }
    return out


def wrong_scale(rank: int, world: int, base: torch.nn.Module) -> dict:
    """One step with the loss not divided by K, next to the right one, both against one big batch."""
    out = {}
    for name, make_opt in (("sgd", lambda p: torch.optim.SGD(p, lr=0.1)), ("adamw", torch.optim.AdamW)):
        start = [p.detach().clone() for p in base.parameters()]
        moved = {}
        for scale in (True, False):
            ddp = wrap_model(copy.deepcopy(base), "ours")
            moved[scale] = compare(ddp, rank=rank, world=world, steps=1, make_opt=make_opt, scale_loss=scale)
            moved[scale]["update_norm"] = (
                torch.cat([(p.detach() - s).flatten() for p, s in zip(ddp.module.parameters(), start)]).norm().item()
            )
        out[name] = {
            "max_abs_dparam_right": moved[True]["max_abs_dparam"],
            "max_abs_dparam_wrong": moved[False]["max_abs_dparam"],
            "max_abs_dgrad_wrong": moved[False]["max_abs_dgrad"],
            "update_ratio": moved[False]["update_norm"] / moved[True]["update_norm"],
            "accum_steps": K,
        }
    return out


def adamw_state(rank: int, world: int, base: torch.nn.Module, steps: int = 5) -> dict:
    right = compare(
        wrap_model(copy.deepcopy(base), "ours"), rank=rank, world=world, steps=steps, make_opt=torch.optim.AdamW
    )
    # The mistake: optimizer.step() inside the micro-batch loop (each micro-batch then has to sync, too).
    ddp = wrap_model(copy.deepcopy(base), "ours")
    ref = copy.deepcopy(base)
    opt, ref_opt = torch.optim.AdamW(ddp.parameters()), torch.optim.AdamW(ref.parameters())
    for step in range(steps):
        x, y = classification_batch(step, K * MICRO * world)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        for xm, ym in split(x.chunk(world)[rank], y.chunk(world)[rank], MICRO):
            opt.zero_grad()
            (F.cross_entropy(ddp(xm), ym) / K).backward()
            opt.step()
    counts = [int(s["step"]) for s in opt.state.values()]
    return {
        "accumulation_step": right,
        "step_per_micro_batch": {
            "state_step": [min(counts), max(counts)],
            "optimizer_steps": steps,
            "max_abs_dparam": max_over_ranks([max_diff(ref, ddp, grads=False)])[0],
        },
    }


def sweep(rank: int, world: int, cfg: dict) -> tuple[list[dict], float]:
    """Fixed micro-batch; every (K, sync mode) point keeps its own model and they take turns, one step each, so a
    burst of load from elsewhere on the machine lands on all points alike instead of spoiling one.

    Returns the points and the compute-only ceiling (samples/s with no sync and no optimizer step)."""
    width, micro = cfg["width"], cfg["micro_batch"]
    teacher = torch.randn(width, width, generator=torch.Generator().manual_seed(7)) / width**0.5
    points = []
    for k in cfg["accum_steps"]:
        for mode in ("last", "every"):
            torch.manual_seed(0)
            ddp = wrap_model(DeepMLP(width, cfg["depth"]), "ours")
            points.append(
                {
                    "sync_mode": mode,
                    "accum_steps": k,
                    "ddp": ddp,
                    "times": [],
                    "losses": [],
                    "opt": [],
                    "optimizer": torch.optim.AdamW(ddp.parameters(), lr=1e-3),
                }
            )
    compute = []  # seconds per micro-batch of forward + backward alone: the ceiling that accumulation approaches
    for step in range(cfg["warmup"] + cfg["steps"]):
        probe = points[0]["ddp"]
        dist.barrier()
        t0 = time.perf_counter()
        with probe.no_sync():  # no sync, no optimizer step; its next accumulation_step zeroes these gradients
            for _ in range(4):
                x = torch.randn(micro, width)
                F.mse_loss(probe(x), x @ teacher).backward()
        if step >= cfg["warmup"]:
            compute.append((time.perf_counter() - t0) / 4)
        for p in points:
            g = torch.Generator().manual_seed(step * 1000 + rank)  # each rank its own data, as a sampler gives
            mbs = [(x, x @ teacher) for x in (torch.randn(micro, width, generator=g) for _ in range(p["accum_steps"]))]
            if step == cfg["warmup"]:
                p["calls"] = p["ddp"].stats.sync_calls
            dist.barrier()  # start together: a rank still busy with the previous point would show up as sync time
            t0 = time.perf_counter()
            result = accumulation_step(
                p["ddp"], p["optimizer"], mbs, F.mse_loss, sync_every_micro_batch=p["sync_mode"] == "every"
            )
            if step >= cfg["warmup"]:
                p["times"].append(time.perf_counter() - t0)
                p["losses"].append(result.loss)
                p["opt"].append(result.optimizer_seconds)
    ceiling = micro * world / statistics.median(compute)
    out = []
    for p in points:
        loss = torch.tensor(statistics.fmean(p["losses"]), dtype=torch.float64)
        dist.all_reduce(loss)
        eff = effective_batch_size(micro, p["accum_steps"], world)
        median = statistics.median(p["times"])
        sync_calls = p["ddp"].stats.sync_calls - p["calls"]
        out.append(
            {
                "sync_mode": p["sync_mode"],
                "effective_batch": eff,
                "accum_steps": p["accum_steps"],
                "micro_batch": micro,
                "avg_loss": loss.item() / world,
                "samples_per_sec": eff / median,
                "median_step_ms": median * 1e3,
                "sync_calls": sync_calls,
                "steps": cfg["steps"],
                "syncs_per_sample": sync_calls / (cfg["steps"] * eff),
                "median_optimizer_ms": statistics.median(p["opt"]) * 1e3,
                "fraction_of_compute_only": eff / median / ceiling,
                "gradient_bytes": sum(p["ddp"].bucket_sizes),
            }
        )
    return out, ceiling


def rank_main(rank: int, world: int, cfg: dict) -> dict:
    torch.manual_seed(0)
    base = MiniMLP()
    report = {
        "equivalence": equivalence(rank, world, base),
        "syncs": sync_counts(rank, world, base),
        "wrong_scale": wrong_scale(rank, world, base),
        "adamw": adamw_state(rank, world, base),
    }
    report["points"], report["compute_only_samples_per_sec"] = sweep(rank, world, cfg)
    return report


def run_ranks(world: int, cfg: dict, timeout: float) -> dict:
    """The ranks on a fresh local world (app.world), waited for (bounded): rank 0's report; a rank's failure raises
    ``WorldFailed`` with its traceback."""
    from app.world import spawn_world

    return spawn_world(rank_main, world, cfg, timeout=timeout)[0]


# -- in the parent: checks, table, JSON, plot ----------------------------------------------------------------------
def check(report: dict) -> list[str]:
    """Every claim as (holds, text); returns the texts that do not hold."""
    eq, syncs, adamw = report["equivalence"], report["syncs"], report["adamw"]
    claims = [
        (r["max_abs_dgrad"] < TOLERANCE and r["max_abs_dparam"] < TOLERANCE, f"{name} within {TOLERANCE}")
        for name, r in eq.items()
        if not name.startswith("2x8")
    ]
    claims.append(
        (
            eq["2x8_vs_4x4"]["max_abs_dparam"] < SPLIT_TOLERANCE
            and eq["2x8_vs_4x4"]["max_abs_dgrad"] < SPLIT_TOLERANCE,
            f"2x8_vs_4x4 within {SPLIT_TOLERANCE}",
        )
    )
    for variant, per_step in (("sync_on_last", 1), ("sync_every_micro_batch", K), ("forward_outside_no_sync", K)):
        s = syncs[variant]
        claims.append((s["sync_calls"] == per_step * s["optimizer_steps"], f"{variant}: {per_step} sync(s)/step"))
    ratio = report["wrong_scale"]["sgd"]["update_ratio"]
    claims.append((abs(ratio - K) < 0.01 * K, f"unscaled loss makes the SGD step {K}x too big (got {ratio:.3f}x)"))
    right = adamw["accumulation_step"]
    claims.append((right["state_step"] == [right["optimizer_steps"]] * 2, "AdamW state step == optimizer steps"))
    claims.append((right["max_abs_dparam"] < TOLERANCE, f"AdamW accumulation within {TOLERANCE}"))
    for p in report["points"]:
        want = p["steps"] * (1 if p["sync_mode"] == "last" else p["accum_steps"])
        claims.append((p["sync_calls"] == want, f"sweep K={p['accum_steps']} sync {p['sync_mode']}: {want} syncs"))
    return [text for holds, text in claims if not holds]


def render(report: dict, cfg: dict) -> str:
    eq, syncs, ws, adamw = report["equivalence"], report["syncs"], report["wrong_scale"], report["adamw"]
    lines = [f"== equivalence: SGD(momentum 0.9), 3 steps, max over steps and ranks (bar {TOLERANCE:g}) =="]
    lines += [
        f"  {name:<28} max|Δgrad| {r['max_abs_dgrad']:.2e}   max|Δparam| {r['max_abs_dparam']:.2e}"
        for name, r in eq.items()
    ]
    lines.append(f"  (2x8 vs 4x4 uses {SPLIT_TOLERANCE:g}: same sums in another order; float64 shows it is rounding)")
    lines.append(f"== gradient syncs: our DDP's counter, K={K} micro-batches, 3 optimizer steps ==")
    for variant, s in syncs.items():
        lines.append(
            f"  {variant:<24} {s['sync_calls']:>3} syncs ({s['sync_calls'] / s['optimizer_steps']:.0f} per "
            f"step), {s['bytes_reduced'] / 1024:.1f} KiB reduced"
        )
    lines.append(f"== wrong scale: loss not divided by K={K}, one step, vs one big batch ==")
    for name, r in ws.items():
        lines.append(
            f"  {name:<6} max|Δparam| {r['max_abs_dparam_wrong']:.2e} "
            f"(right: {r['max_abs_dparam_right']:.1e})   update {r['update_ratio']:.2f}× the right one"
        )
    a, b = adamw["accumulation_step"], adamw["step_per_micro_batch"]
    lines.append(f"== AdamW: {a['optimizer_steps']} optimizer steps of K={K} ==")
    lines.append(
        f"  accumulation_step        state step {a['state_step'][1]}, max|Δparam| vs one big batch "
        f"{a['max_abs_dparam']:.2e}"
    )
    lines.append(
        f"  step() per micro-batch   state step {b['state_step'][1]}, max|Δparam| vs one big batch "
        f"{b['max_abs_dparam']:.2e}"
    )
    lines.append(
        f"== sweep: DeepMLP(width={cfg['width']}, depth={cfg['depth']}), micro-batch {cfg['micro_batch']}, "
        f"world {cfg['world_size']}, AdamW, median of {cfg['steps']} steps =="
    )
    lines.append(
        f"  {'sync':<6}{'eff.batch':>10}{'K':>4}{'samples/s':>11}{'step ms':>10}{'syncs':>7}"
        f"{'syncs/sample':>14}{'opt ms':>8}{'of compute-only':>17}{'avg loss':>10}"
    )
    lines += [
        f"  {p['sync_mode']:<6}{p['effective_batch']:>10}{p['accum_steps']:>4}{p['samples_per_sec']:>11.1f}"
        f"{p['median_step_ms']:>10.1f}{p['sync_calls']:>7}{p['syncs_per_sample']:>14.5f}"
        f"{p['median_optimizer_ms']:>8.1f}{p['fraction_of_compute_only']:>17.0%}{p['avg_loss']:>10.4f}"
        for p in report["points"]
    ]
    lines.append(
        f"  compute only (forward + backward, no sync, no optimizer step): "
        f"{report['compute_only_samples_per_sec']:.1f} samples/s"
    )
    return "\n".join(lines)


def plot(points: list[dict], ceiling: float, cfg: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, label, style in (("last", "sync on last (no_sync)", "o-"), ("every", "sync every micro-batch", "s--")):
        pts = [p for p in points if p["sync_mode"] == mode]
        eff = [p["effective_batch"] for p in pts]
        left.plot(eff, [p["samples_per_sec"] for p in pts], style, label=label)
        right.plot(eff, [p["syncs_per_sample"] for p in pts], style, label=label)
    for ax, title in ((left, "throughput"), (right, "gradient syncs per sample")):
        ax.set_xscale("log", base=2)
        ticks = sorted({p["effective_batch"] for p in points})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel(f"effective batch (micro-batch {cfg['micro_batch']} × K × world {cfg['world_size']})")
        ax.set_title(title)
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend()
    left.axhline(ceiling, color="grey", linestyle=":", label="compute only (no sync, no optimizer step)")
    left.set_ylim(0, 1.25 * max([ceiling] + [p["samples_per_sec"] for p in points]))
    left.legend(loc="lower right")
    left.set_ylabel("samples / s (median step)")
    right.set_ylabel("syncs / sample")
    right.set_yscale("log", base=2)
    right.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"1/{round(1 / v)}"))
    fig.suptitle(
        f"Gradient accumulation, DeepMLP(width={cfg['width']}, depth={cfg['depth']}), "
        f"{cfg['world_size']} CPU ranks (gloo)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    def positive(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
        return int(text)

    def ks(text: str) -> list[int]:
        try:
            return [positive(part) for part in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give comma-separated positive integers, e.g. 1,2,4,8,16"
            ) from None

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=positive, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--micro-batch", type=positive, default=8, help="sweep: samples per micro-batch (default 8)")
    p.add_argument("--accum-steps", type=ks, default=[1, 2, 4, 8, 16], help="sweep: K values (default 1,2,4,8,16)")
    p.add_argument("--steps", type=positive, default=16, help="sweep: measured optimizer steps per point (default 16)")
    p.add_argument("--warmup", type=int, default=1, help="sweep: unmeasured steps per point (default 1)")
    p.add_argument("--width", type=positive, default=256, help="sweep: DeepMLP width (default 256)")
    p.add_argument("--depth", type=positive, default=24, help="sweep: DeepMLP depth (default 24)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON file (or folder) to write, the plot beside it (default: bench/results/)",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are killed (default 600)")
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.out is not None and (args.out.is_dir() or args.out.suffix != ".json"):
        args.out = args.out / "accum-curve.json"  # a folder, as before: the JSON and the plot go in it
    args.out = output_path(p, args, "accum-curve")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = {
        "world_size": args.world_size,
        "micro_batch": args.micro_batch,
        "accum_steps": args.accum_steps,
        "steps": args.steps,
        "warmup": args.warmup,
        "width": args.width,
        "depth": args.depth,
    }
    started = time.monotonic()
    load_before = load_average()
    try:
        report = run_ranks(args.world_size, cfg, args.timeout)
    except RuntimeError as e:
        print(f"accum: {e}", file=sys.stderr)
        return 1
    print(render(report, cfg))
    failed = check(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema": SCHEMA,
        **provenance(args, load_before),
        "torch": torch.__version__,
        "backend": "gloo",
        "world_size": args.world_size,
        "model": {"name": "DeepMLP", "width": args.width, "depth": args.depth},
        "optimizer": "AdamW(lr=1e-3)",
        "micro_batch": args.micro_batch,
        "accum_steps_swept": args.accum_steps,
        "warmup_steps": args.warmup,
        "samples_per_sec_from": "effective_batch / median step time",
        "compute_only_samples_per_sec": report.pop("compute_only_samples_per_sec"),
        "points": report.pop("points"),
        "checks": report,
        "failed": failed,
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc["points"], doc["compute_only_samples_per_sec"], cfg, args.out.with_suffix(".png"))
    plot_name, took = args.out.with_suffix(".png").name, time.monotonic() - started
    print(f"{describe_output(args.out)}; the plot: {plot_name}; {took:.0f}s")
    for text in failed:
        print(f"FAILED: {text}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
