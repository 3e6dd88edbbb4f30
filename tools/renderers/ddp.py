"""The DDP bench's block of docs/benchmarks.md: step time against PyTorch's DDP, memory, wire formats' losses
(``bench/results/ddp-bench.json``, written by ``python -m bench.ddp_bench``)."""

from __future__ import annotations

from tools.renderers.common import claims_table


def render_ddp_bench(doc: dict) -> list[str]:
    models = list(doc["models"])
    variants = list(doc["models"][models[0]]["variants"])
    lines = _variant_table(
        doc,
        variants,
        lambda m: f"{m} ms | ×torch",
        lambda row: f"{row['median_s'] * 1e3:.1f} | {row['ratio_to_torch']:.2f}",
    )
    lines += _ddp_memory(doc.get("memory") or {}) + _ddp_losses(doc.get("compression_loss") or {})
    if doc.get("sync_share"):
        shares = ", ".join(f"batch {s['per_rank_batch']}: {s['sync_share']:.0%}" for s in doc["sync_share"])
        lines += ["", f"Share of a deep_mlp step spent on gradient sync (1 − no sync ÷ ours 25MB), per-rank {shares}."]
    return lines + [""] + claims_table(_ddp_claims(doc))


def _variant_table(doc: dict, variants, header, cells) -> list[str]:
    """A markdown table with a row per variant and, per model, the columns ``header(model)`` names (numbers, right
    aligned) filled by ``cells(that model's row of the variant)``."""
    models = list(doc["models"])
    columns = header(models[0]).count("|") + 1
    lines = ["| variant | " + " | ".join(header(m) for m in models) + " |", "|---|" + "---:|" * columns * len(models)]
    for v in variants:
        lines.append(f"| {v} | " + " | ".join(cells(doc["models"][m]["variants"][v]) for m in models) + " |")
    return lines


COMPILE_ROWS = ("torch 25MB", "ours 25MB", "torch compiled", "ours compiled", "ours compiled units")


def render_ddp_compile(doc: dict) -> list[str]:
    """bench/ddp_bench.py's compiled variants run alone (bench/results/ddp-compile.json): step time, warm-up (the
    compile), and ours against PyTorch's both compiled and not."""
    models = list(doc["models"])
    lines = [
        f"torch.compile backend `{doc.get('compile_backend', '?')}`, world size {doc['world_size']} "
        f"({doc['backend']}), {doc['repeats']} interleaved repeats × {doc['steps']} steps; ms: the median step of "
        "the slowest rank; warm-up: rank 0's untimed first steps, the compile included.",
        "",
        *_variant_table(
            doc,
            [r for r in COMPILE_ROWS if r in doc["models"][models[0]]["variants"]],  # (units: since its own row)
            lambda m: f"{m} ms | ×torch 25MB | {m} warm-up s",
            lambda row: f"{row['median_s'] * 1e3:.1f} | {row['ratio_to_torch']:.2f} | {row.get('warmup_s', 0):.1f}",
        ),
    ]
    rows = []
    for m in models:
        v = doc["models"][m]["variants"]
        pairs = list(zip(v["ours compiled"]["per_repeat_s"], v["torch compiled"]["per_repeat_s"]))
        ratio = v["ours compiled"]["median_s"] / v["torch compiled"]["median_s"]
        ahead = f" (ahead in {sum(a < b for a, b in pairs)} of {len(pairs)} repeats)"
        rows.append(
            (f"ours compiled level with PyTorch's DDP compiled, {m}", "≤ 1.02×", f"{ratio:.2f}×{ahead}", ratio <= 1.02)
        )
        for who, eager in (("ours", "ours 25MB"), ("torch", "torch 25MB")):
            gain = v[f"{who} compiled"]["median_s"] / v[eager]["median_s"]
            rows.append((f"{who}: compiled step ÷ eager step, {m}", "< 1.00× (compile pays)", f"{gain:.2f}×", gain < 1))
    return lines + [""] + claims_table(rows)


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
        ours, theirs = info["variants"]["ours 25MB"], info["variants"]["torch 25MB"]
        ratio = ours["ratio_to_torch"]
        # Repeats are interleaved, so repeat i of ours and of PyTorch's ran minutes apart at most: a fair pair.
        pairs = list(zip(ours.get("per_repeat_s", []), theirs.get("per_repeat_s", [])))
        ahead = f" (ahead in {sum(a < b for a, b in pairs)} of {len(pairs)} repeats)" if pairs else ""
        rows.append(
            (f"ours (25 MB buckets) ahead of PyTorch's DDP, {m}", "≤ 1.00×", f"{ratio:.2f}×{ahead}", ratio <= 1)
        )
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


def render_ddp_profile(doc: dict) -> list[str]:
    """bench/ddp_profile.py: each wrapper's step cut into phases, and one all-reduce alone per wire dtype."""
    phases = ("forward", "backward", "wait", "optimizer", "step")
    lines = [
        f"World size {doc['world_size']} (gloo, CPU), {doc['repeats']} interleaved repeats × {doc['steps']} steps; "
        f"ms = median over repeats of the slowest rank's median."
    ]
    for model, info in doc["models"].items():
        lines += [
            "",
            f"{model}: {info['parameter_tensors']} parameter tensors, {info['gradient_mib']} MiB of gradients, "
            f"per-rank batch {info['per_rank_batch']}.",
            "",
            "| variant | " + " | ".join(f"{p} ms" for p in phases) + " | step ×torch |",
            "|---|" + "---:|" * (len(phases) + 1),
        ]
        for name, row in info["variants"].items():
            cells = " | ".join(f"{row['median_s'][p] * 1e3:.1f}" for p in phases)
            ratio = row["step_ratio_to_torch"]
            lines.append(f"| {name} | {cells} | {'' if ratio is None else f'{ratio:.2f}'} |")
        alone = info.get("allreduce_alone")
        if alone:
            fp32 = alone["fp32"]["median_s"]
            cells = ", ".join(
                f"{n} {v['median_s'] * 1e3:.1f} ms ({v['median_s'] / fp32:.2f}× fp32)" for n, v in alone.items()
            )
            lines += [
                "",
                f"One all-reduce of its {info['gradient_mib']} MiB of gradients alone, nothing else running (gloo's "
                f"in each dtype; `exchange`: ours, what our compressed buckets use): {cells}.",
            ]
    return lines
