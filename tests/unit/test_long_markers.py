"""The long tests stay out of `make test` and CI, and `make drills` / `make chaos` still find them (tests/conftest.py:
``leave_out_long``): what pytest collects, asked of pytest itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.e2e.drills.drill_faults import scenarios

ROOT = Path(__file__).resolve().parents[2]
FILES = ["tests/e2e/test_failure_drills.py", "tests/e2e/test_chaos.py", "tests/integration/test_world_drift.py"]


def collected(*args: str) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args, *FILES]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_a_plain_run_and_the_e2e_run_leave_the_long_tests_out():
    for args in ([], ["-m", "e2e"]):
        found = collected(*args)
        assert found and all("test_drill[" not in t and "documented" not in t and "drift" not in t for t in found)
        assert any("test_chaos.py::test_final_parameters" in t for t in found)  # the short proof stays in CI


def test_naming_the_marker_selects_every_drill_or_the_documented_chaos_run():
    drills = collected("-m", "drill")
    assert sorted(t.split("[")[1].rstrip("]") for t in drills) == sorted(scenarios(3)), drills
    assert collected("-m", "chaos") == ["tests/e2e/test_chaos.py::test_the_documented_chaos_run"]
