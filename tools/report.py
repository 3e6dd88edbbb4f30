"""Every measured figure of the docs, rendered from the committed results in bench/results/.

    make bench-report                       # rewrite the generated blocks of the docs
    .venv/bin/python -m tools.report --check  # exit 1 if the docs differ from the JSON (what the unit test checks)

Each results file ``bench/results/<name>.json`` that has a renderer in ``RENDERERS`` below owns one block of a page,
between ``<!-- bench-report:<name> -->`` and ``<!-- /bench-report:<name> -->``: a line saying where the numbers come
from (commit, date, machine, load; ``tools/provenance.py``), the table, and the documented claims with the measured
value and whether each held. A file may feed a second block on another page, ``<name>/<part>`` (the accumulation
bench's checks on docs/accumulation.md). Prose outside the blocks is written by hand and must not repeat a number:
``tests/unit/test_docs.py::test_no_measured_number_outside_generated_blocks`` fails when it does.

This module is the mechanism (find the blocks, render, rewrite or check); the renderers live by area in
``tools/renderers/`` (``ddp``, ``accum``, ``pipeline``, ``metrics``, ``cluster``, ``mutants``, ``sharding``,
``corpus``, ``startup``, ``training``, ``scaling``). They read the JSON alone and import no bench module (bench/
imports tools/, never the reverse: tests/unit/test_layout.py). A new one: a function ``doc -> lines`` (the
provenance line is added here) and one line in ``RENDERERS``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tools.renderers.accum import render_accum_checks, render_accum_curve
from tools.renderers.cluster import render_chaos, render_drills, render_heal_comparison, render_world_drift
from tools.renderers.common import claims_table  # noqa: F401 (re-exported: renderers elsewhere import it from here)
from tools.renderers.corpus import render_corpus_curve
from tools.renderers.ddp import render_ddp_bench, render_ddp_compile, render_ddp_profile
from tools.renderers.metrics import render_metrics_budget, render_metrics_overhead
from tools.renderers.mutants import render_mutants, render_mutation
from tools.renderers.pipeline import render_pipeline_bubble
from tools.renderers.scaling import render_block as render_scaling
from tools.renderers.sharding import render_memory, render_zero, render_zero_phases
from tools.renderers.startup import render_startup, render_startup_local
from tools.renderers.training import render_activation_checkpointing

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


RENDERERS = {
    "drills": render_drills,
    "drills/heal": render_heal_comparison,
    "chaos": render_chaos,
    "chaos-zero2": render_chaos,
    "world-drift": render_world_drift,
    "ddp-bench": render_ddp_bench,
    "ddp-profile": render_ddp_profile,
    "ddp-compile": render_ddp_compile,
    "accum-curve": render_accum_curve,
    "accum-curve/checks": render_accum_checks,
    "pipeline-bubble": render_pipeline_bubble,
    "metrics-overhead": render_metrics_overhead,
    "mutants": render_mutants,
    "mutation": render_mutation,
    "mutation-first": render_mutation,  # the first fresh-clone sample, before its survivors had their tests
    "mutation-heldout": render_mutation,  # a sample drawn after every file's selection gained its own tests
    "mutation-heldout-2": render_mutation,  # a second held-out sample, after the survivors of the first had tests
    "metrics-budget": render_metrics_budget,
    "scaling": render_scaling,
    "zero": render_zero,
    "zero-phases": render_zero_phases,
    "memory": render_memory,
    "corpus-curve": render_corpus_curve,
    "startup": render_startup,
    "startup-local": render_startup_local,
    "activation-checkpointing": render_activation_checkpointing,
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
