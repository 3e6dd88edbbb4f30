"""The mutation score's block of docs/development.md (``bench/results/mutants.json``, ``make mutants``)."""

from __future__ import annotations


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
