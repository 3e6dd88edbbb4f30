"""What Prometheus metrics cost the training step: the real worker with metrics on vs off, side by side.

    make bench-metrics                                        # 2 ranks, MiniMLP, 6 interleaved pairs (~4 min here)
    .venv/bin/python -m bench.metrics_overhead --repeats 3 --steps 200
    .venv/bin/python -m bench.metrics_overhead --model tiny_transformer --steps 40 --micro-batch 8

Two measurements:

    end to end   ``torchrun -m app.train`` with ``--metrics-port P`` and with ``--metrics-port 0``, alternating
                 (on, off, off, on, ...) so that drift in the machine's load hits both alike; each run reports its
                 median step time (rank 0's summary line). Each pair gives one overhead, on / off - 1; their mean
                 and its 95% confidence interval (Student's t over the pairs) decide the verdict: "met" when the
                 whole interval is at or below the target, "not met" when it is all above, otherwise "inconclusive"
                 (the run-to-run noise, stated beside it, is larger than the target: more --repeats, a quieter
                 machine, or a longer --steps narrow it).
    direct cost  ``TrainMetrics.observe_step`` timed in a loop (µs per step: everything the loop adds per step when
                 metrics are on), divided by the measured step time: what the end-to-end figure should converge to,
                 printed to explain it, never to decide it.

MiniMLP is the worst case (the shortest step, so the fixed per-step cost weighs most); any real model has longer
steps and a smaller ratio. Writes ``bench/results/metrics-overhead.json`` (schema ``metrics-overhead.v2``, with the
commit, settings and machine load of the run: ``tools/provenance.py``) when every flag is at its default, otherwise
``runs/metrics-overhead.json``; ``--out`` chooses. Prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools.provenance import describe_output, load_average, output_path, provenance

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "metrics-overhead.v2"
TARGET = 0.02  # the bar: metrics may cost at most 2% of the step time


def one_run(args, metrics_port: int) -> float:
    """Median step time in ms of one real training run."""
    cmd = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        f"--nproc-per-node={args.world_size}",
        "-m",
        "app.train",
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--micro-batch",
        str(args.micro_batch),
        "--log-every",
        str(args.steps),
        "--metrics-port",
        str(metrics_port),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    match = re.search(r"median_step_ms=([0-9.]+)", result.stderr)
    if result.returncode != 0 or not match:
        raise SystemExit(f"training run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return float(match.group(1))


def direct_cost_us(iterations: int = 20000) -> float:
    """µs that ``observe_step`` adds to one step (one bucket, as MiniMLP has), median of 5 timings."""
    from app.worker.metrics import CommSample, TrainMetrics

    m = TrainMetrics(rank=0, local_rank=0, world_size=2, node="0", host="bench")
    timings = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iterations):
            m.observe_step(
                step_seconds=0.004,
                forward_seconds=0.001,
                backward_seconds=0.002,
                optimizer_seconds=0.0005,
                comm=CommSample([0.0003], [27168], 0.0002),
                samples=32,
                syncs=1,
                loss=1.0,
                lr=0.003,
            )
        timings.append((time.perf_counter() - t0) / iterations * 1e6)
    return statistics.median(timings)


# Student's t, two-sided 95%, by degrees of freedom (pairs - 1); 1.96 beyond the table.
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13, 20: 2.09}


def t95(df: int) -> float:
    return next((_T95[d] for d in sorted(_T95) if df <= d), 1.96)


def end_to_end_verdict(on: list[float], off: list[float], target: float = TARGET) -> dict:
    """The overhead of metrics from paired runs, its noise, and whether it meets ``target``.

    Args:
        on, off: median step times of the paired runs (pair i = on[i], off[i], run back to back).
        target: the largest acceptable overhead (0.02 = 2%).

    Example::

        end_to_end_verdict([10.1, 9.8, 10.4], [10.0, 9.9, 10.2])["verdict"]  # 'met', 'not met' or 'inconclusive'
    """
    pairs = [a / b - 1 for a, b in zip(on, off)]
    mean = statistics.fmean(pairs)
    sd = statistics.stdev(pairs) if len(pairs) > 1 else math.inf
    half = t95(len(pairs) - 1) * sd / math.sqrt(len(pairs))
    low, high = mean - half, mean + half
    verdict = "met" if high <= target else "not met" if low > target else "inconclusive"
    return {
        "pair_overheads": [round(x, 4) for x in pairs],
        "mean_overhead": round(mean, 4),
        "pair_sd": round(sd, 4),
        "ci95": [round(low, 4), round(high, 4)],
        "verdict": verdict,
    }


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6, help="pairs of runs (on, off), interleaved")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="mini_mlp", choices=["mini_mlp", "tiny_transformer"])
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--port", type=int, default=19700, help="metrics base port of the 'on' runs")
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON to write (default: bench/results/ for the default flags)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 2 or args.steps < 10:
        parser.error("--repeats must be >= 2 (the noise needs two pairs) and --steps >= 10")
    return parser, args


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    out_path = output_path(parser, args, "metrics-overhead")
    load_before = load_average()
    on, off = [], []
    for i in range(args.repeats):
        # Alternate which goes first, so a pair never systematically runs on the cooler machine.
        for label in ("on", "off") if i % 2 == 0 else ("off", "on"):
            ms = one_run(args, args.port if label == "on" else 0)
            (on if label == "on" else off).append(ms)
            print(f"  repeat {i + 1}/{args.repeats}  metrics {label:<3}  median step {ms:7.3f} ms", flush=True)
    on_ms, off_ms = statistics.median(on), statistics.median(off)
    e2e = end_to_end_verdict(on, off)
    cost_us = direct_cost_us()
    direct = cost_us / 1e3 / off_ms
    result = {
        "schema": SCHEMA,
        **provenance(args, load_before),
        "metrics_on_median_step_ms": round(on_ms, 4),
        "metrics_off_median_step_ms": round(off_ms, 4),
        "runs_on_ms": on,
        "runs_off_ms": off,
        "end_to_end": e2e,
        "observe_step_us": round(cost_us, 2),
        "direct_overhead": round(direct, 5),
        "target": TARGET,
        "verdict": e2e["verdict"],
        "meets_target": {"met": True, "not met": False}.get(e2e["verdict"]),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    low, high = e2e["ci95"]
    print(f"\n{args.model}, {args.world_size} ranks, {args.steps} steps, {args.repeats} interleaved pairs")
    print(f"  {'':<34}{'median step':>12}")
    print(f"  {'metrics off (--metrics-port 0)':<34}{off_ms:>9.3f} ms   runs: {', '.join(f'{x:.2f}' for x in off)}")
    print(f"  {'metrics on':<34}{on_ms:>9.3f} ms   runs: {', '.join(f'{x:.2f}' for x in on)}")
    print(
        f"  {'end to end (on / off - 1, pairs)':<34}{e2e['mean_overhead']:>+9.1%}      95% CI {low:+.1%} .. "
        f"{high:+.1%} (pair-to-pair sd {e2e['pair_sd']:.1%})"
    )
    print(
        f"  {'direct: observe_step per step':<34}{cost_us:>9.1f} µs = {direct:.2%} of the step (explains, not decides)"
    )
    print(f"  target <= {TARGET:.0%} end to end: {e2e['verdict'].upper()}")
    print(describe_output(out_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
