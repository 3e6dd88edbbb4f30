"""Launcher cases that generated mutants showed missing (`make mutants`, tools/mutation_triage.yaml).

.venv/bin/python -m pytest tests/unit/test_mutation_kills_launch.py
"""

from __future__ import annotations

import pytest

STORE = ("store", 29400)


def test_a_failure_that_is_not_the_stores_is_told_as_itself():
    from app.cluster.launch import explain

    assert explain(ValueError("bad shape (3, 4)\nmore"), STORE, "job") == "ValueError: bad shape (3, 4)"


@pytest.mark.parametrize("what", ["connection", "message"])
def test_a_lost_store_is_named_with_its_address(what):
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from app.cluster.launch import explain

    e = RendezvousConnectionError("gone") if what == "connection" else RuntimeError("the TCP store went away")
    assert explain(e, STORE, "job").startswith("lost the rendezvous store store:29400 (")


@pytest.mark.parametrize("code, says", [(-1, "was killed by SIGHUP"), (-9, "was killed by SIGKILL"), (2, "bad config")])
def test_an_exit_by_signal_is_named_by_its_signal(code, says):
    from app.cluster.launch import describe_exit

    assert says in describe_exit(code)


def test_a_refused_container_is_told_its_reason_only_with_the_same_settings_and_a_finish_only_if_it_came_before(
    tmp_path,
):
    """The records of app.cluster.job_state that stop Docker's restarts from repeating a refusal or a finished job."""
    from app.cluster.job_state import JobState, fingerprint

    settings = fingerprint(["--nnodes", "2"], {"DDP_STEPS": "10", "HOME": "/root"})
    assert settings == fingerprint(["--nnodes", "2"], {"DDP_STEPS": "10", "HOME": "/elsewhere"})  # DDP_* only
    assert settings != fingerprint(["--nnodes", "2"], {"DDP_STEPS": "11"})
    a = JobState(tmp_path, "job", "node-a", settings)
    assert a.refused_before() is None
    a.refuse("WORKERS=0 is outside 1..8")
    assert a.refused_before() == "WORKERS=0 is outside 1..8"
    assert JobState(tmp_path, "job", "node-a", "other settings").refused_before() is None
    assert JobState(tmp_path, "job", "node-b", settings).refused_before() is None
    assert JobState(tmp_path, "another job", "node-a", settings).refused_before() is None

    a.arrived()
    first = (tmp_path / "job" / "seen" / "node-a").read_text()
    a.arrived()  # a restart keeps the time it first came
    assert (tmp_path / "job" / "seen" / "node-a").read_text() == first
    a.finish(step=10)
    assert a.finished_since_arrival()["step"] == 10
    late = JobState(tmp_path, "job", "node-c", settings)  # a new container, after the finish: a new run
    assert late.finished_since_arrival() is None

    nothing_kept = JobState(None, "job", "node-a", settings)
    nothing_kept.refuse("x")
    nothing_kept.arrived()
    nothing_kept.finish(step=1)
    assert nothing_kept.refused_before() is None and nothing_kept.finished_since_arrival() is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job"]
