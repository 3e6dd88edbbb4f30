"""The failure drills of docs/cluster.md's table, one test each (tests/e2e/drills/): a fault injected into a real
compose cluster, and what a user would notice judged (a finish or the one line that says why, no restart storm, no
traceback, a page naming the lost rank in time). Each writes its row of bench/results/drills.json.

    make drills                               # every drill, one after the other
    make drills DRILL=store-crash             # one drill: its row replaced, the others kept
    make drills DRILL_ARGS="--no-alerts"      # other settings: a trial, written to runs/drills.json

Marked ``drill``: left out of ``make test`` (tests/conftest.py); Docker prerequisites as in tests/e2e/conftest.py.
"""

from __future__ import annotations

import os
import shlex

import pytest

from tests.e2e.drills.drill_faults import scenarios
from tests.e2e.drills.drills import build_images, build_parser, results_path, run_drill, show, write_row
from tools.provenance import load_average

pytestmark = [pytest.mark.drill, pytest.mark.timeout(1800)]

PARSER = build_parser()
ARGS = PARSER.parse_args(shlex.split(os.environ.get("DRILL_ARGS", "")))


@pytest.fixture(scope="module")
def images() -> None:
    build_images(ARGS)


@pytest.mark.parametrize("name", list(scenarios(ARGS.workers)))
def test_drill(name: str, images) -> None:
    before = load_average()
    result = run_drill(name, scenarios(ARGS.workers)[name], ARGS)
    write_row(results_path(PARSER, ARGS), name, result, ARGS, before)
    show(name, result)
    failed = [check for check, ok in result["checks"].items() if not ok]
    assert not failed, f"{name}: {failed}; {result.get('error', '')}"
