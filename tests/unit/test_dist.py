"""The process group's address (app.worker.dist): a plain run without torchrun picks its own free port.

.venv/bin/python -m pytest tests/unit/test_dist.py
"""

from __future__ import annotations


def test_a_plain_run_takes_a_free_port_and_a_given_one_is_kept(monkeypatch):
    """Two plain ``python -m app.train`` runs at once must not both dial 29500 (the integration test
    test_two_plain_runs_at_once_do_not_clash shows it end to end); under torchrun its port is the one used."""
    from app.worker.dist import _default_master

    for name in ("WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    addr, port = _default_master(None)
    assert addr == "127.0.0.1" and port != 29500 and 0 < port < 65536
    monkeypatch.setenv("MASTER_PORT", "29777")
    assert _default_master(None) == ("127.0.0.1", 29777)


def test_a_master_port_outside_0_to_65535_is_one_line_naming_it(monkeypatch):
    """torch refuses such a port with a ValueError before any connection; the rank reports it as a rendezvous
    failure in one line that names the variable to fix, not as a traceback."""
    import pytest

    from app.worker.config import WorldEnv
    from app.worker.dist import RendezvousError, init_distributed

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "70000")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # rank 0 serves the store: no dial first
    with pytest.raises(RendezvousError) as e:
        init_distributed(5, force_cpu=True, world=WorldEnv())
    assert "127.0.0.1:70000 (MASTER_ADDR:MASTER_PORT)" in str(e.value)
    assert "65535" in str(e.value) and "\n" not in str(e.value)


def test_a_rank_that_reaches_the_endpoint_at_its_deadline_still_gets_a_moment_to_form_the_group(monkeypatch):
    """The group gets the rest of the one deadline, but never less than a moment: a rank that reached the endpoint
    at the very end of its timeout (here: a timeout of 0) still forms a world that is ready for it."""
    from app.net import free_port
    from app.worker import dist
    from app.worker.config import WorldEnv

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(dist, "RENDEZVOUS_GRACE_SECONDS", 60.0)  # the guard that ends the process: not in a test
    ctx = dist.init_distributed(0, force_cpu=True, world=WorldEnv(), collective_timeout_s=60)
    try:
        assert (ctx.rank, ctx.world_size, ctx.backend) == (0, 1, "gloo")
    finally:
        dist.cleanup_distributed()
