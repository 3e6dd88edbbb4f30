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
    """Tables that map prose onto code: a header cell ``where in `some/file.py``` (or a folder, ``where in
    `app/parallel/```: code that moves between the files of a folder keeps its table true) and, below it, the names
    it cites.

    Returns ``(file, names)`` per table, the names being every backticked identifier in that column.
    """
    found = []
    lines = FENCE.sub("", path.read_text(encoding="utf-8")).splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        column = next((k for k, c in enumerate(cells) if re.fullmatch(r"where in `[^`]+(?:\.py|/)`", c)), None)
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
        files = sorted((ROOT / file).glob("*.py")) if file.endswith("/") else [ROOT / file]
        source = "\n".join(f.read_text(encoding="utf-8") for f in files)
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


# A measured figure on a page must come from a results file, through a generated block (tools/report.py), so that
# rerunning a bench can never leave a stale number behind. What looks like a measurement: a number with a unit of
# time, size or rate, a ratio (1.04×), a percentage, a float gap written as x.ye-N. Code blocks are commands and
# labelled sample output; the config table is generated from TrainConfig.
GENERATED_BLOCK = re.compile(r"<!-- bench-report:([\w/-]+) -->\n.*?<!-- /bench-report:\1 -->", re.S)
CONFIG_TABLE = re.compile(re.escape(TABLE_BEGIN) + ".*?" + re.escape(TABLE_END), re.S)
_NUMBER = r"\d+(?:\.\d+)?"
_UNIT = r"ms|µs|s|min|minutes?|seconds?|hours?|KiB|MiB|GiB|KB|MB|GB|GB/s|MB/s|%"
MEASUREMENT = re.compile(
    rf"(?<![\w.]){_NUMBER}\s?(?:{_UNIT}|[×x])(?!\w)"  # 85.1 ms, 57.7 MiB, 64%, 1.04×
    r"|(?<![\w.])\d+\.\d+e-\d+"  # 2.98e-08 (a bar is written 1e-5)
    r"|(?<=\| )\d+\.\d+(?= \|)"  # a table cell that is a bare decimal: a hand-copied results table
)
# Numbers that look like measurements but are settings, sizes fixed by configuration or formula constants. Each
# entry: a pattern the figure and its context must match, and why it is not a measurement.
ALLOWED_FIGURES = [
    (r"(?i)\b25\s?MB\b|\b25 MiB\b|\b1 ?MiB\b|\b1MB\b", "DDP bucket caps (25 MB, 1 MB, the first bucket's 1 MiB)"),
    (r"24 MiB|6 MiB|1\.2 MiB|[258] KiB|64 MiB|2 GiB", "model, buffer and volume sizes: fixed by the code"),
    (
        r"(?i)(?:timeout|times? out|_seconds|grace|linger|keep-alive|health check|wait)\W[^.;|]{0,50}?\d+ (?:s|min)\b"
        r"|\d+ s\b[^.;|]{0,25}(?:timeout|_SECONDS|linger|grace)",
        "a timeout or wait named beside its value: settings",
    ),
    (r"^\| `DDP\w+` \|.*$", "alert thresholds: the rules' settings (docker/prometheus/alerts.yml)"),
    (r"95% confidence|(?:≤|at or below|at most) 2%", "the metrics bench's confidence level and target: settings"),
    (r"40 ms forward", "the emulated pipeline stage's wait: a setting of bench.pipeline_bubble"),
    (r"\d+ × (?:Linear|\d+ tokens|\d+ CPU|8\))|\d+×\d+ vs \d+×\d+|ranks × \d+", "shapes and splits, not ratios"),
    (r"\b[×x]torch\b|2\(n ?− ?1\)/n", "a column name and a formula"),
    (r"--timeout=\d+m\b", "kubectl wait timeouts: settings"),
    (
        r"^\| `(?:no sync|ours 25MB|torch 25MB|lesson loop)` \|.*$",
        "README's results: test_readme_results_... checks them",
    ),
    (r"±15%", "the scaling fit's goal per point: a target (bench/scaling.py), what the block's counts are judged by"),
    (r"below 4 MiB", "bench/scaling.py's SMALL: the size under which a point gets --small-repeats rounds, a setting"),
]


