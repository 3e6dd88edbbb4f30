"""What every renderer shares: the claims table (claim, target, measured, held)."""

from __future__ import annotations


def claims_table(rows: list[tuple[str, str, str, bool | None]]) -> list[str]:
    """One row per documented claim; held is yes, no, or ``?`` (``None``: the run cannot tell)."""
    out = ["| claim | target | measured | held |", "|---|---|---:|---|"]
    for claim, target, measured, held in rows:
        out.append(f"| {claim} | {target} | {measured} | {'yes' if held else 'no' if held is False else '?'} |")
    return out
