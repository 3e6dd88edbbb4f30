"""The pipeline bubble's block (``bench/results/pipeline-bubble.json``, ``python -m bench.pipeline_bubble``): idle
share per stage against GPipe's formula, for our schedule (receives posted ahead) and PyTorch's own loop, and the
per-phase profile that says where the idle beyond the formula went."""

from __future__ import annotations

import statistics

from tools.renderers.common import claims_table

TARGET = 1.25  # issue 39: within 1.25x of (S-1)/(M+S-1) at S = 2 and 4, M = 4..16
COLUMNS = (
    ("emulated", "overlapped", "gpipe", "emulated GPipe"),
    ("emulated", "overlapped", "1f1b", "emulated 1F1B"),
    ("emulated", "pytorch", "gpipe", "emulated GPipe, PyTorch's loop"),
    ("emulated", "pytorch", "1f1b", "emulated 1F1B, PyTorch's loop"),
    ("real", "overlapped", "gpipe", "real GPipe"),
    ("real", "overlapped", "1f1b", "real 1F1B"),
)
PHASES = ("compute", "recv_wait", "send", "send_drain", "loss_share", "overhead")


def _key(r: dict) -> tuple:
    # v1 results had no engine: they were PyTorch's loop.
    return (r["compute"], r.get("engine", "pytorch"), r["schedule"], r["stages"], r["micro_batches"])


def render_pipeline_bubble(doc: dict) -> list[str]:
    """The idle share per stage against GPipe's formula, the claims, and the emulated rows' profile."""
    base_ms = doc["rows"][0].get("stage_ms")  # the first value of --stage-ms: every point; a further one: _longer
    base = [r for r in doc["rows"] if r.get("stage_ms") == base_ms]
    index = {_key(r): r for r in base}
    points = sorted({(r["stages"], r["micro_batches"]) for r in base})
    columns = [c for c in COLUMNS if any(k[:3] == c[:3] for k in index)]
    lines = [
        "Each cell: the mean over stages of each stage's idle share, and its ratio to the formula; — = not run "
        "(1F1B needs M ≥ S); * = more stages than cores (contended).",
        "",
        "| S | M | (S−1)/(M+S−1) | " + " | ".join(c[3] for c in columns) + " |",
        "|---:|---:|---:|" + "---:|" * len(columns),
    ]
    for stages, micro in points:
        cells = []
        for compute, engine, schedule, _ in columns:
            r = index.get((compute, engine, schedule, stages, micro))
            cells.append("—" if r is None else _cell(r))
        theory = (stages - 1) / (micro + stages - 1)
        lines.append(f"| {stages} | {micro} | {theory:.3f} | " + " | ".join(cells) + " |")
    longer = [r for r in doc["rows"] if r.get("stage_ms") != base_ms]
    tables = [*claims_table(_bubble_claims(index, points)), "", *_profile(index, points)]
    return lines + [""] + tables + (["", *_longer(longer, base_ms, index)] if longer else [])


def _cell(r: dict) -> str:
    return f"{r['measured_mean']:.3f} ({r['measured_mean'] / r['theory']:.2f}×){' *' if r['cpu_contended'] else ''}"


def _bubble_claims(index: dict, points: list[tuple[int, int]]) -> list[tuple[str, str, str, bool | None]]:
    rows = []
    for s in sorted({s for s, _ in points}):
        for schedule, name in (("gpipe", "GPipe"), ("1f1b", "1F1B")):
            ours = [index[k] for m in range(4, 17) if (k := ("emulated", "overlapped", schedule, s, m)) in index]
            if ours:
                ms = ", ".join(str(r["micro_batches"]) for r in ours)
                rows.append(
                    (
                        f"S = {s}, M = {ms}: the measured bubble within {TARGET}× the formula (emulated {name})",
                        f"≤ {TARGET}× at every M",
                        " / ".join(f"{r['measured_mean'] / r['theory']:.2f}×" for r in ours),
                        all(r["measured_mean"] <= TARGET * r["theory"] for r in ours),
                    )
                )
        pairs = [
            (index[("emulated", "overlapped", *k)], index[("emulated", "pytorch", *k)])
            for sch in ("gpipe", "1f1b")
            for m in range(4, 17)
            if ("emulated", "overlapped", *(k := (sch, s, m))) in index and ("emulated", "pytorch", *k) in index
        ]
        if pairs:
            ours, theirs = (statistics.fmean(r["measured_mean"] for r in side) for side in zip(*pairs))
            rows.append(
                (
                    f"S = {s}: receives posted ahead idle less than PyTorch's loop (emulated, both schedules, M ≥ 4)",
                    "mean ours < mean PyTorch's",
                    f"{ours:.3f} vs {theirs:.3f}",
                    ours < theirs,
                )
            )
    return rows


def _profile(index: dict, points: list[tuple[int, int]]) -> list[str]:
    """Where a step went, per phase, mean over stages (ms), and the idle beyond the formula split in two."""
    lines = [
        "Where the step went (emulated, our schedule; ms per step, mean over stages) and the idle beyond the formula, "
        "as shares of the step: *imbalance* (stages that computed longer than others pace the pipeline), "
        "*latency* (the rest: hand-offs, wake-ups, per-micro-batch jitter).",
        "",
        "| schedule | S | M | step | " + " | ".join(PHASES) + " | beyond formula | imbalance | latency |",
        "|---|---:|---:|---:|" + "---:|" * (len(PHASES) + 3),
    ]
    for schedule in ("gpipe", "1f1b"):
        for s, m in points:
            r = index.get(("emulated", "overlapped", schedule, s, m))
            if r is None or "phases_ms_per_stage" not in r or m < 4:
                continue
            phases = [statistics.fmean(p[k] for p in r["phases_ms_per_stage"]) for k in PHASES]
            ex = r["excess"]
            lines.append(
                f"| {schedule} | {s} | {m} | {r['step_ms']:.0f} | " + " | ".join(f"{v:.1f}" for v in phases)
                + f" | {r['measured_mean'] - r['theory']:+.3f} | {ex['imbalance']:+.3f} | {ex['latency']:+.3f} |"
            )  # fmt: skip
    return lines


def _longer(rows: list[dict], base_ms: float, index: dict) -> list[str]:
    """Our schedule with longer emulated work per micro-batch: the same hops, a larger step around them."""
    lines = [
        f"The same rows with longer work per micro-batch (emulated, our schedule; forward ms per stage per batch, "
        f"{base_ms:g} in the tables above): the idle beyond the formula in ms per step, and the ratio to the formula.",
        "",
        "| schedule | S | M | forward ms | step | beyond formula, ms | × formula | beyond formula at "
        f"{base_ms:g} ms, ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["schedule"] != "gpipe", r["stages"], r["micro_batches"], r["stage_ms"])):
        base = index.get(("emulated", "overlapped", r["schedule"], r["stages"], r["micro_batches"]))
        was = f"{(base['measured_mean'] - base['theory']) * base['step_ms']:.1f}" if base else "—"
        lines.append(
            f"| {r['schedule']} | {r['stages']} | {r['micro_batches']} | {r['stage_ms']:g} | {r['step_ms']:.0f} | "
            f"{(r['measured_mean'] - r['theory']) * r['step_ms']:.1f} | {r['measured_mean'] / r['theory']:.2f}× | "
            f"{was} |"
        )
    return lines
