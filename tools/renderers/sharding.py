"""The ZeRO stages' block of docs/sharding.md (``bench/results/zero.json``, written by ``python -m bench.zero_bench``):
bytes per rank against the formula, step time against DDP, bytes handed to collectives, and the documented targets.

A step-time target is judged on the interleaved repeats, not on the medians alone: each repeat ran every variant
once, so ``variant / ddp`` of the same repeat is one paired ratio. All pairs on one side of the target: held or
missed; pairs on both sides: the machine's noise is larger than the effect, and the claim reads ``?``.
"""

from __future__ import annotations

from tools.renderers.common import claims_table

MIB = 2**20
STAGE_OF = {
    "ddp": "DDP",
    "zero1": "1",
    "torch zero1": "1 (PyTorch)",
    "zero2": "2",
    "zero2 overlap": "2, all-gather overlapped",
    "zero3": "3",
    "zero3 prefetch": "3, prefetch 1",
    "torch fsdp2": "3 (PyTorch)",
}
STATE_SHARE_TOLERANCE = 0.05  # stage 1's optimizer state per rank: within 5% of 1/N of DDP's
STEP_TIME_TARGET = 1.15  # stage 2's step time: at most 1.15x DDP's
# (variant, claim, reference, at most): the overlapped stages' step time against DDP's and fully_shard's (issue 39)
OVERLAP_TARGETS = [
    ("zero2 overlap", "stage 2 with `overlap_gather`: step time", "ddp", 1.10),
    ("zero3 prefetch", "stage 3 with `prefetch=1`: step time", "ddp", 1.5),
    ("zero3 prefetch", "stage 3 with `prefetch=1`: step time", "torch fsdp2", 0.5),
]


