"""The generated-mutant tool's own logic: the seeded sample, the test selection per file, the stable ids the triage
is keyed by, and the score (tools/mutation.py, tools/mutation_gen.py). Runs no mutant.

.venv/bin/python -m pytest tests/unit/test_mutation.py
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.mutants import MUTANTS, REPO
from tools.mutation import load_triage, pytest_cmd, score
from tools.mutation_gen import (
    AREAS,
    SLOW,
    Candidate,
    alert_candidates,
    apply_alert,
    change_key,
    draw,
    expand,
    selection_for,
    stable_id,
)

RULES = """groups:
  - name: g
    rules:
      - alert: A
        expr: up == 0
        for: 20s
      - alert: B
        expr: |
          count(x) < max(y[10m])
            unless on() z >= 3
"""


def candidates(n_sites: int, variants: int = 3) -> list[Candidate]:
    return [
        Candidate(f"id{s}-{v}", "app/worker/x.py", s, f"op{v}", "f", "x", site=f"site{s}")
        for s in range(n_sites)
        for v in range(variants)
    ]


def test_a_seed_draws_the_same_sample_whatever_the_input_order_and_another_seed_another():
    pool = candidates(200)
    first = [c.id for c in draw(pool, 50, seed=7)]
    assert first == [c.id for c in draw(list(reversed(pool)), 50, seed=7)]
    assert first != [c.id for c in draw(pool, 50, seed=8)]


def test_the_sample_takes_one_variant_per_site_and_at_most_every_site():
    sample = draw(candidates(40, variants=10), 30, seed=1)
    assert len(sample) == 30 and len({c.site for c in sample}) == 30
    assert len(draw(candidates(5), 30, seed=1)) == 5


@pytest.mark.parametrize(
    "path, test",
    [
        ("app/worker/config.py", "tests/unit/test_config*.py"),
        ("app/worker/config/fields.py", "tests/unit/test_config*.py"),  # config.py turned into a package
        ("app/worker/steps/ddp.py", "tests/integration/test_train.py"),  # split out of the trainer
        ("app/parallel/ddp/reducer.py", "tests/integration/test_ddp.py"),  # split out of ddp.py
        ("app/parallel/accum.py", "tests/integration/test_accum*.py"),
        (
            "app/parallel/probes.py",
            "tests/integration/test_metrics*.py::test_our_ddp_bus_bandwidth_uses_the_wrappers_comm_span",
        ),
        ("app/cluster/k8s_launch.py", "tests/unit/test_k8s_launch*.py"),
        ("app/parallel/zero/stage3.py", "tests/integration/test_fsdp*.py"),  # not DDP's tests: they never import it
        ("app/parallel/zero/stage2.py", "tests/integration/test_zero.py"),
        ("app/worker/data_files.py", "tests/unit/test_data_files*.py"),
        ("docker/prometheus/alerts.yml", "promtool test rules docker/prometheus/alerts.test.yml"),
    ],
)
def test_each_file_runs_the_tests_of_its_folder_and_name(path, test):
    assert test in selection_for(path)


def test_each_mutant_stops_at_its_first_failure_and_a_hung_test_fails_within_the_test_timeout(tmp_path):
    cmd = pytest_cmd(["tests/unit/test_x.py"], test_timeout=90)
    assert "-x" in cmd and cmd[cmd.index("--timeout") + 1] == "90" and cmd[-1] == "tests/unit/test_x.py"
    assert "--timeout" not in pytest_cmd(["tests/unit/test_x.py"], test_timeout=0)
    # A test's own, longer timeout marker is capped too (pytest-timeout alone lets the marker win).
    (tmp_path / "test_hangs.py").write_text(
        "import time, pytest\n\n@pytest.mark.timeout(600)\ndef test_hangs():\n    time.sleep(30)\n"
    )
    started = time.monotonic()
    out = subprocess.run(
        pytest_cmd(["test_hangs.py"], test_timeout=1),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "Timeout" in out.stdout, out.stdout[-2000:]
    assert time.monotonic() - started < 25


def test_a_file_without_a_rule_is_named_and_globs_that_match_nothing_are_dropped(tmp_path):
    with pytest.raises(KeyError, match="README.md"):
        selection_for("README.md")
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_config.py").write_text("")
    assert expand(("tests/unit/test_config*.py", "tests/unit/test_gone*.py"), tmp_path) == ["tests/unit/test_config.py"]
    assert expand(("tests/unit/test_config.py::test_b", "tests/unit/gone.py::test_c"), tmp_path) == [
        "tests/unit/test_config.py::test_b"
    ], "a test id names an existing file: kept (the kills' recheck runs test ids)"
    assert expand(("tests/unit/test_conf*.py::test_a", "-k", "not slow"), tmp_path) == [
        "tests/unit/test_config.py::test_a",
        "-k",
        "not slow",
    ]


def test_alert_mutants_change_one_expression_or_duration_and_keep_their_ids_when_lines_move(tmp_path):
    rules = tmp_path / "docker" / "alerts.yml"
    rules.parent.mkdir()
    rules.write_text(RULES)
    before = alert_candidates(tmp_path, "docker/alerts.yml", {})
    ops = {c.operator for c in before}
    assert {"alerts/cmp ==->!=", "alerts/for 20s->40s", "alerts/range [10m]->[5m]", "alerts/setop unless->and"} <= ops
    c = next(c for c in before if c.operator == "alerts/cmp <->>")
    assert "count(x) > max(y[10m])" in apply_alert(c, RULES)
    rules.write_text(RULES.replace("rules:\n", "rules:\n      # a comment that moves every line down\n"))
    after = alert_candidates(tmp_path, "docker/alerts.yml", {})
    assert [c.id for c in after] == [c.id for c in before] and after[0].line == before[0].line + 1


def test_python_mutants_keep_their_ids_when_code_moves_to_another_file_of_the_area(tmp_path):
    pytest.importorskip("cosmic_ray")
    from tools.mutation_gen import apply_python, python_candidates

    code = "from __future__ import annotations\n\n\ndef f(a: int | None, b):\n    return a < b\n"
    (tmp_path / "app" / "parallel" / "ddp").mkdir(parents=True)
    (tmp_path / "app/parallel/ddp/module.py").write_text(code)
    (tmp_path / "app/parallel/ddp/reducer.py").write_text("# moved here\n\n" + code)
    one = python_candidates(tmp_path, "app/parallel/ddp/module.py", {})
    moved = python_candidates(tmp_path, "app/parallel/ddp/reducer.py", {})
    assert one and [c.id for c in one] == [c.id for c in moved]
    assert not any("int" in c.before for c in one), "an annotation is never evaluated: mutating it is equivalent"
    lt = next(c for c in one if c.operator == "core/ReplaceComparisonOperator_Lt_GtE")
    assert "return a >= b" in apply_python(lt, code) and lt.after == "return a >= b"


def test_an_except_clause_mutant_runs_without_cosmic_ray_and_catches_nothing(tmp_path):
    pytest.importorskip("cosmic_ray")
    from tools.mutation_gen import apply_python, python_candidates

    code = "def f():\n    try:\n        return 1 // 0\n    except ZeroDivisionError:\n        return None\n"
    (tmp_path / "m.py").write_text(code)
    (c,) = [c for c in python_candidates(tmp_path, "m.py", {}) if c.operator == "core/ExceptionReplacer"]
    space: dict = {}
    exec(apply_python(c, code), space)  # no NameError: the class it names exists without cosmic-ray's worker
    with pytest.raises(ZeroDivisionError):
        space["f"]()


def test_the_score_leaves_out_equivalent_survivors_and_counts_untriaged_ones_as_real(tmp_path):
    rows = [
        {"id": "k", "path": "app/worker/a.py", "outcome": "killed"},
        {"id": "t", "path": "app/worker/a.py", "outcome": "killed (timeout)"},
        {"id": "e", "path": "app/worker/a.py", "outcome": "survived"},
        {"id": "u", "path": "app/parallel/b.py", "outcome": "survived"},
        {"id": "n", "path": "app/parallel/b.py", "outcome": "not applied"},
    ]
    result = score(rows, {"e": {"verdict": "equivalent", "reason": "r"}})
    assert (result["killed"], result["ran"], result["equivalent"], result["score"]) == (2, 4, 1, round(2 / 3, 4))
    assert rows[3]["triage"] == {"verdict": "untriaged"}
    assert result["by_area"] == {"app/parallel": {"killed": 0, "counted": 1}, "app/worker": {"killed": 2, "counted": 2}}
    bad = tmp_path / "triage.yaml"
    bad.write_text("mutants:\n  abc123:\n    verdict: maybe\n    reason: unsure\n")
    with pytest.raises(SystemExit, match="abc123"):
        load_triage(bad)


def test_the_committed_triage_file_loads():
    assert all(e["verdict"] in ("equivalent", "real") for e in load_triage().values())


def test_a_mutant_judged_twice_in_the_triage_file_is_one_line_not_the_last_entry_silently(tmp_path):
    entry = "    verdict: equivalent\n    reason: r\n"
    triage = tmp_path / "triage.yaml"
    triage.write_text("mutants:\n  aaaa:\n" + entry + "  bbbb:\n" + entry + "  aaaa:\n" + entry)
    with pytest.raises(SystemExit, match=r"^mutation: aaaa judged twice \(line 2\): keep one$"):
        load_triage(triage)


def test_what_a_selection_leaves_running_is_ended_with_it(tmp_path):
    """A timed-out or finished selection's leftover processes (a hung test's rank processes) are killed."""
    from tools.mutation import run_group

    pid_file = tmp_path / "pid"
    leave_one = (
        f"import subprocess, sys; p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(p.pid))"
    )
    for extra in ([], ["; import time; time.sleep(30)"]):
        try:
            run_group([sys.executable, "-c", leave_one + "".join(extra)], tmp_path, timeout=5)
        except subprocess.TimeoutExpired:
            assert extra, "only the sleeping one times out"
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        stat = Path(f"/proc/{pid}/stat")
        while stat.exists() and stat.read_text().split()[2] != "Z":  # gone, or dead and not yet reaped
            assert time.monotonic() < deadline, "the leftover process is still running"
            time.sleep(0.1)


# -- the triage file and the curated list name only what exists ------------------------------------------------------
NAMED_PATH = re.compile(r"\b(?:app|tests|tools|docker|k8s|bench|docs)/[\w./*-]*\w(?:::\w+)?")


def functions_in(path: Path) -> set[str]:
    """The test functions a file defines, by name (a cheap AST scan; pytest is not run)."""
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def missing(named: str, root: Path = REPO) -> str | None:
    """Why ``named`` (a path, a glob of files, or ``file::test`` with either) names nothing, or None."""
    file, _, test = named.partition("::")
    files = sorted(root.glob(file)) if "*" in file else [root / file] if (root / file).exists() else []
    if not files:
        return f"{file} does not exist"
    test = test.split("[")[0]
    if test and not any(test in functions_in(f) for f in files if f.suffix == ".py"):
        return f"no {test} in {file}"
    return None


def definitions(path: Path) -> set[str]:
    """The names a mutant's ``where`` can take in a file: its functions and classes, or its alerts."""
    text = path.read_text()
    if path.suffix == ".yml":
        return set(re.findall(r"^\s*- alert: (\S+)", text, re.M))
    tree = ast.parse(text)
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


