"""The fresh-store gate of app.cluster.k8s_launch against a real TCPStore on loopback: a replacement pod waits while the
store it reaches is a previous attempt's (it has seen the pod's node rank), and joins the next new store."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
from torch.distributed import TCPStore

from app.cluster.k8s_launch import wait_for_fresh_store


def serve(port: int = 0) -> TCPStore:
    """A store like the one torchrun's agent on pod 0 hosts."""
    return TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


def test_the_first_pod_of_an_index_joins_at_once():
    store = serve()
    assert wait_for_fresh_store("127.0.0.1", store.port, node_rank=1, timeout_s=10) == 0


def test_a_replacement_waits_for_a_new_store(caplog):
    stores = [serve()]  # the first attempt's pod 0
    port = stores[0].port
    assert wait_for_fresh_store("127.0.0.1", port, node_rank=1, timeout_s=10) == 0  # the first attempt's pod 1
    replaced = threading.Event()

    def replace_pod_zero():
        time.sleep(2.0)  # the old pod 0 is still ending while the replacement of pod 1 starts
        stores.pop()  # the old store goes with its pod
        time.sleep(0.5)
        stores.append(serve(port))  # the new pod 0's
        replaced.set()

    threading.Thread(target=replace_pod_zero, daemon=True).start()
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="app.cluster.k8s_launch"):
        stale = wait_for_fresh_store("127.0.0.1", port, node_rank=1, timeout_s=30, poll_s=0.2)
    assert replaced.is_set() and stale >= 1, "it joined the previous attempt's store"
    assert time.monotonic() - start >= 2.0
    # One line for the stale store however many polls it took (about ten here), one for the new one.
    said = [r.getMessage() for r in caplog.records]
    assert [("previous attempt's" in s, "a new store" in s) for s in said] == [(True, False), (False, True)], said


def test_pod_zero_hosts_the_store_and_never_waits():
    assert wait_for_fresh_store("127.0.0.1", 1, node_rank=0, timeout_s=0.1) == 0


def test_a_store_that_never_comes_ends_the_wait():
    with pytest.raises(TimeoutError, match="no new rendezvous store"):
        wait_for_fresh_store("127.0.0.1", 1, node_rank=1, timeout_s=2, poll_s=0.2)  # port 1: nothing listens


def test_a_pod_asked_to_stop_exits_143_and_only_the_static_rendezvous_waits_for_a_fresh_store(tmp_path):
    """The whole launcher, with torchrun's c10d rendezvous (which needs no fresh-store gate: it has a run id) and a
    master address where nothing listens: its rank starts at once; SIGTERM (the pod deleted) then ends it with 143,
    never 0, which the Job would count as the index done."""
    import signal

    from tests.trainer_run import clean_env, free_port, start_module

    started = tmp_path / "started"
    # `python -m app.cluster.k8s_launch ...`, forked from the test template (torch imported once there).
    launcher = start_module(
        *("app.cluster.k8s_launch", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"),
        *("--nnodes=1", "--nproc-per-node=1", "--node-rank=1", "--master-addr=127.0.0.1", "--master-port=1"),
        *("--rdzv-conf=timeout=20", "--max-restarts=0", "--no-python", "bash", "-c"),
        f"touch {started}; exec sleep 120",
        env=clean_env(),
    )

    def output() -> str:
        return launcher.stdout.read() + launcher.stderr.read()

    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert launcher.poll() is None, output()
            assert time.monotonic() < deadline, "the rank never started"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 143, output()
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
