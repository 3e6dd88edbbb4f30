"""The mutation blocks of docs/development.md: the generated sample (``bench/results/mutation.json``, ``make mutants``)
and the curated list (``bench/results/mutants.json``, ``make mutants-curated``)."""

from __future__ import annotations

CURATED_TARGET = 0.9  # issue 38: each list kills at least this share of its non-equivalent mutants


def render_mutants(doc: dict) -> list[str]:
    """The curated list of ``make mutants-curated`` (tools/mutants.py): every entry is a bug by construction (no
    equivalents), so the kill rate is caught / total, stale and erroring entries counted as not caught."""
    rate = doc["caught"] / doc["total"] if doc["total"] else 0.0
    held = "held" if rate >= CURATED_TARGET else "not held"
    lines = [
        f"Score: **{doc['caught']}/{doc['total']} caught** (**{rate:.0%}**; target {CURATED_TARGET:.0%}: {held}).",
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
    if held == "held" and doc["not_run"].get("not run (budget)"):  # a part of the sample says nothing of the rest
        held = f"not shown, only {doc['ran']} of the {doc['sample']} drawn ran"
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
        + (f" Never run per mutant: {doc['not_selected']}." if doc.get("not_selected") else "")
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
