"""`make mutants` stays runnable as the code moves: every mutant's snippet is found exactly once, its tests exist.

The mutants themselves run for minutes (tools/mutants.py); this checks the list, in a second.
"""

from __future__ import annotations

import pytest

from tools.mutants import MUTANTS, REPO, count


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_snippet_is_found_exactly_once_and_changes_the_code(mutant):
    assert (REPO / mutant.path).is_file(), f"{mutant.name}: {mutant.path} does not exist (moved?)"
    found = count(mutant)
    assert found == 1, f"{mutant.name}: snippet found {found}× in {mutant.path}, must be once:\n{mutant.find}"
    assert mutant.replace != mutant.find


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_tests_meant_to_catch_it_exist(mutant):
    files = [t.split("::")[0] for t in mutant.tests if t.startswith("tests/")]
    assert files, f"{mutant.name}: no test file selected"
    for f in files:
        assert (REPO / f).is_file(), f"{mutant.name}: {f} does not exist"
        for name in [t.split("::", 1)[1] for t in mutant.tests if t.startswith(f + "::")]:
            test = name.split("[")[0].split("::")[-1]
            assert f"def {test}(" in (REPO / f).read_text(), f"{mutant.name}: no {test} in {f}"


def test_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
