"""Gradient accumulation's blocks (``bench/results/accum-curve.json``, ``python -m bench.accum``): the throughput
curve on docs/benchmarks.md and the equivalence checks (``accum-curve/checks``) on docs/accumulation.md."""

from __future__ import annotations

from tools.renderers.common import claims_table


def render_accum_curve(doc: dict) -> list[str]:
    lines = [
        "| sync | effective batch | K | samples/s | median step ms | syncs | syncs / sample | optimizer ms "
        "| of compute only |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    points = sorted(doc["points"], key=lambda p: (p["accum_steps"], p["sync_mode"] != "last"))
    for p in points:
        lines.append(
            f"| {p['sync_mode']} | {p['effective_batch']} | {p['accum_steps']} | {p['samples_per_sec']:.0f} "
            f"| {p['median_step_ms']:.0f} | {p['sync_calls']} | 1/{round(1 / p['syncs_per_sample'])} "
            f"| {p['median_optimizer_ms']:.0f} | {p['fraction_of_compute_only']:.0%} |"
        )
    lines += [
        "",
        f"Compute only (forward + backward, no sync, no optimizer): {doc['compute_only_samples_per_sec']:.0f} "
        "samples/s.",
        "",
    ]
    last = {p["accum_steps"]: p for p in points if p["sync_mode"] == "last"}
    every = {p["accum_steps"]: p for p in points if p["sync_mode"] == "every"}
    ks = sorted(last)
    rows = []
    if {1, 4} <= set(ks) and len(ks) > 2:
        lo, hi = last[1]["samples_per_sec"], last[ks[-1]]["samples_per_sec"]
        share = (last[4]["samples_per_sec"] - lo) / (hi - lo) if hi > lo else float("nan")
        rows.append(
            (
                f"most of the gain of K = 1 → {ks[-1]} comes by K = 4 (sync on last)",
                "≥ 75%",
                f"{share:.0%}",
                share >= 0.75,
            )
        )
    one_sync = all(p["sync_calls"] == p["steps"] for p in last.values())
    rows.append(("sync on last: one sync per optimizer step, whatever K", "1", "1" if one_sync else "more", one_sync))
    if ks and ks[-1] in every:
        gain = last[ks[-1]]["samples_per_sec"] / every[ks[-1]]["samples_per_sec"]
        rows.append((f"sync on last beats syncing every micro-batch at K = {ks[-1]}", "> 1×", f"{gain:.2f}×", gain > 1))
    rows.append(
        (
            "every equivalence / sync-count check of the bench",
            "all pass",
            f"{len(doc['failed'])} failed",
            not doc["failed"],
        )
    )
    return lines + claims_table(rows)


def _fmt(x: float) -> str:
    """A measured gap for a table: two significant digits (1.5e-08, 0.029)."""
    return f"{x:.2g}"


def both(r: dict) -> str:
    """An equivalence check's two gaps, the gradients' and the parameters'."""
    return f"max \\|Δgrad\\| {_fmt(r['max_abs_dgrad'])}, max \\|Δparam\\| {_fmt(r['max_abs_dparam'])}"


def render_accum_checks(doc: dict) -> list[str]:
    """The accumulation claims that ``make accum`` checks, for docs/accumulation.md."""
    eq, syncs, wrong, adamw = (doc["checks"][k] for k in ("equivalence", "syncs", "wrong_scale", "adamw"))
    kib = {k: v["bytes_reduced"] / 1024 for k, v in syncs.items()}
    k = syncs["sync_on_last"]["accum_steps"]
    steps = syncs["sync_on_last"]["optimizer_steps"]
    rows = [
        ("one batch of 16 vs 4 micro-batches of 4 (one process, SGD + momentum)", both(eq["single_16_vs_4x4"])),
        ("under DDP: one batch of 32 vs 2 ranks × 4 micro-batches of 4, our DDP", both(eq["ddp_32_vs_2x4x4"])),
        ("the same with PyTorch's DDP", both(eq["torch_ddp_32_vs_2x4x4"])),
        ("2×8 vs 4×4, both accumulated, float32", both(eq["2x8_vs_4x4"])),
        ("the same in float64", both(eq["2x8_vs_4x4_float64"])),
        (
            f"syncs, K = {k}, {steps} optimizer steps: sync on last / every micro-batch / forward outside `no_sync()`",
            " / ".join(str(v["sync_calls"]) for v in syncs.values())
            + " syncs; "
            + " / ".join(f"{v:.1f}" for v in kib.values())
            + " KiB reduced",
        ),
        (
            f"loss not divided by K = {wrong['sgd']['accum_steps']}, one SGD step",
            f"the update is {wrong['sgd']['update_ratio']:.2f}× the right one; max \\|Δparam\\| "
            f"{_fmt(wrong['sgd']['max_abs_dparam_wrong'])} (right: {_fmt(wrong['sgd']['max_abs_dparam_right'])})",
        ),
        (
            "the same with AdamW",
            f"update {wrong['adamw']['update_ratio']:.2f}× the right one, max \\|Δparam\\| "
            f"{_fmt(wrong['adamw']['max_abs_dparam_wrong'])}: Adam divides by √v, so the mistake hides",
        ),
        (
            f"AdamW, {adamw['accumulation_step']['optimizer_steps']} optimizer steps of K = {k}",
            f'`state["step"]` = {adamw["accumulation_step"]["state_step"][0]} (`step()` per micro-batch: '
            f"{adamw['step_per_micro_batch']['state_step'][0]}, and "
            f"{_fmt(adamw['step_per_micro_batch']['max_abs_dparam'])} off the big batch)",
        ),
    ]
    lines = [
        f"{doc['world_size']} ranks, `MiniMLP` (the bench's checks; its throughput curve uses another model); syncs "
        f"read from our DDP's own counter, `ddp.stats.sync_calls`. Every check of the bench: {len(doc['failed'])} "
        "failed.",
        "",
        "| claim | measured |",
        "|---|---|",
    ]
    return lines + [f"| {claim} | {measured} |" for claim, measured in rows]
