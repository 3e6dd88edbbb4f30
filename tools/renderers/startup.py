"""The start-up block of docs/cluster.md: `docker compose up --scale worker=4` -> first step, phase by phase
(``startup.json``, ``python -m bench.startup``)."""

from __future__ import annotations

from tools.renderers.common import claims_table

TARGET_S = 20.0  # issue 25: four workers from `up` to the first step on a quiet machine
KEEP_S = 1.0  # issue 35: a start-up trick is kept only if it saves more than this
TRICKS = {"exec_trainer": "the trainer forked (LAUNCH_FORK)", "eager_dynamo": "torch._dynamo deferred"}


def _cell(x, fmt: str = ".2f") -> str:
    return "—" if x is None else format(x, fmt)


def phase_names(summary: dict) -> list[str]:
    """Every phase any variant measured, in the order they happen."""
    names: list[str] = []
    for s in summary.values():
        names += [n for n in s["phases"] if n not in names]
    return names


def render_startup(doc: dict) -> list[str]:
    variants = list(doc["summary"])
    summary = doc["summary"]
    lines = [
        "| phase (s, median) | " + " | ".join(f"`{v}`" for v in variants) + " |",
        "|---|" + "---:|" * len(variants),
    ]
    for phase in phase_names(summary):
        lines.append(f"| {phase} | " + " | ".join(_cell(summary[v]["phases"].get(phase)) for v in variants) + " |")
    lines.append(
        "| **up → first step** | "
        + " | ".join(
            f"**{_cell(summary[v]['total_s'], '.1f')}** "
            f"({_cell(summary[v]['total_min_s'], '.1f')}–{_cell(summary[v]['total_max_s'], '.1f')})"
            for v in variants
        )
        + " |"
    )
    lines.append(
        "| (the store listening, from up; beside the path) | "
        + " | ".join(_cell(summary[v]["store_listening_s"]) for v in variants)
        + " |"
    )
    if any(v < -1 for r in doc["runs"] for v in r.get("phases", {}).values()):
        lines += [
            "",
            "A negative phase: a container restarted during the start-up (`restart: on-failure`); Docker's start "
            "time is its last start, its log lines are its first attempt's, so the phases around it overlap. The "
            "total (`up` → rank 0's first step) stands.",
        ]
    failed = [r for r in doc["runs"] if "failed" in r]
    why = "; ".join(sorted({f"{r['variant']}: {r['failed']}" for r in failed}))
    lines += ["", "Variants: " + "; ".join(f"`{v}`: {what}" for v, what in doc["variants"].items()) + "."]
    lines += [
        f"{doc['workers']} workers, {doc['repeats']} interleaved repeats of each variant, "
        f"{doc['settings']['steps']} steps per run; "
        + (
            f"{len(failed)} runs did not finish ({why})"
            if failed
            else "every worker of every run exited 0"
            if all(set(r["exit_codes"]) == {0} for r in doc["runs"])
            else "some worker exited non-zero"
        )
        + ".",
        "",
    ]
    rows = []
    before, now = (summary.get(v, {}).get("total_s") for v in ("before", "now"))
    if before and now:
        # Decided on three finished runs of each at least: one or two against a machine's load say little.
        enough = all(summary[v]["repeats"] >= 3 for v in ("before", "now"))
        finished = f" ({summary['before']['repeats']} and {summary['now']['repeats']} runs finished)"
        rows.append(
            (
                "the fixes shorten the start",
                "now ÷ before < 1",
                f"{now / before:.2f}{finished}",
                (now < before) if enough else None,
            )
        )
    last = summary[variants[-1]]["total_s"]
    load = doc["machine"].get("load_average_before") or [0.0]
    quiet = load[0] < 1.5  # a "quiet machine": less than one core's worth of other work on 2 cores
    rows += trick_rows(summary, "now", "total_s", quiet)
    held = None if last is None else (last <= TARGET_S) if quiet or last <= TARGET_S else None
    rows.append(
        (
            f"`up` → first step ≤ {TARGET_S:g} s, {doc['workers']} workers, quiet machine",
            f"≤ {TARGET_S:g} s",
            f"{_cell(last, '.1f')} s (`{variants[-1]}`)",
            held,
        )
    )
    out = lines + claims_table(rows)
    if any(r[3] is None for r in rows):
        out += [
            "",
            f"`?`: not decided: fewer than three finished runs of a variant, or a machine that was not quiet (load "
            f"{load[0]:.1f} on its cores before the run).",
        ]
    return out


def trick_rows(summary: dict, base: str, key: str, quiet: bool) -> list[tuple[str, str, str, bool | None]]:
    """A claim per trick measured off on its own: its variant's median minus ``base``'s exceeds ``KEEP_S``; decided
    on a quiet machine and three finished runs of each (a loaded one's seconds swamp the saving)."""
    rows = []
    for variant, trick in TRICKS.items():
        off, on = summary.get(variant, {}).get(key), summary.get(base, {}).get(key)
        if off is not None and on is not None:
            enough = quiet and summary[variant]["repeats"] >= 3 and summary[base]["repeats"] >= 3
            held = (off - on > KEEP_S) if enough else None
            rows.append((f"{trick} saves more than {KEEP_S:g} s", f"`{variant}` − `{base}` > {KEEP_S:g} s",
                         f"{off - on:.1f} s", held))  # fmt: skip
    return rows


def render_startup_local(doc: dict) -> list[str]:
    """The local-world block of docs/development.md (``startup-local.json``, ``python -m bench.local_startup``)."""
    s = doc["summary"]
    lines = ["| variant | median (s) | min–max (s) | saving of the trick (s) |", "|---|---:|---:|---:|"]
    for v in doc["variants"]:
        saving = f"{s['saving_s'][v]:+.2f}" if v in s["saving_s"] else "—"
        lines.append(f"| `{v}` | {s['median_s'][v]:.2f} | {s['min_s'][v]:.2f}–{s['max_s'][v]:.2f} | {saving} |")
    lines += [
        "",
        "Variants: " + "; ".join(f"`{v}`: {what}" for v, what in doc["variants"].items()) + ".",
        f"{doc['ranks']} ranks per world, {doc['repeats']} interleaved repeats of each variant, timed from "
        f"`spawn_world` to every rank's return after one AdamW step; the templates' own start (once per process) "
        f"took {doc['template_start_s']:.1f} s before them.",
        "",
    ]
    load = doc["machine"].get("load_average_before") or [0.0]
    decided = doc["repeats"] >= 3 and load[0] < 1.5  # as the compose block: three runs each, a quiet machine
    rows = []
    for v, trick in (
        ("exec", "the rank forked from a template (LAUNCH_FORK)"),
        ("eager_dynamo", "torch._dynamo deferred"),
    ):
        saving = s["saving_s"].get(v)
        if saving is not None:
            rows.append((f"{trick} saves more than {KEEP_S:g} s", f"`{v}` − `fork` > {KEEP_S:g} s",
                         f"{saving:.2f} s", saving > KEEP_S if decided else None))  # fmt: skip
    out = lines + claims_table(rows)
    if not decided:
        out += ["", f"`?`: not decided: fewer than three runs of each, or a machine that was not quiet (load "
                    f"{load[0]:.1f} on its cores before the run)."]  # fmt: skip
    return out
