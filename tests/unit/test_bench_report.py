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
    assert re.fullmatch(r"[0-9a-f]{40}", doc.get("commit", "")), f"{path.name}: no commit (bench/provenance.py)"
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