def measured_figures(text: str) -> list[str]:
    """The measurement-like numbers of a page outside generated blocks, code blocks and the allow-list."""
    text = FENCE.sub("", CONFIG_TABLE.sub("", GENERATED_BLOCK.sub("", text)))
    found = []
    for line in text.splitlines():
        allowed = [m.span() for pattern, _ in ALLOWED_FIGURES for m in re.finditer(pattern, line, re.M)]
        for m in MEASUREMENT.finditer(line):
            if not any(a <= m.start() and m.end() <= b for a, b in allowed):
                found.append(f"{m[0]!r} in: {line.strip()[:100]}")
    return found


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_measured_number_outside_generated_blocks(path: Path) -> None:
    found = measured_figures(path.read_text(encoding="utf-8"))
    assert found == [], (
        f"{path.relative_to(ROOT)} states measured figures by hand: render them from bench/results/ through a "
        "tools/report.py block, or delete them (a setting belongs in ALLOWED_FIGURES, with why)\n" + "\n".join(found)
    )


def test_the_figure_check_catches_what_it_should() -> None:
    page = (
        "Ours is 1.04× PyTorch's, 85.1 ms a step, 57.7 MiB, 64% of the step, max |dp| 2.98e-08.\n"
        "<!-- bench-report:x -->\n| ours | 85.1 ms |\n<!-- /bench-report:x -->\n"
        "```\nstep 1 | 12.3 ms\n```\n"
        "Buckets of 25 MB; the bar is 1e-5; a collective times out after 30 s.\n"
        "| S | M | GPipe |\n|---:|---:|---:|\n| 2 | 8 | 0.45 |\n"
    )
    found = [f.split("'")[1] for f in measured_figures(page)]
    assert found == ["1.04×", "85.1 ms", "57.7 MiB", "64%", "2.98e-08", "0.45"]


DOC_IMPORT = re.compile(r"^\s*from (app(?:\.\w+)*) import \(?([\w, ]+(?:as \w+)?)", re.M)
DOC_MODULE = re.compile(r"(?:python -m |import )(app(?:\.\w+)+)")


def doc_imports() -> set[tuple[str, str]]:
    """Every ``from app... import name`` and ``python -m app...`` / ``import app...`` the docs show a user."""
    found = set()
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for module, names in DOC_IMPORT.findall(text):
            found |= {(module, n.split(" as ")[0].strip()) for n in names.split(",") if n.strip()}
        found |= {(module, "") for module in DOC_MODULE.findall(text)}
    return found


def test_the_docs_show_public_imports():
    shown = doc_imports()
    assert ("app.parallel.ddp", "DistributedDataParallel") in shown and ("app.parallel", "wrap_model") in shown


@pytest.mark.parametrize("module,name", sorted(doc_imports()), ids=lambda v: v or "module")
def test_every_import_the_docs_show_works(module, name):
    """A moved or renamed module must keep the names the docs teach (the drop-in's one-line import included)."""
    import importlib

    imported = importlib.import_module(module)
    assert not name or hasattr(imported, name), f"the docs import {name} from {module}, which has no such name"


@pytest.mark.parametrize(
    "name",
    [
        "wrap_model",
        "DistributedDataParallel",
        "ZeroRedundancyOptimizer",
        "ShardedGradDataParallel",
        "FullyShardedDataParallel",
        "save_sharded",
        "load_sharded",
        "CheckpointError",
    ],
)
def test_the_wrappers_import_from_app_parallel(name):
    import app.parallel

    assert getattr(app.parallel, name).__name__ == name