@pytest.mark.parametrize("mutant_id", sorted(load_triage()))
def test_each_triaged_mutant_still_stands_where_its_entry_says(mutant_id):
    """A judgement is read by the mutant's id, a hash of its area, change, definition and line: an entry whose line
    is gone or moved to another definition judges a mutant that no longer exists. Drop it (or triage it anew)."""
    e = load_triage()[mutant_id]
    path = REPO / e["path"]
    assert path.is_file(), f"{mutant_id}: {e['path']} does not exist (moved?)"
    stands = e["before"] in {line.strip() for line in path.read_text().splitlines()}
    assert stands, f"{mutant_id}: {e['before']!r} is no longer a line of {e['path']}"
    assert e["where"] in definitions(path) | {"<module>"}, f"{mutant_id}: no {e['where']} in {e['path']}"
    key = "/".join(e["path"].split("/")[:2]) + "|" + change_key(e["operator"], e["where"], e["before"])
    ids = {stable_id(e["path"], change_key(e["operator"], e["where"], e["before"]), {key: n}) for n in range(64)}
    assert mutant_id in ids, f"{mutant_id}: path, where, operator and before hash to another mutant"


def named_in_triage() -> list[tuple[str, str]]:
    return [
        (f"{key}.{field}", named)
        for key, e in load_triage().items()
        for field, text in e.items()
        for named in NAMED_PATH.findall(str(text))
    ]


