"""How far two correct runs on different world sizes drift apart, in float32 and in float64.

    make world-drift                 # = python -m bench.world_drift (4 real runs of the worker, ~3 min here)
    python -m bench.world_drift --steps 100 --worlds 4 2

The global batch is fixed in samples (``--effective-batch``), so a world of 4 and a world of 3 train the same steps
on the same samples; the only difference is the order in which float additions happen (each rank sums its share,
then the all-reduce sums the ranks). This bench measures what that difference grows to: the same run on each world
size (``torchrun --standalone``), checkpoints every ``--every`` steps, and the largest parameter difference and
the relative distance of the whole parameter vector at each of them, once per ``--dtypes``.

Why it exists: the chaos proof (bench/cluster/chaos.py) compares a run that lost a worker with one that did not. Its
tolerance must be the drift of two *correct* runs over the same horizon, and this table shows that in float32
that drift is not float-rounding small after a few hundred steps, while in float64 it is.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.world_drift", description=__doc__.splitlines()[0])
    p.add_argument(
        "--steps", type=int, default=300, help="optimizer steps of each run (bench/cluster/chaos.py's horizon)"
    )
    p.add_argument("--every", type=int, default=25, help="compare the runs every this many steps")
    p.add_argument("--worlds", type=int, nargs=2, default=[4, 3], help="the two world sizes compared")
    p.add_argument("--dtypes", nargs="+", default=["float32", "float64"], choices=["float32", "float64"])
    p.add_argument(
        "--effective-batch", type=int, default=4096, help="global batch in samples (as bench/cluster/chaos.py)"
    )
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/world-drift.json)")
    return p


def train(directory: Path, world: int, dtype: str, args) -> float:
    """One run of the worker; returns its wall time in seconds."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--standalone", f"--nproc-per-node={world}", "-m", "app.train", "--steps", str(args.steps)]
    cmd += ["--effective-batch", str(args.effective_batch), "--micro-batch", str(args.micro_batch)]
    cmd += ["--dtype", dtype, "--checkpoint-dir", str(directory), "--checkpoint-every", str(args.every)]
    cmd += ["--keep-checkpoints", str(args.steps // args.every + 1), "--metrics-port", "0", "--log-every", "1000"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_")} | {"OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"world {world} {dtype} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return time.monotonic() - started


def distance(a: Path, b: Path, step: int) -> dict:
    """max |Δparam| and |θa − θb| / |θa| between the two runs' checkpoints of ``step``."""
    from app.worker.checkpoint.files import checkpoint_path, load_checkpoint

    pa = load_checkpoint(checkpoint_path(a, step))["model"]
    pb = load_checkpoint(checkpoint_path(b, step))["model"]
    diff = {k: pa[k].double() - pb[k].double() for k in pa}
    norm = sum(pa[k].double().pow(2).sum().item() for k in pa) ** 0.5
    return {
        "max_abs": max(d.abs().max().item() for d in diff.values()),
        "relative": sum(d.pow(2).sum().item() for d in diff.values()) ** 0.5 / norm,
    }


def measure(args) -> dict:
    steps = list(range(args.every, args.steps + 1, args.every))
    rows = {s: {"step": s} for s in steps}
    wall = {}
    with tempfile.TemporaryDirectory(prefix="world-drift-") as top:
        for dtype in args.dtypes:
            dirs = [Path(top) / f"{dtype}-w{w}" for w in args.worlds]
            for world, directory in zip(args.worlds, dirs):
                wall[f"{dtype} world {world}"] = round(train(directory, world, dtype, args), 1)
            for s in steps:
                rows[s][dtype] = distance(*dirs, s)
    return {"rows": list(rows.values()), "wall_s": wall}


def table(result: dict, dtypes: list[str]) -> list[str]:
    head = "| step | " + " | ".join(f"{d} max \\|Δparam\\| | {d} \\|Δθ\\|/\\|θ\\|" for d in dtypes) + " |"
    lines = [head, "|---:|" + "---:|---:|" * len(dtypes)]
    for row in result["rows"]:
        cells = " | ".join(f"{row[d]['max_abs']:.2g} | {row[d]['relative']:.2g}" for d in dtypes)
        lines.append(f"| {row['step']} | {cells} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from bench.provenance import describe_output, load_average, write_result

    parser = build_parser()
    args = parser.parse_args(argv)
    before = load_average()
    path, result = write_result(parser, args, "world-drift", measure(args), before)
    print(f"world {args.worlds[0]} against world {args.worlds[1]}, global batch {args.effective_batch}:")
    print("\n".join(table(result, args.dtypes)))
    print(describe_output(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
