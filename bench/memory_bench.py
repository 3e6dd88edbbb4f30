"""Peak memory per rank of the real worker, for ddp and ZeRO stages 1-3, against the formula plus an idle worker.

    python -m bench.memory_bench                        # worlds 2 and 4, writes bench/results/memory.json
    python -m bench.memory_bench --world-sizes 2 --kinds zero3 --out runs/memory-z3.json
    python -m bench.memory_bench --jobs 1               # one (kind, world size) at a time: the same peaks, later

Each run is ``torchrun --standalone --nproc-per-node=N -m bench.memory_rank <the worker's flags>``: the real
``python -m app.train`` (``bench.memory_rank`` only wraps its phases), on a user model given by its import spec,
``bench.models.residual:ResidualStack`` (16 → depth × residual Linear(width, width) → 8), AdamW, fp32. Per kind and
world size, three runs:

    base      the same worker and kind with a tiny model (width 16, depth 1): the idle worker's peak (torch,
              gloo, the data set, threads), what every rank pays before its model's state;
    fresh     --steps 3 from nothing: construction, 3 steps, one checkpoint save (the final one), the end checksum;
    resume    --steps 4 from the fresh run's checkpoint: the sharded (or rank-0) load, one step, a save, the checksum.

Then (issue 37's item 4) ``--ac-kind`` at ``--ac-world-size`` fresh, at ``--ac-micro-batch`` (activations that show
beside the state), with ``--activation-checkpointing`` off and units, each against ``app.plan``'s prediction.

Measured: each trainer rank's own peak resident set (VmHWM, = ru_maxrss), not torchrun's agent's; and the phase in
which it reached that peak (``bench.memory_rank``: VmHWM read at every phase boundary, VmRSS sampled every 0.1 s).
Against: ``app.plan.state_bytes`` (parameters 4 B + gradients 4 B + AdamW 8 B per parameter, the sharded terms / N:
ddp 16Ψ, zero1 (4 + 4 + 8/N)Ψ, zero2 (4 + 12/N)Ψ, zero3 16Ψ/N) plus the base. The target (issue 37): every peak
within 15% of formula + base.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app.plan import model_facts, predict, state_bytes
from tools.provenance import describe_output, load_average, write_result

MIB = 2**20
MODEL = "bench.models.residual:ResidualStack"
TOLERANCE = 0.15  # issue 37's target: a peak within 15% of formula + base
TORCHRUN = Path(sys.executable).with_name("torchrun")


def parameter_count(width: int, depth: int) -> int:
    """Ψ of ``ResidualStack(width, depth)``, counted on the meta device (no memory)."""
    import torch

    from app.specs import build_model

    with torch.device("meta"):
        model = build_model(MODEL, {"width": width, "depth": depth})
    return sum(p.numel() for p in model.parameters())


def worker_flags(
    kind: str, model_kwargs: dict, steps: int, checkpoint_dir: Path, micro_batch: int, data_size: int = 512
) -> list[str]:
    """The worker's flags (``python -m app.train --help``) for one run."""
    return [
        *("--parallel", kind, "--model", MODEL, "--model-kwargs", json.dumps(model_kwargs)),
        *("--data", "teacher_classification", "--data-kwargs", json.dumps({"size": data_size, "seed": 0})),
        *("--loss", "cross_entropy", "--lr", "0.0001", "--micro-batch", str(micro_batch)),
        *("--steps", str(steps), "--checkpoint-every", "100000", "--checkpoint-dir", str(checkpoint_dir)),
        *("--metrics-port", "0", "--log-every", "100000"),
    ]