def render_zero(doc: dict) -> list[str]:
    m, s = doc["model"], doc["settings"]
    lines = [
        f"`python -m bench.zero_bench`: {m['kind']} ({m['depth']} × Linear({m['width']}, {m['width']})), "
        f"Psi = {m['psi']:,} parameters, AdamW, batch {s['batch']} per rank; step time: {s['repeats']} interleaved "
        f"repeats of {s['steps']} steps per variant. Bytes per rank after backward (each storage counted once), MiB; "
        "formula = Psi·(4 + 4 + 8) with the sharded terms divided by N; peak RSS growth = VmHWM's rise while "
        "training (it also counts activations, buckets, gathered units and allocator slack).",
        "",
        "| N | variant | stage | params | grads | optimizer | total | formula | peak RSS growth | step ms | × DDP "
        "| repeats' max ÷ min |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, rows in doc["results"].items():
        for name, r in rows.items():
            reps = r["step_seconds_per_repeat"]
            lines.append(
                f"| {world} | {name} | {STAGE_OF.get(name, '?')} | {r['params_bytes'] / MIB:.2f} "
                f"| {r['grads_bytes'] / MIB:.2f} | {r['optimizer_bytes'] / MIB:.2f} | {r['total_bytes'] / MIB:.2f} "
                f"| {r['formula_bytes'] / MIB:.2f} | {r['peak_rss_growth_bytes'] / MIB:.1f} "
                f"| {r['step_seconds_median'] * 1e3:.0f} | {r['step_time_vs_ddp']:.2f} | {max(reps) / min(reps):.1f} |"
            )
    lines += ["", *_comm_table(doc["results"]), "", "![bytes per rank and step time](../bench/results/zero.png)", ""]
    lines += claims_table(_zero_claims(doc["results"]))
    return lines + [
        "",
        "`?` = inconclusive: the repeats' paired ratios (each repeat ran every variant) fall on both sides of the "
        "target, i.e. this machine's run-to-run noise is larger than the effect; a quieter machine or more "
        "`--repeats` decide it.",
    ]


def _comm_table(results: dict) -> list[str]:
    """Bytes handed to collectives per step, and what the ring model says each rank sends (PyTorch's not counted)."""
    lines = [
        "Bytes handed to collectives per step, MiB, and each rank's ring wire bytes (all-reduce sends 2(N−1)/N of "
        "its buffer, reduce-scatter, all-gather and broadcast (N−1)/N):",
        "",
        "| N | variant | collectives | wire bytes per rank | × DDP's |",
        "|---:|---|---|---:|---:|",
    ]
    for world, rows in results.items():
        ddp = rows["ddp"]["ring_wire_bytes_per_rank_per_step"]
        for name, r in rows.items():
            if r["comm_bytes_per_step"] is None:
                continue
            calls = ", ".join(f"{k} {v / MIB:.2f}" for k, v in r["comm_bytes_per_step"].items())
            wire = r["ring_wire_bytes_per_rank_per_step"]
            lines.append(f"| {world} | {name} | {calls} | {wire / MIB:.2f} | {wire / ddp:.2f} |")
    return lines


def _paired_verdict(ratios: list[float], target: float) -> bool | None:
    """Held if every repeat's ratio is within ``target``, missed if none is, ``None`` (cannot tell) otherwise."""
    if all(r <= target for r in ratios):
        return True
    return False if all(r > target for r in ratios) else None


def _zero_claims(results: dict) -> list[tuple[str, str, str, bool | None]]:
    rows = []
    for world, r in results.items():
        n, share = int(world), r["zero1"]["optimizer_vs_ddp"]
        rows.append(
            (
                f"N = {n}: stage 1 optimizer state per rank is 1/N of DDP's",
                f"within {STATE_SHARE_TOLERANCE:.0%} of {1 / n:.3f}",
                f"{share:.3f}",
                abs(share * n - 1) <= STATE_SHARE_TOLERANCE,
            )
        )
    for world, r in results.items():
        worst = max(abs(v["total_vs_formula"] - 1) for v in r.values())
        rows.append(
            (
                f"N = {world}: params + grads + state per rank = the formula, every variant",
                "\\|total ÷ formula − 1\\| ≤ 1%",
                f"{worst:.2%}",
                worst <= 0.01,
            )
        )
    for world, r in results.items():
        same = all(
            r[theirs]["total_bytes"] == r[ours]["total_bytes"]
            for theirs, ours in (("torch zero1", "zero1"), ("torch fsdp2", "zero3"))
            if theirs in r
        )
        rows.append(
            (
                f"N = {world}: PyTorch's ZeroRedundancyOptimizer and `fully_shard` hold the bytes ours hold",
                "equal totals",
                "equal" if same else "differ",
                same,
            )
        )
    for world, r in results.items():
        pairs = [a / b for a, b in zip(r["zero2"]["step_seconds_per_repeat"], r["ddp"]["step_seconds_per_repeat"])]
        rows.append(
            (
                f"N = {world}: stage 2 step time within {STEP_TIME_TARGET:g}× DDP's",
                f"≤ {STEP_TIME_TARGET:g}×, every repeat",
                f"{r['zero2']['step_time_vs_ddp']:.2f}× (repeats {min(pairs):.2f}–{max(pairs):.2f}×)",
                _paired_verdict(pairs, STEP_TIME_TARGET),
            )
        )
    return rows + _overlap_claims(results)


def _overlap_claims(results: dict) -> list[tuple[str, str, str, bool | None]]:
    """``OVERLAP_TARGETS``, judged like stage 2's: on every repeat's paired ratio (absent variants: no row)."""
    rows = []
    for world, r in results.items():
        for name, what, of, limit in OVERLAP_TARGETS:
            if name not in r or of not in r:
                continue
            pairs = [a / b for a, b in zip(r[name]["step_seconds_per_repeat"], r[of]["step_seconds_per_repeat"])]
            median = r[name]["step_seconds_median"] / r[of]["step_seconds_median"]
            rows.append(
                (
                    f"N = {world}: {what} within {limit:g}× {'DDP' if of == 'ddp' else '`fully_shard`'}'s",
                    f"≤ {limit:g}×, every repeat",
                    f"{median:.2f}× (repeats {min(pairs):.2f}–{max(pairs):.2f}×)",
                    _paired_verdict(pairs, limit),
                )
            )
    return rows


def render_memory(doc: dict) -> list[str]:
    """``bench/results/memory.json`` (``python -m bench.memory_bench``): each kind's peak per rank, where it came,
    against formula + base and against ``python -m app.plan``'s prediction."""
    m, tol = doc["model"], doc["tolerance"]
    lines = [
        f"`python -m bench.memory_bench`: the worker (`torchrun -m app.train`) on `{m['spec']}` "
        f"(width {m['width']}, depth {m['depth']}: Ψ = {m['psi']:,} parameters), AdamW, fp32, 3 steps and one save "
        "(*fresh*), then one more step from that checkpoint (*resume*). Peak = the heaviest trainer rank's VmHWM, "
        "MiB; *phase* = where it reached it; base = the same worker and kind with a tiny model; formula = "
        "`app.plan.state_bytes`; *planned* = `python -m app.plan`'s prediction.",
        "",
        "| N | kind | formula | base | formula + base | fresh peak | × | phase | resume peak | × | phase "
        "| planned fresh, resume | planned ÷ measured |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    within, total = 0, 0
    for world, rows in doc["results"].items():
        for kind, r in rows.items():
            f, res, planned = r["fresh"], r["resume"], r["predicted"]
            ratios = [planned["peak"] / f["peak_bytes"], planned["resume_peak"] / res["peak_bytes"]]
            within += sum(abs(x - 1) <= tol for x in ratios)
            total += 2
            lines.append(
                f"| {world} | {kind} | {r['formula_bytes'] / MIB:.0f} | {r['base']['peak_bytes'] / MIB:.0f} "
                f"| {r['expected_bytes'] / MIB:.0f} | {f['peak_bytes'] / MIB:.0f} | {f['vs_expected']:.2f} "
                f"| {f['peak_phase']} | {res['peak_bytes'] / MIB:.0f} | {res['vs_expected']:.2f} | {res['peak_phase']} "
                f"| {planned['peak'] / MIB:.0f}, {planned['resume_peak'] / MIB:.0f} "
                f"| {ratios[0]:.2f}, {ratios[1]:.2f} |"
            )
    held = sum(
        abs(r[run]["vs_expected"] - 1) <= tol
        for rows in doc["results"].values()
        for r in rows.values()
        for run in ("fresh", "resume")
    )
    return (
        lines
        + [
            "",
            f"Within {tol:.0%} of formula + base: {held} of {total} peaks; planned within {tol:.0%} of measured: "
            f"{within} of {total}.",
        ]
        + _render_activation_checkpointing(doc.get("activation_checkpointing"))
    )


def _render_activation_checkpointing(ac: dict | None) -> list[str]:
    """Issue 37's item 4: the same worker with ``--activation-checkpointing`` off and units, measured and planned."""
    if not ac:
        return []
    facts = ac["facts"]
    lines = [
        "",
        f"Activation checkpointing, {ac['kind']} at N = {ac['world_size']}, micro-batch {ac['micro_batch']} (fresh "
        f"runs; one micro-batch's activations as `app.plan` measures them: "
        f"{facts['activation_bytes'] / MIB:.1f} MiB, {facts['activation_bytes_checkpointed'] / MIB:.1f} MiB with "
        "each unit checkpointed):",
        "",
        "| --activation-checkpointing | peak | phase | planned | planned ÷ measured |",
        "|---|---:|---|---:|---:|",
    ]
    for setting, run in ac["runs"].items():
        lines.append(
            f"| {setting} | {run['peak_bytes'] / MIB:.0f} | {run['peak_phase']} | {run['predicted_bytes'] / MIB:.0f} "
            f"| {run['predicted_vs_measured']:.2f} |"
        )
    return lines + [
        "",
        f"Peak lowered by {ac['measured_saving_bytes'] / MIB:.0f} MiB measured, "
        f"{ac['predicted_saving_bytes'] / MIB:.0f} MiB planned.",
    ]


PHASES = ("forward", "backward", "step", "all_gather_wait", "reduce_scatter_wait", "total")


def render_zero_phases(doc: dict) -> list[str]:
    """bench/zero_phases.py's cut of each step (``bench/results/zero-phases.json``): where stage 2's and stage 3's
    extra time goes, beside DDP's and ``fully_shard``'s."""
    s = doc["settings"]
    lines = [
        f"`python -m bench.zero_phases`: zero_bench's model, {s['repeats']} interleaved repeats of {s['steps']} "
        "steps; ms, rank 0, the median over repeats of each repeat's median. The waits are the wrappers' own "
        "`comm_seconds` (launch and wait of each collective inside the step; PyTorch's wrappers keep none): they "
        "overlap the phases, so they do not add up to the total.",
        "",
        "| N | variant | forward | backward | step | all-gather wait | reduce-scatter wait | total | total × DDP |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, rows in doc["results_seconds"].items():
        ddp = rows["ddp"]["total"]
        for name, r in rows.items():
            cells = " | ".join(f"{r[p] * 1e3:.1f}" if p in r else "–" for p in PHASES)
            lines.append(f"| {world} | {name} | {cells} | {r['total'] / ddp:.2f} |")
    return lines
