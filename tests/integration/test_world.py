"""tests/world.py, the harness every multi-rank test stands on: a crashed rank is reported at once, by rank and exit
code, instead of as a hang at the deadline; and the next call gets a fresh, working world.

    .venv/bin/python -m pytest tests/integration/test_world.py -q
"""

from __future__ import annotations

import os
import time

import pytest

from tests.world import run_world


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
    with pytest.raises(AssertionError, match=r"rank 1 died \(exit code 3\)"):
        run_world(_rank_1_dies, 2, timeout=120)
    # Without the liveness check this waited the whole timeout (120 s) and then called it a hang.
    assert time.monotonic() - start < 30
    assert run_world(_sum_of_ranks, 2, timeout=120) == [1.0, 1.0]  # a fresh world, in step
    assert run_world(_sum_of_ranks, 2, timeout=120) == [1.0, 1.0]  # and it is reused
