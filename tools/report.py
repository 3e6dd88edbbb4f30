"""Every measured figure of the docs, rendered from the committed results in bench/results/.

    make bench-report                       # rewrite the generated blocks of the docs
    .venv/bin/python -m tools.report --check  # exit 1 if the docs differ from the JSON (what the unit test checks)

Each results file ``bench/results/<name>.json`` that has a renderer below owns one block of a page, between
``<!-- bench-report:<name> -->`` and ``<!-- /bench-report:<name> -->``: a line saying where the numbers come from
(commit, date, machine, load; ``bench/provenance.py``), the table, and the documented claims with the measured
value and whether each held. A file may feed a second block on another page, ``<name>/<part>`` (the accumulation
bench's checks on docs/accumulation.md). Prose outside the blocks is written by hand and must not repeat a number:
``tests/unit/test_docs.py::test_no_measured_number_outside_generated_blocks`` fails when it does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DOC = REPO / "docs" / "benchmarks.md"
DOCS = sorted((REPO / "docs").glob("*.md"))  # every page may hold generated blocks


def provenance_line(doc: dict) -> str:
    """One line: the commit, the date, the machine and its load while measuring."""
    commit = doc.get("commit", "unknown")
    dirty = " (with uncommitted changes)" if doc.get("dirty") else ""
    m = doc.get("machine", {})
    load = m.get("load_average_before") or []
    after = m.get("load_average_after") or []
    load_text = f"load average {load[0]:.1f} → {after[0]:.1f}" if load and after else "load not recorded"
    return (
        f"*Measured at commit `{commit[:10]}`{dirty}, {doc.get('date', '?')}, {m.get('cores', '?')} cores "
        f"({m.get('cpu_model', '?')}), {load_text} (1 min, before → after), torch {m.get('torch', '?')}.*"
    )


def claims_table(rows: list[tuple[str, str, str, bool | None]]) -> list[str]:
    out = ["| claim | target | measured | held |", "|---|---|---:|---|"]
    for claim, target, measured, held in rows:
        out.append(f"| {claim} | {target} | {measured} | {'yes' if held else 'no' if held is False else '?'} |")
    return out


def render_ddp_bench(doc: dict) -> list[str]:
    models = list(doc["models"])
    variants = list(doc["models"][models[0]]["variants"])
    lines = [
        "| variant | " + " | ".join(f"{m} ms | ×torch" for m in models) + " |",
        "|---|" + "---:|---:|" * len(models),
    ]
    for v in variants:
        cells = []
        for m in models:
            row = doc["models"][m]["variants"][v]
            cells.append(f"{row['median_s'] * 1e3:.1f} | {row['ratio_to_torch']:.2f}")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines += _ddp_memory(doc.get("memory") or {}) + _ddp_losses(doc.get("compression_loss") or {})
    if doc.get("sync_share"):
        shares = ", ".join(f"batch {s['per_rank_batch']}: {s['sync_share']:.0%}" for s in doc["sync_share"])
        lines += ["", f"Share of a deep_mlp step spent on gradient sync (1 − no sync ÷ ours 25MB), per-rank {shares}."]
    return lines + [""] + claims_table(_ddp_claims(doc))


def _ddp_memory(memory: dict) -> list[str]:
    if not memory:
        return []
    names = list(memory)
    lines = [
        "",
        "Memory after 3 steps (the heavier rank), MiB: gradients + buckets, and how far the peak RSS rose while "
        "training.",
        "",
        "| variant | " + " | ".join(f"{m} grads+buckets | {m} peak RSS +" for m in names) + " |",
        "|---|" + "---:|---:|" * len(names),
    ]
    for v in memory[names[0]]:
        cells = []
        for m in names:
            row = memory[m][v]
            rss = row["peak_rss_growth_bytes"]
            cells.append(f"{row['grad_bucket_bytes'] / 2**20:.1f} | {'n/a' if rss is None else f'{rss / 2**20:.1f}'}")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return lines


def _ddp_losses(losses: dict) -> list[str]:
    rows = {k: v for k, v in losses.items() if isinstance(v, dict)}
    if not rows:
        return []
    lines = [
        "",
        f"Loss after {losses['steps']} steps ({losses['model']}, AdamW, a learnable rule; mean of the last 3) with "
        "each wire format:",
        "",
        "| wire format | first loss | final loss | vs torch fp32 |",
        "|---|---:|---:|---:|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['first_loss']:.3f} | {row['final_loss']:.4f} | {row.get('vs_torch_fp32', 0):+.2%} |"
        )
    return lines


def _ddp_claims(doc: dict) -> list[tuple[str, str, str, bool | None]]:
    rows = []
    for m, info in doc["models"].items():
        ratio = info["variants"]["ours 25MB"]["ratio_to_torch"]
        rows.append((f"ours (25 MB buckets) as fast as PyTorch's DDP, {m}", "≤ 1.05×", f"{ratio:.2f}×", ratio <= 1.05))
    mlp = doc["models"].get("deep_mlp", {}).get("variants", {})
    if "lesson loop" in mlp:
        speedup = mlp["lesson loop"]["median_s"] / mlp["ours 25MB"]["median_s"]
        rows.append(("ours faster than the lesson's loop, deep_mlp", "≥ 2×", f"{speedup:.2f}×", speedup >= 2))
    if "ours bf16" in mlp:
        ratio = mlp["ours bf16"]["ratio_to_torch"]
        rows.append(
            ("bf16 compression faster than PyTorch's fp32, deep_mlp", "≤ 0.85×", f"{ratio:.2f}×", ratio <= 0.85)
        )
    for m, memory in (doc.get("memory") or {}).items():
        ours, torch = memory.get("ours view", {}), memory.get("torch view", {})
        if ours.get("peak_rss_growth_bytes") and torch.get("peak_rss_growth_bytes"):
            a, b = ours["peak_rss_growth_bytes"] / 2**20, torch["peak_rss_growth_bytes"] / 2**20
            rows.append(
                (
                    f"with bucket views, ours needs no more memory than PyTorch's (peak RSS growth), {m}",
                    "ours ≤ PyTorch's",
                    f"{a:.1f} vs {b:.1f} MiB",
                    a <= b,
                )
            )
    return rows


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


def render_metrics_overhead(doc: dict) -> list[str]:
    e2e = doc["end_to_end"]
    low, high = e2e["ci95"]
    s = doc["settings"]
    lines = [
        "| | median step ms | runs (ms) |",
        "|---|---:|---|",
        f"| metrics off (`--metrics-port 0`) | {doc['metrics_off_median_step_ms']:.2f} "
        f"| {', '.join(f'{x:.2f}' for x in doc['runs_off_ms'])} |",
        f"| metrics on | {doc['metrics_on_median_step_ms']:.2f} | {', '.join(f'{x:.2f}' for x in doc['runs_on_ms'])} |",
        "",
        f"{s['model']}, {s['world_size']} ranks, {s['steps']} steps per run, {s['repeats']} interleaved on/off pairs. "
        f"End to end (mean of the pairs' on ÷ off − 1): **{e2e['mean_overhead']:+.1%}**, 95% confidence interval "
        f"{low:+.1%} … {high:+.1%} (pair-to-pair standard deviation {e2e['pair_sd']:.1%}: the noise). "
        f"Direct cost of `observe_step`: {doc['observe_step_us']:.0f} µs per step, "
        f"{doc['direct_overhead']:.2%} of the step (what the end-to-end figure converges to; it explains, it "
        "does not decide).",
        "",
    ]
    verdict = e2e["verdict"]
    held = {"met": True, "not met": False}.get(verdict)
    rows = [
        (
            "metrics cost at most 2% of the step, end to end",
            f"≤ {doc['target']:.0%}, whole 95% interval",
            f"{low:+.1%} … {high:+.1%}",
            held,
        )
    ]
    out = claims_table(rows)
    if held is None:
        out.append("")
        out.append(
            "`?` = inconclusive: the interval straddles the target, i.e. this machine's run-to-run noise is larger "
            "than the effect; more `--repeats` or a quieter machine narrow it."
        )
    return lines + out


def render_mutants(doc: dict) -> list[str]:
    lines = [
        f"Score: **{doc['caught']}/{doc['total']} caught**.",
        "",
        "| mutant | file | the bug | caught by | outcome |",
        "|---|---|---|---|---|",
    ]
    for m in doc["mutants"]:
        tests = ", ".join(f"`{t.split('::')[-1]}`" for t in m["tests"])
        lines.append(f"| `{m['name']}` | `{m['path']}` | {m['what']} | {tests} | {m['outcome']} |")
    return lines


def render_mutation(doc: dict) -> list[str]:
    """The generated-mutant run of ``make mutants`` (tools/mutation.py): score, per area, survivors and triage."""
    score = doc["score"]
    target = doc["settings"].get("target", 0.85)
    shown = f"{score:.0%}" if score is not None else "n/a"
    held = "held" if score is not None and score >= target else "not held"
    not_run = ", ".join(f"{n} {what}" for what, n in doc["not_run"].items() if n) or "none"
    secs = sorted(r["seconds"] for r in doc["mutants"] if r.get("seconds"))
    timeouts = sum(r["outcome"] == "killed (timeout)" for r in doc["mutants"])
    median = f"{secs[len(secs) // 2]:.0f} s" if secs else "n/a"
    lines = [
        f"Score: **{doc['killed']} killed of {doc['ran'] - doc['equivalent']}** non-equivalent mutants that ran "
        f"(**{shown}**, {timeouts} of the kills by timeout; target {target:.0%}: "
        f"{held}). {doc['library']}, "
        f"seed {doc['seed']}: {doc['sample']} drawn of {doc['generated']} generated, {doc['ran']} ran, "
        f"{doc['equivalent']} judged equivalent; not counted: {not_run}. Wall time {doc['wall_seconds'] / 60:.0f} "
        f"min with {doc['settings'].get('jobs', 1)} at once, median {median} a mutant."
        + (
            " Kills not rerun unmutated (the run was cut short before that check)."
            if doc.get("kills_confirmed") is False
            else ""
        ),
        "",
        "| area | killed | counted | score |",
        "|---|---:|---:|---:|",
    ]
    for area, a in doc["by_area"].items():
        lines.append(f"| `{area}` | {a['killed']} | {a['counted']} | {a['killed'] / a['counted']:.0%} |")
    survivors = [r for r in doc["mutants"] if r["outcome"] == "survived"]
    lines += [
        "",
        "| survivor | where | mutant | verdict | why / the test that would kill it |",
        "|---|---|---|---|---|",
    ]
    for r in survivors:
        t = r.get("triage", {})
        why = t.get("reason", "") + (f" Kill: {t['kill']}" if t.get("kill") else "")
        change = f"`{r['before']}` → `{r['after']}`".replace("|", "\\|")
        lines.append(f"| `{r['id']}` | `{r['path']}:{r['line']}` | {change} | {t.get('verdict', '?')} | {why} |")
    return lines


def render_chaos(doc: dict) -> list[str]:
    s = doc["settings"]
    codes, dtype = doc["exit_codes"], doc.get("dtype", "float32")  # results before the dtype setting: float32
    rows = [
        ("verdict", f"**{doc['verdict']}**"),
        ("killed at step / resumed from", f"{doc['killed_at_step']} / {doc['resumed_from_step']}"),
        (f"steps redone (≤ one checkpoint interval, {s['checkpoint_every']})", doc["steps_redone"]),
        (f"failure → first step of the world of {s['workers'] - 1}", f"{doc['failure_to_next_step_s']} s"),
        (f"scale-up → first step of the world of {s['workers']}", f"{doc['scale_up_to_next_step_s']} s"),
        ("checkpoint write (median)", f"{doc['checkpoint_ms_median']} ms ({doc['checkpoints_written']} writes)"),
        ("exit codes A / B", f"{sorted(set(codes['A'].values()))} / {sorted(set(codes['B'].values()))}"),
        ("final loss A / B", f"{doc['final_loss']['A']} / {doc['final_loss']['B']}"),
        (
            f"max \\|Δparam\\| B vs A ({dtype}; tolerance {doc['tolerance']:g})",
            f"{doc['max_abs_param_diff']:.2g}",
        ),
        ("\\|θA − θB\\| / \\|θA\\|", f"{doc['relative_param_distance']:.2g}"),
    ]
    lines = [
        f"{s['workers']} workers, {s['steps']} steps, global batch {s['effective_batch']} samples, checkpoint every "
        f"{s['checkpoint_every']} steps, victim {s['victim']}, {dtype}; {doc.get('wall_s', '?')} s in all.",
        "",
        "| | run B against run A |",
        "|---|---|",
    ]
    return lines + [f"| {name} | {value} |" for name, value in rows]


def render_world_drift(doc: dict) -> list[str]:
    s = doc["settings"]
    dtypes = s["dtypes"]
    head = "| step | " + " | ".join(f"{d} max \\|Δparam\\| | {d} \\|Δθ\\|/\\|θ\\|" for d in dtypes) + " |"
    lines = [
        f"World {s['worlds'][0]} against world {s['worlds'][1]}, no failure, global batch {s['effective_batch']} "
        f"samples in micro-batches of at most {s['micro_batch']}, AdamW, `torchrun --standalone`.",
        "",
        head,
        "|---:|" + "---:|---:|" * len(dtypes),
    ]
    for row in doc["rows"]:
        cells = " | ".join(f"{row[d]['max_abs']:.2g} | {row[d]['relative']:.2g}" for d in dtypes)
        lines.append(f"| {row['step']} | {cells} |")
    return lines


def render_drills(doc: dict) -> list[str]:
    s = doc["settings"]
    lines = [
        f"{s['workers']} workers, global batch {s['effective_batch']}, checkpoint every {s['checkpoint_every']} "
        f"steps, DDP_COLLECTIVE_TIMEOUT_SECONDS={s['collective_timeout']}, LAUNCH_STORE_WAIT_SECONDS="
        f'{s["store_wait"]}; a drill that had not ended after {s["bound"]} s would read "hung".',
        "",
        "| drill | outcome | measured | exit codes (restarts) | first message |",
        "|---|---|---|---|---|",
    ]
    for name, key, measured in (
        (
            "a peer paused (`docker pause`), unpaused later",
            "pause",
            lambda d: (
                f"pause → training on {s['workers'] - 1}: {d['pause_to_step_in_smaller_world_s']} s; "
                f"unpause → on {s['workers']} again: {d['unpause_to_step_in_full_world_s']} s"
            ),
        ),
        (
            "the store killed (`docker kill`)",
            "store",
            lambda d: (
                f"kill → first exit: ≤ {max(d['kill_to_first_exit_s'].values())} s; "
                f"→ every worker gone for good: {d['kill_to_all_exited_s']} s"
            ),
        ),
    ):
        d = doc.get(key)
        if not d:
            continue
        codes = ", ".join(f"{c['exit_code']} ({c['restart_count']})" for c in d["containers"])
        first = ((d.get("messages") or d.get("messages_after_pause") or {}).get("lines") or ["—"])[0]
        first = first.split(" ERROR ", 1)[-1].split(" INFO ", 1)[-1].replace("|", "\\|")
        lines.append(f"| {name} | {d['verdict']} | {measured(d)} | {codes} | `{first}` |")
    return lines


RENDERERS = {
    "drills": render_drills,
    "chaos": render_chaos,
    "world-drift": render_world_drift,
    "ddp-bench": render_ddp_bench,
    "accum-curve": render_accum_curve,
    "accum-curve/checks": render_accum_checks,
    "pipeline-bubble": render_pipeline_bubble,
    "metrics-overhead": render_metrics_overhead,
    "mutants": render_mutants,
    "mutation": render_mutation,
}


def render(name: str, doc: dict) -> str:
    """The generated block of ``name`` (without its markers) from its results document."""
    return "\n".join([provenance_line(doc), "", *RENDERERS[name](doc)])


def block_pattern(name: str) -> re.Pattern:
    n = re.escape(name)
    return re.compile(rf"(<!-- bench-report:{n} -->\n)(?:.*?\n)?(<!-- /bench-report:{n} -->)", re.S)


def rendered_page(text: str, results: Path = RESULTS) -> str:
    """``text`` (the docs page) with every generated block replaced by the rendering of its JSON.

    Args:
        text: the page's markdown, with ``<!-- bench-report:NAME -->`` ... ``<!-- /bench-report:NAME -->`` blocks.
        results: the folder of ``NAME.json`` files.

    Example::

        page = DOC.read_text()
        assert rendered_page(page) == page  # the docs match the committed results
    """
    for name in RENDERERS:
        pattern = block_pattern(name)
        if not pattern.search(text):
            continue
        doc = json.loads((results / f"{name.partition('/')[0]}.json").read_text())  # NAME/PART: a part of NAME
        body = render(name, doc)
        text = pattern.sub(lambda m, body=body: m[1] + body + "\n" + m[2], text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs from the rendering")
    args = parser.parse_args(argv)
    pages = {doc: doc.read_text() for doc in DOCS if doc.exists()}
    placed = {n for n in RENDERERS for text in pages.values() if block_pattern(n).search(text)}
    unplaced = [n for n in RENDERERS if n not in placed and (RESULTS / f"{n.partition('/')[0]}.json").exists()]
    if unplaced:
        print(f"note: no page has a block for {', '.join(unplaced)}", file=sys.stderr)
    stale = []
    for doc, text in pages.items():
        new = rendered_page(text)
        if new == text:
            continue
        stale.append(doc.relative_to(REPO))
        if not args.check:
            doc.write_text(new)
            print(f"updated {doc.relative_to(REPO)}")
    if args.check and stale:
        print(f"{', '.join(map(str, stale))} differ from bench/results/: run `make bench-report`", file=sys.stderr)
        return 1
    if not stale:
        print("the docs already match bench/results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
