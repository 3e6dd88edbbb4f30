"""The scaling block of docs/scaling.md (``scaling.json``, ``make scaling``): the fitted alpha and beta of each
gloo collective, every measured point against the model, the same between containers, the DDP step check, the
predictions to 1024 ranks and the pipeline bubble with its send/recv term."""

from __future__ import annotations

import numpy as np


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g}" if s < 1 else f"{s * 1e3:.0f}"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def render_fit(doc: dict) -> list[str]:
    lines = [
        "| fitted on | collective | alpha (µs) | beta = busbw (MB/s) | points | within 15% | median \\|error\\| "
        "| max \\|error\\| | median noise |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    groups = [("ring", doc["fit"]["ring"]), *doc["fit"]["oversubscribed"].items()]
    for group, fits in groups:
        label = "n ≤ cores (ring)" if group == "ring" else f"n = {group} alone"
        for name, f in fits.items():
            mine = [p for p in doc["collectives"] if p["collective"] == name and p["fit"] == group]
            errs = [abs(p["error"]) for p in mine]
            noise = np.median([p["spread"] for p in mine])
            lines.append(
                f"| {label} | {name} | {f['alpha_s'] * 1e6:.0f} | {f['beta_bytes_per_s'] / 1e6:.0f} | {len(errs)} "
                f"| {sum(e <= 0.15 for e in errs)} | {np.median(errs):.0%} | {max(errs):.0%} | {noise:.0%} |"
            )
    lines += ["", "Noise: the interquartile range of a point's rounds divided by its median, median over points."]
    worlds = sorted({p["world_size"] for p in doc["collectives"]})
    lines += ["", "Every point: measured ms (model's error), per world size.", ""]
    lines += [
        "| collective | size | " + " | ".join(f"n={n}" for n in worlds) + " |",
        "|---|---:|" + "---:|" * len(worlds),
    ]
    index = {(p["collective"], p["bytes"], p["world_size"]): p for p in doc["collectives"]}
    for name in doc["fit"]["ring"]:
        for nbytes in sorted({p["bytes"] for p in doc["collectives"]}):
            cells = [index.get((name, nbytes, n)) for n in worlds]
            text = [f"{_ms(c['measured_s'])} ({c['error']:+.0%})" if c else "—" for c in cells]
            lines.append(f"| {name} | {_size(nbytes)} | " + " | ".join(text) + " |")
    lines += ["", summary_line("Points", doc["summary"]["collectives"])]
    return lines


def summary_line(what: str, s: dict) -> str:
    return (
        f"{what} within ±15%: {s['within_15pct']} of {s['points']}; mean |error| {s['mean_abs_error']:.0%}, worst "
        f"{s['max_abs_error']:.0%}."
    )


def render_check(doc: dict) -> list[str]:
    lines = [
        "| model | n | per-rank batch | compute ms | + reducer ms | + sync ms | + all-reduces ms | model, no overlap "
        "| measured step ms | model, overlap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["ddp_check"]:
        lines.append(
            f"| {r['model']} | {r['world_size']} | {r['per_rank_batch']} | {_ms(r['compute_s'])} | "
            f"{_ms(r['reducer_s'])} | {_ms(r['sync_s'])} | {_ms(r['comm_s'])} | "
            f"{_ms(r['predicted_step_s'])} ({r['error']:+.0%}) | {_ms(r['measured_step_s'])} | "
            f"{_ms(r['predicted_step_overlap_s'])} ({r['error_overlap']:+.0%}) |"
        )
    summary = doc["summary"]
    lines += ["", summary_line("Steps, model without overlap,", summary["ddp_check"])]
    lines += [summary_line("Steps, model with overlap,", summary["ddp_check_overlap"])]
    return lines


def render_predictions(doc: dict) -> list[str]:
    lines = [
        "| model | ranks | per-rank batch | gloo step ms | gloo comm share | gloo overlapped | NCCL step ms "
        "| NCCL comm share | NCCL overlapped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["predictions"]:
        g, c = r["gloo"], r["nccl"]
        lines.append(
            f"| {r['model']} | {r['ranks']} | {r['per_rank_batch']:g} | {_ms(g['step_s'])} | {g['share']:.0%} | "
            f"{_ms(g['step_overlap_s'])} ({g['share_overlap']:.0%}) | {_ms(c['step_s'])} | {c['share']:.0%} | "
            f"{_ms(c['step_overlap_s'])} ({c['share_overlap']:.0%}) |"
        )
    return lines


def render_bubble(doc: dict) -> list[str]:
    lines = [
        "| schedule | S | M | (S−1)/(M+S−1) | + send/recv term | measured (emulated) | formula's error "
        "| model's error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["bubble"]["rows"]:
        lines.append(
            f"| {r['schedule']} | {r['stages']} | {r['micro_batches']} | {r['formula']:.3f} | {r['with_comm']:.3f} | "
            f"{r['measured']:.3f} | {r['formula_error']:+.0%} | {r['error']:+.0%} |"
        )
    lines += ["", "Errors relative to the measured idle share (model / measured − 1)."]
    lines += ["", summary_line("Rows, formula alone,", doc["bubble"]["formula_errors"])]
    lines += [summary_line("Rows, formula + send/recv term,", doc["bubble"]["errors"])]
    return lines


def render_containers(containers: dict) -> list[str]:
    if "skipped" in containers:
        return [f"Not measured in this run: {containers['skipped']}."]
    return render_fit(containers)


def render_settings(settings: dict) -> str:
    """What was measured, from the run's own settings: a rerun with other flags shows its own on the page."""
    sizes = settings["sizes"]
    rounds = f"{settings['repeats']} rounds a point ({settings['small_repeats']} for the small sizes)"
    return (
        f"Collectives at {_size(min(sizes))} to {_size(max(sizes))} ({len(sizes)} sizes), {rounds}, in worlds of "
        f"{', '.join(map(str, settings['worlds']))} processes; DDP steps: {settings['steps']} timed per model and "
        f"world, global batch {settings['check_batch']}."
    )


def render_block(doc: dict) -> list[str]:
    """The generated block of docs/scaling.md, less its provenance line (``tools/report.py`` adds that): the load, the
    settings, then every table. Registered as ``scaling`` in ``tools.report.RENDERERS``."""
    m = doc["machine"]
    nccl = doc["nccl_assumption"]
    return [
        f"Load average while measuring: {m['load_average_before']} before, {m['load_average_after']} after (1, 5, "
        f"15 min) on {m['cores']} cores: other jobs shared the machine, so every figure below is noisy.",
        "",
        render_settings(doc["settings"]),
        "",
        "### Fitted alpha and beta (gloo, CPU, one host, processes)",
        "",
        *render_fit(doc),
        "",
        "### The same collectives between containers (Docker, one user-defined bridge network)",
        "",
        *render_containers(doc.get("containers") or {"skipped": "not run"}),
        "",
        "### Check: DDP step time at the measured world sizes",
        "",
        *render_check(doc),
        "",
        f"### Predictions (global batch {doc['settings']['global_batch']}, compute = this CPU's, see above)",
        "",
        f"NCCL, assumed (not measured): alpha = {nccl['alpha_s'] * 1e6:g} µs, busbw = "
        f"{nccl['beta_bytes_per_s'] / 1e9:g} GB/s ({nccl['source']}).",
        "",
        *render_predictions(doc),
        "",
        "### Pipeline bubble with the send/recv term",
        "",
        *render_bubble(doc),
    ]
