"""The training page's measured block: activation checkpointing's memory and time
(``bench/results/activation-checkpointing.json``, ``make bench-activation-checkpointing``)."""

from __future__ import annotations

from tools.renderers.common import claims_table

MIB = 2**20


def render_activation_checkpointing(doc: dict) -> list[str]:
    """Peak RSS, what a step adds to it, and step time per setting, with the claims the docs make of them."""
    s = doc["settings"]
    lines = [
        f"tiny_transformer (dim {s['dim']}, {s['layers']} blocks), batch {s['batch']} × {s['seq_len']} tokens, AdamW, "
        f"{doc['ranks']} rank, one thread; medians of {s['repeats']} fresh processes per setting, interleaved.",
        "",
        "| activation_checkpointing | units | peak RSS MiB | step adds MiB | × off | step ms | × off |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['variant']} | {len(r['units'])} | {r['peak_rss_bytes'] / MIB:.0f} | "
            f"{r['step_growth_bytes'] / MIB:.0f} | {r['step_growth_vs_off']:.2f} | {r['step_seconds'] * 1e3:.0f} | "
            f"{r['step_time_vs_off']:.2f} |"
        )
    rows = {r["variant"]: r for r in doc["rows"]}
    units, every2 = rows["units"], rows["every:2"]
    claims = [
        (
            "units: a step adds far less memory than with it off",
            "≤ 0.5 × off",
            f"{units['step_growth_vs_off']:.2f} ×",
            units["step_growth_vs_off"] <= 0.5,
        ),
        (
            "every:2 lies between off and units",
            "units < every:2 < off",
            f"{every2['step_growth_vs_off']:.2f} ×",
            units["step_growth_vs_off"] < every2["step_growth_vs_off"] < 1,
        ),
        (
            "units costs about one more forward per step",
            "step time ≤ 1.6 × off",
            f"{units['step_time_vs_off']:.2f} ×",
            units["step_time_vs_off"] <= 1.6,
        ),
    ]
    return lines + [""] + claims_table(claims)
