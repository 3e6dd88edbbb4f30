"""The pipeline bubble, measured: each stage's idle share against GPipe's (S−1)/(M+S−1), for S = 2, 4 stages and
M = 1, 2, 4, 8, 16 micro-batches, on our schedule (``OverlappedSchedule``: receives posted ahead) and on PyTorch's
own loop (``ScheduleGPipe``/``Schedule1F1B``) as the baseline, gloo on CPU, world size S.

    make pipeline-bubble                                     # both compute kinds, both engines: 4-8 min on 2 cores
    .venv/bin/python -m bench.pipeline_bubble --compute emulated --steps 3
    .venv/bin/python -m bench.pipeline_bubble --stages 2 --micro-batches 4,8,16 --engines overlapped

How idle is measured: on every rank, ``PipelineRunner.step`` times the stage's own work (forward, backward, loss)
with ``time.perf_counter``; the rest of the step's wall time is spent blocked in a receive (waiting for a neighbour's
activations or gradients) or handing a tensor to a send. Idle share = that rest / step wall time, median over the
measured steps (one unmeasured warm-up step first: it infers the shapes). Steps run back to back, as in training:
the last stage's wait for the first micro-batch of a step includes the other stages' drain of the step before, so
the bubble shows up on every stage, not only on the first. Each row also keeps every stage's profile (the phases
of ``PipelineStepResult.phases``: compute, waiting for a receive, handing sends over, the sends' drain, the loss
broadcast, the schedule's own Python) and splits the idle beyond the formula into imbalance and latency
(``app.demos.bubble.excess``).

Two kinds of stage work, because this machine has fewer cores than S = 4 stages:

- ``emulated``: each stage is a Linear layer plus a fixed wait proportional to the rows it processes (forward
  ``--stage-ms`` per whole batch, backward twice that), like a host waiting for its GPU. It takes no CPU, so S ranks
  do not contend for 2 cores and the schedule's own bubble shows. This is the row to compare with the formula.
- ``real``: two ``Linear(width, width)`` + ReLU per stage, real matrix products. With S > cores, the ranks also wait
  for a core, not only for each other: time spent runnable but descheduled lands in "compute" (it is inside
  forward), and a stage that finishes early waits for a slowed neighbour, so the table flags those rows.

Writes ``bench/results/pipeline-bubble.json`` (schema ``pipeline-bubble.v2``, with provenance) and a PNG beside it.
Exit status: 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.cli import OneLineParser
from app.demos.bubble import measure, render

SCHEMA = "pipeline-bubble.v2"  # v2: rows per engine, phases per stage, excess over the formula


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    from app.parallel.pipeline.stages import theoretical_bubble

    rows = [r for r in rows if r["stage_ms"] == rows[0]["stage_ms"]]  # the longer-work reruns: a table, not a plot
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = {2: "tab:blue", 4: "tab:orange"}
    for stages in sorted({r["stages"] for r in rows}):
        ms = sorted({r["micro_batches"] for r in rows})
        grid = [m / 4 for m in range(4, 4 * max(ms) + 1)]
        color = colors.get(stages)
        ax.plot(
            grid, [theoretical_bubble(stages, m) for m in grid], "-", color=color, label=f"(S−1)/(M+S−1), S={stages}"
        )
        for compute, engine, schedule, marker, fill in (
            ("emulated", "overlapped", "gpipe", "o", True),
            ("emulated", "overlapped", "1f1b", "o", False),
            ("emulated", "pytorch", "gpipe", "s", False),
            ("real", "overlapped", "gpipe", "x", True),
            ("real", "overlapped", "1f1b", "+", True),
        ):
            key = (stages, compute, engine, schedule)
            pts = [r for r in rows if (r["stages"], r["compute"], r["engine"], r["schedule"]) == key]
            if pts:
                ax.plot(
                    [r["micro_batches"] for r in pts],
                    [r["measured_mean"] for r in pts],
                    marker,
                    color=color,
                    markerfacecolor=color if fill else "none",
                    linestyle="none",
                    label=f"S={stages} {compute} {schedule}{', PyTorch loop' if engine == 'pytorch' else ''}",
                )
    ax.set_xscale("log", base=2)
    ticks = sorted({r["micro_batches"] for r in rows})
    ax.set_xticks(ticks, [str(m) for m in ticks])
    ax.minorticks_off()
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("idle share of a stage (mean over stages)")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Pipeline bubble: measured (gloo, CPU) vs GPipe's formula")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


DOC = Path(__file__).resolve().parents[1] / "docs" / "parallelism.md"


def write_docs(results: Path, doc_path: Path = DOC) -> None:
    """Rewrite the bubble block of docs/parallelism.md from ``results``: tools/report.py renders it, as it renders
    every measured figure of the docs (``make bench-report`` does the same for all pages)."""
    from tools.report import block_pattern, render

    text = doc_path.read_text(encoding="utf-8")
    if not block_pattern("pipeline-bubble").search(text):
        raise SystemExit(f"{doc_path.name} has no <!-- bench-report:pipeline-bubble --> block: nothing rewritten")
    body = render("pipeline-bubble", json.loads(results.read_text()))
    doc_path.write_text(block_pattern("pipeline-bubble").sub(lambda m: m[1] + body + "\n" + m[2], text), "utf-8")


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated positive integers, e.g. 1,2,4,8")
    return values


def float_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated positive milliseconds, e.g. 40,160")
    return values


def choice_list(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = text.split(",")
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r}: choose from {', '.join(allowed)} (comma-separated)")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="bench.pipeline_bubble", description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int_list, default=[2, 4], help="S values, one world each (default 2,4)")
    p.add_argument("--micro-batches", type=int_list, default=[1, 2, 4, 8, 16], help="M values (default 1,2,4,8,16)")
    p.add_argument("--schedules", type=choice_list(("gpipe", "1f1b")), default=["gpipe", "1f1b"])
    p.add_argument(
        "--engines",
        type=choice_list(("overlapped", "pytorch")),
        default=["overlapped", "pytorch"],
        help="overlapped: our schedule, receives posted ahead; pytorch: PyTorch's loop, the baseline (default both)",
    )
    p.add_argument("--compute", type=choice_list(("emulated", "real")), default=["emulated", "real"])
    p.add_argument("--steps", type=int, default=9, help="measured steps per point, after one warm-up (default 9)")
    p.add_argument("--batch", type=int, default=256, help="rows per step; a multiple of every M (default 256)")
    p.add_argument("--width", type=int, default=1024, help="real compute: Linear width (default 1024)")
    p.add_argument(
        "--stage-ms",
        type=float_list,
        default=[40.0, 160.0],
        help="emulated: forward ms per stage per batch; a further value reruns our schedule's M >= 4 rows with that "
        "longer work (default 40,160)",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/pipeline-bubble.json)")
    p.add_argument("--write-docs", action="store_true", help="only rewrite docs/parallelism.md's table from the JSON")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.stages) < 2:
        p.error(f"--stages: a pipeline needs >= 2 stages, got {min(args.stages)}")
    for name in ("steps", "batch", "width"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    bad = [m for m in args.micro_batches if args.batch % m]
    if bad:
        p.error(f"--batch {args.batch} does not split into {bad[0]} equal micro-batches: use a multiple of it")
    return args


def main(argv=None) -> int:
    from tools.provenance import RESULTS, describe_output, load_average, output_path, provenance

    parser = build_parser()
    args = parse_args(argv)
    if args.write_docs:
        write_docs(args.out or RESULTS / "pipeline-bubble.json")
        print(f"rewrote the bubble table of {DOC.relative_to(DOC.parents[1])}")
        return 0
    keys = ("stages", "micro_batches", "schedules", "engines", "compute", "steps", "batch", "width")
    cfg = {k: getattr(args, k) for k in keys}
    cfg["stage_ms"] = args.stage_ms
    before = load_average()
    rows = measure(cfg)
    print(render(rows))
    path = output_path(parser, args, "pipeline-bubble")
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, **provenance(args, load_before=before), "idle_measure": IDLE_MEASURE, "rows": rows}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    plot(rows, path.with_suffix(".png"))
    print(describe_output(path))
    return 0


IDLE_MEASURE = (
    "per rank: 1 - (time inside forward_one_chunk + backward_one_chunk + loss) / step wall time, "
    "median over the measured steps; the rest is blocked in recv/send"
)

if __name__ == "__main__":
    sys.exit(main())
