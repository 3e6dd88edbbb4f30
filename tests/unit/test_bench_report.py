"""The benchmark numbers in the docs are the committed results, and every result says which code made it.

.venv/bin/python -m pytest tests/unit/test_bench_report.py   # after a bench rerun: make bench-report
"""

from __future__ import annotations

import json
import re

import pytest

from tools.report import DOCS, RENDERERS, RESULTS, block_pattern, rendered_page

RESULT_FILES = sorted(RESULTS.glob("*.json"))


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_every_committed_result_names_its_commit_settings_and_machine(path):
    doc = json.loads(path.read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", doc.get("commit", "")), f"{path.name}: no commit (tools/provenance.py)"
    assert isinstance(doc.get("dirty"), bool), path.name
    assert doc.get("settings") and doc.get("date"), path.name
    machine = doc.get("machine", {})
    assert machine.get("cores") and machine.get("load_average_before") and machine.get("load_average_after"), path


def test_every_result_with_a_renderer_has_its_block_in_the_docs():
    pages = [doc.read_text() for doc in DOCS]
    names = [p.stem for p in RESULT_FILES if p.stem in RENDERERS]
    assert names, "no results to render"
    missing = [n for n in names if not any(block_pattern(n).search(page) for page in pages)]
    assert not missing, f"no docs page has a generated block for {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_block_on_a_page_has_a_renderer(doc):
    """A block no renderer owns would never be checked: its numbers could go stale unseen."""
    names = re.findall(r"<!-- bench-report:([\w/-]+) -->", doc.read_text())
    assert [n for n in names if n not in RENDERERS] == [], f"{doc.name}: blocks without a renderer in tools/report.py"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_the_docs_tables_are_the_rendering_of_the_committed_results(doc):
    page = doc.read_text()
    assert rendered_page(page) == page, f"{doc.name} differs from bench/results/: run `make bench-report`"


def test_a_changed_result_changes_the_page(tmp_path):
    """The check above can fail: a number edited in a result shows up as a different page."""
    for p in RESULT_FILES:
        (tmp_path / p.name).write_text(p.read_text())
    for name in [p.stem for p in RESULT_FILES if p.stem in RENDERERS]:
        doc = json.loads((tmp_path / f"{name}.json").read_text())
        doc["commit"] = "0" * 40
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    pages = [doc.read_text() for doc in DOCS]
    assert any(rendered_page(page, tmp_path) != page for page in pages)


@pytest.mark.parametrize("name", [n for n in RENDERERS if (RESULTS / f"{n.partition('/')[0]}.json").exists()])
def test_each_block_changes_with_its_own_result(name, tmp_path):
    """Every registered block is really rendered from its file: a new commit in that file alone changes its page."""
    stem = name.partition("/")[0]
    for p in RESULT_FILES:
        (tmp_path / p.name).write_text(p.read_text())
    doc = json.loads((tmp_path / f"{stem}.json").read_text())
    doc["commit"] = "0" * 40
    (tmp_path / f"{stem}.json").write_text(json.dumps(doc))
    pages = [d.read_text() for d in DOCS if block_pattern(name).search(d.read_text())]
    assert pages, f"no page has a block for {name}"
    assert all(rendered_page(page, tmp_path) != page for page in pages), name


def zero_claims(doc: dict) -> dict[str, str]:
    """The zero block's claims table as ``{claim: held}``."""
    rows = [line.split(" | ") for line in RENDERERS["zero"](doc) if line.startswith("| N = ")]
    return {cells[0].removeprefix("| "): cells[-1].removesuffix(" |") for cells in rows}


@pytest.mark.parametrize(
    ("factors", "held"), [([2.0] * 5, "no"), ([1.0] * 5, "yes"), ([1.0, 1.0, 3.0, 1.0, 1.0], "?")], ids=str
)
def test_the_stage_2_step_time_verdict_follows_every_repeat(factors, held):
    """Stage 2 above 1.15x DDP in every repeat is a miss, within it in every repeat held, both: inconclusive."""
    doc = json.loads((RESULTS / "zero.json").read_text())
    for rows in doc["results"].values():
        ddp = rows["ddp"]["step_seconds_per_repeat"]
        rows["zero2"]["step_seconds_per_repeat"] = [t * f for t, f in zip(ddp, factors)]
    claims = {k: v for k, v in zero_claims(doc).items() if "stage 2 step time" in k}
    assert len(claims) == len(doc["results"]) and set(claims.values()) == {held}, claims