def run_world(world: int, flags: list[str], out: Path) -> list[dict]:
    """One torchrun of ``world`` ranks; each rank's record from ``bench.memory_rank``, by rank."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "MEMORY_BENCH_OUT": str(out), "OMP_NUM_THREADS": "1"}
    cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={world}", "-m", "bench.memory_rank", *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def summarise(ranks: list[dict]) -> dict:
    """The heaviest rank's peak and phase, every rank's peak, and per phase the highest VmHWM at its end."""
    top = max(ranks, key=lambda r: r["peak_bytes"])
    phases: dict[str, int] = {}
    for r in ranks:
        for p in r["phases"]:
            if p["phase"] != "between":
                phases[p["phase"]] = max(phases.get(p["phase"], 0), p["hwm_bytes"])
    return {
        "peak_bytes": top["peak_bytes"],
        "peak_rank": top["rank"],
        "peak_phase": top["peak_phase"],
        "rank_peaks_bytes": [r["peak_bytes"] for r in ranks],
        "hwm_at_phase_end_bytes": phases,
        "rss_samples": top["samples"],  # (seconds, VmRSS bytes, phase) of the heaviest rank
    }


def measure(kind: str, world: int, args, psi: int, facts, tmp: Path) -> dict:
    tmp = tmp / f"{kind}-{world}"  # a folder per (kind, world size): --jobs runs several at once
    model = {"width": args.width, "depth": args.depth}
    ckpt = tmp / "checkpoints"
    tiny = {"width": 16, "depth": 1}
    base = summarise(run_world(world, worker_flags(kind, tiny, 3, tmp / "base", args.micro_batch), tmp / "out"))
    fresh = summarise(run_world(world, worker_flags(kind, model, 3, ckpt, args.micro_batch), tmp / "out"))
    row = {"base": base, "fresh": fresh}
    if args.resume:
        row["resume"] = summarise(run_world(world, worker_flags(kind, model, 4, ckpt, args.micro_batch), tmp / "out"))
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(tmp / "base", ignore_errors=True)
    formula = state_bytes(kind, psi, world)
    row["formula_bytes"] = formula
    plan = predict(kind, world, facts, base["peak_bytes"])  # app.plan's prediction, with the base measured here
    row["predicted"] = {**vars(plan), "peak": plan.peak, "peak_phase": plan.peak_phase, "resume_peak": plan.resume_peak}
    row["expected_bytes"] = formula + base["peak_bytes"]
    for run in ("fresh", "resume"):
        if run in row:
            row[run]["vs_expected"] = row[run]["peak_bytes"] / row["expected_bytes"]
    return row


def measure_activation_checkpointing(args, results: dict, tmp: Path) -> dict:
    """Item 4 of issue 37: the same worker at a micro-batch whose activations show (``--ac-micro-batch``), fresh,
    with ``--activation-checkpointing`` off and units, beside app.plan's prediction for each (the base: the main
    runs' of that kind and world size)."""
    kind, world, mb = args.ac_kind, args.ac_world_size, args.ac_micro_batch
    data_size = max(512, 4 * mb * world)  # a few steps' samples without repeating them
    model_kwargs = {"width": args.width, "depth": args.depth}
    facts = model_facts(MODEL, model_kwargs, "teacher_classification", {"size": data_size, "seed": 0}, mb, None)
    base = results[str(world)][kind]["base"]["peak_bytes"]
    out = {"kind": kind, "world_size": world, "micro_batch": mb, "facts": vars(facts), "base_bytes": base, "runs": {}}
    for setting in ("off", "units"):
        flags = worker_flags(kind, model_kwargs, 3, tmp / "ac", mb, data_size)
        flags += ["--activation-checkpointing", setting]
        run = summarise(run_world(world, flags, tmp / "out"))
        shutil.rmtree(tmp / "ac", ignore_errors=True)
        plan = predict(kind, world, facts, base, activation_checkpointing=setting == "units")
        run["predicted_bytes"] = plan.peak
        run["predicted_vs_measured"] = plan.peak / run["peak_bytes"]
        out["runs"][setting] = run
    off, on = out["runs"]["off"], out["runs"]["units"]
    out["measured_saving_bytes"] = off["peak_bytes"] - on["peak_bytes"]
    out["predicted_saving_bytes"] = off["predicted_bytes"] - on["predicted_bytes"]
    return out


