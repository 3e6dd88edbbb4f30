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
