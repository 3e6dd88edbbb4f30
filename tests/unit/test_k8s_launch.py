"""app.cluster.k8s_launch's decisions, without torchrun: the pod's exit code from its ranks', and the threads per rank.

The fresh-store gate runs against a real TCPStore in tests/integration/test_k8s_launch.py, and the whole launcher
in the Kubernetes emulation (tests/e2e/test_k8s_emulation.py).
"""

from __future__ import annotations

import logging

import pytest

from app.cluster.k8s_launch import (
    EXIT_PEER,
    EXIT_STOPPED,
    _rendezvous_timeout,
    failure_exit,
    pod_exit_code,
    set_omp_threads,
)
from app.cluster.memory import OomWatch
from app.exit_codes import OUT_OF_MEMORY
from tests.unit.test_memory import v2


@pytest.mark.parametrize(
    ("failed", "code"),
    [
        ({}, 0),  # every rank finished
        ({0: 2}, 2),  # a bad configuration: FailJob
        ({0: 2, 1: -15}, 2),
        ({0: EXIT_PEER}, EXIT_PEER),  # the peer went away: ignored by the Job
        ({0: EXIT_PEER, 1: -15}, EXIT_PEER),  # and torchrun stopped this pod's other rank
        ({0: 1}, 1),  # this pod's own failure: counted
        ({0: EXIT_PEER, 1: 1}, 1),  # one of this pod's ranks failed by itself: counted
        ({0: -9}, 1),  # killed (the OOM killer): counted
        ({0: -15}, 1),  # a SIGTERM that torchrun did not send: not a peer's
    ],
)
def test_pod_exit_code_counts_only_this_pods_own_failures(failed, code):
    assert pod_exit_code(failed) == code


def test_exit_codes_are_none_the_job_reads_otherwise():
    assert len({0, 1, 2, EXIT_PEER, EXIT_STOPPED}) == 5 and EXIT_STOPPED == 128 + 15


@pytest.mark.parametrize(
    ("env", "nproc", "threads"),
    [
        ({"CPU_LIMIT": "64"}, "8", "8"),
        ({"CPU_LIMIT": "8"}, "8", "1"),
        ({"CPU_LIMIT": "4"}, "8", "1"),  # fewer CPUs than ranks: one thread each, never 0
        ({"CPU_LIMIT": "3"}, "1", "3"),
        ({"CPU_LIMIT": "16", "OMP_NUM_THREADS": "2"}, "8", "2"),  # set by hand: left alone
    ],
)
def test_threads_are_the_cpu_limit_shared_among_the_pods_ranks(env, nproc, threads):
    set_omp_threads(nproc, env)
    assert env["OMP_NUM_THREADS"] == threads


def test_no_cpu_limit_leaves_threads_to_torchrun():
    env: dict[str, str] = {}
    set_omp_threads("2", env)
    assert "OMP_NUM_THREADS" not in env


def test_rendezvous_timeout_is_torchruns():
    assert _rendezvous_timeout("timeout=900") == 900
    assert _rendezvous_timeout("join_timeout=5,timeout=30") == 30
    assert _rendezvous_timeout("") == 600  # torch's static rendezvous default


def test_wait_for_fresh_store_counts_the_stale_store_it_met_once(monkeypatch):
    # The first store reached had this node already (a previous attempt's), the next one is new: one stale store.
    from app.cluster import k8s_launch

    joins = iter([2, 1])

    class Store:
        def __init__(self, *args, **kwargs):
            pass

        def add(self, key, n):
            return next(joins)

    monkeypatch.setattr(k8s_launch, "TCPStore", Store)
    assert k8s_launch.wait_for_fresh_store("pod-0", 29500, node_rank=1, timeout_s=10, poll_s=0) == 1


@pytest.mark.parametrize("exitcode", [-9, 1])
def test_a_rank_killed_for_memory_ends_the_pod_in_one_line_and_any_other_failure_as_usual(tmp_path, caplog, exitcode):
    # The kernel's count tells a kill for memory (over resources.limits.memory) from any other: only a rank ended by
    # SIGKILL while the count rose is one, and the pod then says so, with the limit, and exits OUT_OF_MEMORY.
    memory = OomWatch(v2(tmp_path, kills=0))
    v2(tmp_path, kills=1)
    with caplog.at_level(logging.INFO, logger="app.cluster.k8s_launch"):
        code = failure_exit({0: 1, 1: exitcode}, memory)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    if exitcode == -9:
        assert code == OUT_OF_MEMORY and lines[0].startswith("rank 1 (this container, "), lines
        assert "was killed for memory: over its container's limit of 1300 MiB" in lines[0], lines
    else:
        assert code == pod_exit_code({0: 1, 1: 1}) and lines[0].startswith("ranks failed with exit codes"), lines
