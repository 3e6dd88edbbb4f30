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
