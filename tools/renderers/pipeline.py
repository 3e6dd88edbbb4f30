"""The pipeline bubble's block (``bench/results/pipeline-bubble.json``, ``python -m bench.pipeline_bubble``): idle
share per stage against GPipe's formula."""

from __future__ import annotations

from tools.renderers.common import claims_table

BUBBLE_KINDS = (("emulated", "gpipe"), ("emulated", "1f1b"), ("real", "gpipe"), ("real", "1f1b"))


def render_pipeline_bubble(doc: dict) -> list[str]:
    """The idle share per stage against GPipe's formula, and what the emulated rows say about it."""
    index = {(r["compute"], r["schedule"], r["stages"], r["micro_batches"]): r for r in doc["rows"]}
    points = sorted({(r["stages"], r["micro_batches"]) for r in doc["rows"]})
    lines = [
        "Each cell: the mean over stages of each stage's idle share; — = 1F1B needs M ≥ S; * = more stages than "
        "cores (contended).",
        "",
        "| S | M | (S−1)/(M+S−1) | emulated GPipe | emulated 1F1B | real GPipe | real 1F1B |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for stages, micro in points:
        cells = []
        for kind in BUBBLE_KINDS:
            r = index.get((*kind, stages, micro))
            cells.append("—" if r is None else f"{r['measured_mean']:.2f}{' *' if r['cpu_contended'] else ''}")
        theory = (stages - 1) / (micro + stages - 1)
        lines.append(f"| {stages} | {micro} | {theory:.2f} | " + " | ".join(cells) + " |")
    return lines + [""] + claims_table(_bubble_claims(index, points))


def _bubble_claims(index: dict, points: list[tuple[int, int]]) -> list[tuple[str, str, str, bool | None]]:
    rows = []
    for s in sorted({s for s, _ in points}):
        gpipe = [
            index[("emulated", "gpipe", s, m)] for t, m in points if t == s and ("emulated", "gpipe", s, m) in index
        ]
        if len(gpipe) < 2:
            continue
        first, gaps = gpipe[0], [r["measured_mean"] - r["theory"] for r in gpipe]
        rows.append(
            (
                f"S = {s}, M = {first['micro_batches']}: the formula holds (emulated GPipe)",
                "\\|measured − formula\\| ≤ 0.05",
                f"{abs(gaps[0]):.2f}",
                abs(gaps[0]) <= 0.05,
            )
        )
        grows = all(b >= a for a, b in zip(gaps, gaps[1:]))
        rows.append(
            (
                f"S = {s}: the measured idle exceeds the formula more as M grows (emulated GPipe)",
                "gap rises with M",
                " → ".join(f"{g:+.2f}" for g in gaps),
                grows,
            )
        )
        shrinks = all(b["measured_mean"] < a["measured_mean"] for a, b in zip(gpipe, gpipe[1:]))
        rows.append(
            (
                f"S = {s}: more micro-batches still shrink the idle share (emulated GPipe)",
                "falls with M",
                " → ".join(f"{r['measured_mean']:.2f}" for r in gpipe),
                shrinks,
            )
        )
    pairs = [
        (index[("emulated", "1f1b", s, m)], index[("emulated", "gpipe", s, m)])
        for s, m in points
        if ("emulated", "1f1b", s, m) in index and ("emulated", "gpipe", s, m) in index
    ]
    if pairs:
        worst = max(a["measured_mean"] - b["measured_mean"] for a, b in pairs)
        rows.append(
            ("1F1B idles no more than GPipe, emulated, every S and M", "1F1B − GPipe ≤ 0", f"{worst:+.2f}", worst <= 0)
        )
    return rows
