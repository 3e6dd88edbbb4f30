"""The metrics' blocks: what ``/metrics`` costs a step (``metrics-overhead.json``, ``python -m bench.metrics_overhead``)
and how many series a job exports (``metrics-budget.json``, ``python -m bench.metrics_budget``)."""

from __future__ import annotations

from tools.renderers.common import claims_table


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


def render_metrics_budget(doc: dict) -> list[str]:
    t, ranks = doc["totals"], doc["ranks"]
    lines = [
        f"| metric family | type | series per rank | at {ranks:,} ranks |",
        "|---|---|---:|---:|",
    ]
    for name, f in sorted(doc["families"].items(), key=lambda kv: (-kv[1]["series"], kv[0])):
        only = " (pipeline only)" if f["pipeline_only"] else ""
        lines.append(f"| `{name}`{only} | {f['type']} | {f['series']} | {f['series'] * ranks:,} |")
    lines += [
        f"| **a data-parallel rank, with Prometheus' own per-target series** | | **{t['per_rank']}** | "
        f"**{t['job']:,}** |",
        f"| a pipeline rank | | {t['per_rank_pipeline']} | {t['job_pipeline']:,} |",
        "",
        f"Histogram buckets are {t['histogram_share']:.0%} of the series; at a {doc['scrape_interval_s']:g} s scrape "
        f"the job ingests {t['samples_per_second']:,.0f} samples/s. The recording rules add {t['recording']:,} "
        "series and spare each dashboard query the raw ones:",
        "",
        "| recording rule | series it writes | raw series a panel reads without it |",
        "|---|---:|---:|",
    ]
    for r in doc["recording"]:
        lines.append(f"| `{r['record']}` | {r['writes_series']:,} | {r['raw_series_read_without_it']:,} |")
    return lines
