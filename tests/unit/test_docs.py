"""The docs stay true to the repository: every relative link lands, the README stays a front door, and the
configuration table is the one ``TrainConfig`` generates.

Links are read the way GitHub renders them: relative to the file, ``#anchor`` against the target's headings slugged
as GitHub slugs them (lower case, punctuation dropped, spaces to ``-``, ``-1``, ``-2`` for repeats). Code blocks
and inline code are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.config_table import config_table_markdown

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200
TABLE_BEGIN, TABLE_END = "<!-- config-table:begin -->", "<!-- config-table:end -->"

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def prose(text: str) -> str:
    """The Markdown without code blocks and inline code, where links and headings live."""
    return INLINE_CODE.sub("code", FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, each space a ``-``.

    Args:
        heading: the heading's Markdown text, without the leading ``#``.

    Example::

        >>> github_slug("Configuration: flag > environment > file > default")
        'configuration-flag--environment--file--default'
    """
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps only its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file offers: its headings' slugs (repeats numbered as GitHub does) and HTML anchors."""
    text = path.read_text(encoding="utf-8")
    seen: dict[str, int] = {}
    found = set(HTML_ANCHOR.findall(text))
    for heading in HEADING.findall(FENCE.sub("", text)):
        slug = github_slug(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The relative links of one Markdown file that do not resolve, each as ``target: why``.

    Args:
        path: the Markdown file.
        root: the repository; a link that leaves it is broken in a clone.

    Example::

        >>> broken_links(ROOT / "README.md")
        []
    """
    text = prose(path.read_text(encoding="utf-8"))
    problems = []
    for target in INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:: not ours to check offline
            continue
        where, _, anchor = target.partition("#")
        dest = (path.parent / where).resolve() if where else path
        if not dest.exists():
            problems.append(f"{target}: no such file {dest.relative_to(root) if dest.is_relative_to(root) else dest}")
        elif not dest.is_relative_to(root):
            problems.append(f"{target}: points outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(root)}")
        elif anchor and dest.suffix != ".md":
            lines = re.fullmatch(r"L(\d+)(?:-L(\d+))?", anchor)
            if not dest.is_file() or not lines or int(lines[2] or lines[1]) > len(dest.read_text().splitlines()):
                problems.append(f"{target}: #{anchor} is no line of {dest.relative_to(root)}")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == [], f"broken links in {path.relative_to(ROOT)}"


def test_the_link_check_catches_what_it_should(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Part one: `x`\n## Part one: `x`\n```\n# not a heading\n```\n")
    (tmp_path / "a.md").write_text(
        "[ok](b.md) [ok](b.md#part-one-x) [ok](b.md#part-one-x-1) [ok](#top) [web](https://example.com/none)\n"
        "`[in code](missing.md)`\n```\n[in a block](missing.md)\n```\n"
        "[gone](missing.md) [fenced heading](b.md#not-a-heading) [up](../outside.md)\n"
        '<a id="top"></a>\n'
    )
    (tmp_path.parent / "outside.md").write_text("# elsewhere\n")
    assert [p.split(":")[0] for p in broken_links(tmp_path / "a.md", root=tmp_path)] == [
        "missing.md",
        "b.md#not-a-heading",
        "../outside.md",
    ]


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move depth to docs/"


def test_readme_links_every_docs_page() -> None:
    linked = {
        (ROOT / t.partition("#")[0]).resolve() for t in INLINE_LINK.findall(prose((ROOT / "README.md").read_text()))
    }
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert missing == [], f"README.md does not link {missing}"


def code_map_tables(path: Path) -> list[tuple[str, list[str]]]:
    """Tables that map prose onto code: a header cell ``where in `some/file.py``` and, below it, the names it cites.

    Returns ``(file, names)`` per table, the names being every backticked identifier in that column.
    """
    found = []
    lines = FENCE.sub("", path.read_text(encoding="utf-8")).splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        column = next((k for k, c in enumerate(cells) if re.fullmatch(r"where in `[^`]+\.py`", c)), None)
        if column is None:
            continue
        names = []
        for row in lines[i + 2 :]:
            if not row.lstrip().startswith("|"):
                break
            cell = re.split(r"(?<!\\)\|", row.strip().strip("|"))[column]
            names += re.findall(r"`(\w+)(?:\(\))?`", cell)
        found.append((re.search(r"`([^`]+)`", cells[column])[1], names))
    return found


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_code_named_in_the_docs_exists(path: Path) -> None:
    for file, names in code_map_tables(path):
        source = (ROOT / file).read_text(encoding="utf-8")
        gone = [n for n in names if not re.search(rf"^\s*(?:def|class)\s+{n}\b", source, re.M)]
        assert gone == [], f"{path.relative_to(ROOT)} names {gone} in {file}, which defines no such function or class"


def documented_metrics() -> dict[str, str]:
    """``{name: type}`` from the tables of docs/metrics.md whose header starts ``| metric | type``."""
    lines = FENCE.sub("", (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")).splitlines()
    documented = {}
    for start in (i for i, line in enumerate(lines) if re.match(r"\|\s*metric\s*\|\s*type\s*\|", line)):
        for row in lines[start + 2 :]:
            if not row.startswith("|"):
                break
            names, kind = row.strip("|").split("|")[:2]
            documented.update((name, kind.split()[0]) for name in re.findall(r"`(ddp_\w+)`", names))
    return documented


def test_metrics_doc_matches_what_a_rank_exports() -> None:
    from prometheus_client import generate_latest

    from app.worker.metrics import TrainMetrics

    metrics = TrainMetrics(rank=0, local_rank=0, world_size=1, node="0", host="docs")
    exported = dict(re.findall(r"^# TYPE (ddp_\w+) (\w+)", generate_latest(metrics.registry).decode(), re.M))
    documented = documented_metrics()
    assert {n: k for n, k in exported.items() if documented.get(n) != k} == {}, (
        "docs/metrics.md's table lacks these metrics of app/worker/metrics.py, or gives another type"
    )
    # Metrics registered only in some modes (a pipeline stage, say) are not in a default registry: the source has them.
    source = (ROOT / "app" / "worker" / "metrics.py").read_text(encoding="utf-8")
    assert [n for n in documented if n.removesuffix("_total") not in source] == [], (
        "docs/metrics.md documents metrics app/worker/metrics.py does not define"
    )


def test_readme_results_are_the_benchmark_results() -> None:
    import json

    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| variant |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    models = [c.removesuffix(" ms") for c in header[1::2]]  # | variant | <model> ms | ×torch | <model> ms | ×torch |
    bench = json.loads((ROOT / "bench" / "results" / "ddp-bench.json").read_text())["models"]
    wrong = []
    for row in lines[start + 2 :]:
        if not row.startswith("|"):
            break
        cells = [c.strip() for c in row.strip("|").split("|")]
        variant = cells[0].strip("`")
        for k, model in enumerate(models):
            result = bench[model]["variants"][variant]
            want = [f"{result['median_s'] * 1e3:.1f}", f"{result['ratio_to_torch']:.2f}"]
            if cells[1 + 2 * k : 3 + 2 * k] != want:
                wrong.append(f"{variant} on {model}: README {cells[1 + 2 * k : 3 + 2 * k]}, JSON {want}")
    assert wrong == [], "README.md's results table differs from bench/results/ddp-bench.json: copy the JSON's values"


def test_config_table_is_generated_from_train_config() -> None:
    text = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    assert TABLE_BEGIN in text and TABLE_END in text, f"docs/training.md lost its {TABLE_BEGIN} / {TABLE_END} markers"
    table = text[text.index(TABLE_BEGIN) + len(TABLE_BEGIN) : text.index(TABLE_END)]
    assert table.strip() == config_table_markdown().strip(), (
        "docs/training.md's configuration table differs from app.worker.config.TrainConfig: run `make docs-config`"
    )
