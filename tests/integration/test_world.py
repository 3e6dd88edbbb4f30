"""app.world, the one local-world launcher every multi-rank test, demo, bench and ``app.check`` stands on: a crashed
rank is reported at once, by rank and exit code, instead of as a hang at the deadline; and the next call gets a fresh,
working world. And ``spawn_world``'s forked ranks see the caller's environment of the moment.

    .venv/bin/python -m pytest tests/integration/test_world.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from app.world import WorldFailed, run_world, spawn_world
from tests.trainer_run import REPO, clean_env


def _rank_1_dies(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)  # what a segfault or the OOM killer looks like from outside: gone, no report, no traceback
    return rank


def _sum_of_ranks(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_a_rank_that_dies_fails_the_call_at_once_and_the_next_call_works():
    # A started world first: starting one (interpreters importing torch) takes a minute on a loaded machine, and is
    # not what is timed here.
    assert run_world(_sum_of_ranks, 2, timeout=120) == [1.0, 1.0]
    start = time.monotonic()
    with pytest.raises(WorldFailed, match=r"rank 1 died \(exit code 3\)"):
        run_world(_rank_1_dies, 2, timeout=120)
    # Without the liveness check this waited the whole timeout (120 s) and then called it a hang.
    assert time.monotonic() - start < 30
    assert run_world(_sum_of_ranks, 2, timeout=120) == [1.0, 1.0]  # a fresh world, in step
    assert run_world(_sum_of_ranks, 2, timeout=120) == [1.0, 1.0]  # and it is reused


def _rank_world_and_variable(rank: int, world: int, name: str) -> tuple:
    return rank, world, os.environ.get(name)


def test_spawn_world_ranks_see_the_callers_environment_as_it_is_at_each_call(monkeypatch):
    # app.world forks its ranks from templates that keep the environment they started with; a variable set between
    # two calls (a test's monkeypatch, a user's script) must still reach the second call's ranks.
    monkeypatch.setenv("SPAWN_WORLD_PROBE", "first")
    assert spawn_world(_rank_world_and_variable, 2, "SPAWN_WORLD_PROBE") == [(0, 2, "first"), (1, 2, "first")]
    monkeypatch.setenv("SPAWN_WORLD_PROBE", "second")
    assert spawn_world(_rank_world_and_variable, 2, "SPAWN_WORLD_PROBE") == [(0, 2, "second"), (1, 2, "second")]


def test_a_function_of_a_module_run_with_dash_m_reaches_its_ranks():
    # The ranks' own __main__ is app.world's: a function pickled as __main__.fn is looked up in the caller's module.
    out = subprocess.run(
        [sys.executable, "-m", "tests.integration.world_main_probe"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip() == "[(0, 2), (1, 2)]", out.stderr[-3000:]
