"""The corpus curve's block (``bench/results/corpus-curve.json``, ``python -m bench.corpus_curve``) on docs/check.md:
held-out and training loss per step on each world size, and the claims the docs make about them."""

from __future__ import annotations

from tools.renderers.common import claims_table


def render_corpus_curve(doc: dict) -> list[str]:
    runs, base = doc["runs"], doc["baselines"]
    worlds = list(runs)
    head = " | ".join(f"held-out, world {w} | train (rank 0), world {w}" for w in worlds)
    lines = [f"| step | {head} |", "|---:|" + "---:|---:|" * len(worlds)]
    for step in runs[worlds[0]]["held_out_loss"]:
        cells = []
        for w in worlds:
            train = runs[w]["train_loss"].get(step)
            cells.append(f"{runs[w]['held_out_loss'][step]:.3f} | {'–' if train is None else f'{train:.3f}'}")
        lines.append(f"| {step} | {' | '.join(cells)} |")
    last = {w: list(runs[w]["held_out_loss"].values())[-1] for w in worlds}
    first = worlds[0]
    lines += [
        "",
        f"Data: {doc['corpus']['train']}; held out: {doc['corpus']['held_out']}. Wall time: "
        + ", ".join(f"world {w} {runs[w]['wall_s']:.0f} s" for w in worlds)
        + ".",
        "",
    ]
    rows = [
        (
            f"world {first} ends below the unigram loss ({base['unigram']:.3f}; "
            f"uniform ln 256 = {base['uniform']:.3f})",
            "below",
            f"{last[first]:.3f}",
            last[first] < base["unigram"],
        )
    ]
    for w in worlds[1:]:
        gap = abs(last[w] - last[first])
        rows.append(
            (
                f"world {w} ends at world {first}'s held-out loss (same global batch)",
                "≤ 0.02",
                f"{gap:.4f}",
                gap <= 0.02,
            )
        )
    return lines + claims_table(rows)