def print_table(results: dict, psi: int) -> None:
    print(f"Ψ = {psi:,} parameters; MiB per rank (the heaviest rank); expected = formula + base")
    print(
        f"{'N':>2} {'kind':<6} {'formula':>8} {'base':>6} {'expected':>8} {'fresh':>7} {'×':>5}  {'fresh peak in':<16}"
        f" {'resume':>7} {'×':>5}  resume peak in"
    )
    for world, rows in results.items():
        for kind, r in rows.items():
            f, res = r["fresh"], r.get("resume")
            line = (
                f"{world:>2} {kind:<6} {r['formula_bytes'] / MIB:8.0f} {r['base']['peak_bytes'] / MIB:6.0f} "
                f"{r['expected_bytes'] / MIB:8.0f} {f['peak_bytes'] / MIB:7.0f} {f['vs_expected']:5.2f}  "
                f"{f['peak_phase']:<16}"
            )
            if res:
                line += f" {res['peak_bytes'] / MIB:7.0f} {res['vs_expected']:5.2f}  {res['peak_phase']:<16}"
            line += f" {r['predicted']['peak'] / MIB:7.0f} {r['predicted']['peak'] / f['peak_bytes']:5.2f}"
            print(line)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,4", help="comma list of world sizes")
    p.add_argument("--kinds", default="ddp,zero1,zero2,zero3", help="comma list of parallel kinds")
    p.add_argument("--width", type=int, default=1536, help="ResidualStack width")
    p.add_argument("--depth", type=int, default=16, help="ResidualStack residual blocks")
    p.add_argument("--micro-batch", type=int, default=32, help="samples per forward/backward on one rank")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True, help="also measure a resume")
    p.add_argument("--ac-kind", default="ddp", help="activation checkpointing runs: the kind (one of --kinds)")
    p.add_argument("--ac-world-size", type=int, default=2, help="activation checkpointing runs: the world size")
    p.add_argument("--ac-micro-batch", type=int, default=512, help="activation checkpointing runs: micro-batch")
    p.add_argument(
        "--ac", action=argparse.BooleanOptionalAction, default=True, help="also measure activation checkpointing"
    )
    p.add_argument("--jobs", type=int, default=3, help="(kind, world size) measured side by side (~1 GiB a rank)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/memory.json)")
    return p, p.parse_args(argv)


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    before = load_average()
    psi = parameter_count(args.width, args.depth)
    # What app.plan sees of this model: Ψ, its largest unit, one micro-batch's activations (measured here).
    data_kwargs = {"size": 512, "seed": 0}
    model_kwargs = {"width": args.width, "depth": args.depth}
    facts = model_facts(MODEL, model_kwargs, "teacher_classification", data_kwargs, args.micro_batch, None)
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    pairs = [(w, kind) for w in [int(w) for w in args.world_sizes.split(",")] for kind in args.kinds.split(",")]

    def one(pair):
        world, kind = pair
        row = measure(kind, world, args, psi, facts, Path(tmp))
        print(
            f"N={world} {kind}: peak {row['fresh']['peak_bytes'] / MIB:.0f} MiB in "
            f"{row['fresh']['peak_phase']} ({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        return row

    # Each rank's VmHWM is its own process's: runs side by side measure the same peaks, sooner.
    with (
        tempfile.TemporaryDirectory(prefix="memory-bench-") as tmp,
        ThreadPoolExecutor(max_workers=args.jobs) as pool,
        ThreadPoolExecutor(max_workers=1) as side,
    ):
        futures = {pair: pool.submit(one, pair) for pair in pairs}
        # Activation checkpointing needs only its kind's base: it starts once that pair is measured.
        ac_pair = (args.ac_world_size, args.ac_kind)
        ac_base = {str(ac_pair[0]): {ac_pair[1]: {"base": {}}}}

        def ac_after_its_base():
            ac_base[str(ac_pair[0])][ac_pair[1]] = futures[ac_pair].result()
            return measure_activation_checkpointing(args, ac_base, Path(tmp))

        ac_future = side.submit(ac_after_its_base) if args.ac else None
        for (world, kind), future in futures.items():
            results.setdefault(str(world), {})[kind] = future.result()
        ac = ac_future.result() if ac_future else None
    print_table(results, psi)
    if ac:
        for setting, run in ac["runs"].items():
            print(
                f"activation checkpointing {setting}: {ac['kind']} N={ac['world_size']} micro-batch "
                f"{ac['micro_batch']}: peak {run['peak_bytes'] / MIB:.0f} MiB, "
                f"planned {run['predicted_bytes'] / MIB:.0f}"
            )
    model = {
        "spec": MODEL,
        "width": args.width,
        "depth": args.depth,
        "psi": psi,
        "optimizer": "adamw",
        "dtype": "float32",
    }
    path, _ = write_result(
        parser,
        args,
        "memory",
        {
            "model": model,
            "facts": vars(facts),
            "tolerance": TOLERANCE,
            "results": results,
            "activation_checkpointing": ac,
        },
        before,
    )
    print(describe_output(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