def named_in_selections() -> list[tuple[str, str]]:
    out = [(f"mutants.py {m.name}", t) for m in MUTANTS for t in m.tests if t.startswith("tests/")]
    out += [(f"mutants.py {m.name}", m.path) for m in MUTANTS]
    return out + [(f"AREAS {files[0]}", t) for files, tests in AREAS for t in tests if t.startswith("tests/")]


@pytest.mark.parametrize("source", ["triage", "selections"])
def test_every_file_and_test_the_triage_and_the_selections_name_exists(source):
    """Every path and ``file::test`` in tools/mutation_triage.yaml (kills, reasons), and every test of the curated
    list (tools/mutants.py) and of AREAS: a test moved or renamed would otherwise be a kill nobody can rerun, or a
    glob that silently selects nothing."""
    named = named_in_triage() if source == "triage" else named_in_selections()
    assert len(named) > 50
    stale = [f"{where}: {why}" for where, n in named if (why := missing(n))]
    assert not stale, "\n".join(stale)


def test_the_staleness_checks_find_a_moved_file_a_renamed_test_and_a_glob_that_selects_nothing(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_kept():\n    pass\n")
    assert missing("tests/test_a.py::test_kept[param]", tmp_path) is None
    assert missing("tests/test_a*.py::test_kept", tmp_path) is None
    assert missing("tests/test_a.py::test_renamed", tmp_path) == "no test_renamed in tests/test_a.py"
    assert missing("tests/test_gone.py", tmp_path) == "tests/test_gone.py does not exist"
    assert missing("tests/test_b*.py", tmp_path) == "tests/test_b*.py does not exist"
    assert NAMED_PATH.findall("kill: tests/unit/x.py::test_y[z] (added; see app/worker/a.py.)") == [
        "tests/unit/x.py::test_y",
        "app/worker/a.py",
    ]


def test_files_draws_from_the_named_files_only_and_a_glob_that_matches_none_is_one_line():
    from tools.mutation import of_files

    pool = [Candidate(f"id{i}", path, i, "op", "f", "x", site=f"s{i}") for i, path in enumerate(
        ["app/parallel/zero/stage1.py", "app/parallel/zero/stage2.py", "app/parallel/ddp/join.py"])]  # fmt: skip
    assert [c.path for c in of_files(pool, ["app/parallel/zero/*"])] == [
        "app/parallel/zero/stage1.py",
        "app/parallel/zero/stage2.py",
    ]
    assert [c.id for c in of_files(pool, ["app/parallel/ddp/join.py", "app/parallel/zero/stage2*"])] == ["id1", "id2"]
    with pytest.raises(SystemExit, match="--files app/gone/\\* matches no mutated file"):
        of_files(pool, ["app/gone/*"])


def test_an_except_clause_naming_a_dotted_class_is_mutated_where_it_can_be_and_never_ends_the_run(tmp_path):
    # cosmic-ray's ExceptionReplacer renames a plain name; `except (os.error, ValueError)` holds an attribute,
    # which it cannot rename and raises on. Such a mutant is "not applied", as one whose position is gone.
    pytest.importorskip("cosmic_ray")
    from tools.mutation_gen import apply_python, python_candidates

    code = (
        "import os\n\n\ndef f():\n    try:\n        return 1 // 0\n"
        "    except (os.error, ZeroDivisionError):\n        return None\n"
    )
    (tmp_path / "m.py").write_text(code)
    mutants = [c for c in python_candidates(tmp_path, "m.py", {}) if c.operator == "core/ExceptionReplacer"]
    applied = [apply_python(c, code) for c in mutants]
    assert len(mutants) == 2 and None in applied
    assert any(m is not None and "except (os.error, type(" in m for m in applied)


def test_a_file_under_a_catch_all_rule_also_runs_its_own_tests_unit_first_and_before_the_k_filter():
    # app/cluster/elastic.py falls under app/cluster/*; tests/unit/test_rendezvous_store_lifetime.py imports it
    selection = selection_for("app/cluster/elastic.py")
    assert "tests/unit/test_rendezvous_store_lifetime.py" in selection
    assert selection.index("tests/unit/test_elastic.py") < selection.index("tests/integration/test_launch*.py")
    # named after the module: steps/pipeline.py falls under the pipeline step's rule, which had no unit tests
    assert {"tests/unit/test_pipeline_schedule.py", "tests/integration/test_pipeline.py"} <= set(
        expand(selection_for("app/worker/steps/pipeline.py"), REPO)
    )
    dist = selection_for("app/worker/dist.py")
    assert dist[-2:] == ("-k", SLOW) and "tests/unit/test_dist.py" in dist, "the area's -k stays last, with its filter"
    assert selection_for("docker/prometheus/alerts.yml")[0].startswith("promtool"), "a YAML file has no module tests"
