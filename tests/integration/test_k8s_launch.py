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


def test_a_replacement_waits_for_a_new_store():
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
    stale = wait_for_fresh_store("127.0.0.1", port, node_rank=1, timeout_s=30, poll_s=0.2)
    assert replaced.is_set() and stale >= 1, "it joined the previous attempt's store"
    assert time.monotonic() - start >= 2.0


def test_pod_zero_hosts_the_store_and_never_waits():
    assert wait_for_fresh_store("127.0.0.1", 1, node_rank=0, timeout_s=0.1) == 0


def test_a_store_that_never_comes_ends_the_wait():
    with pytest.raises(TimeoutError, match="no new rendezvous store"):
        wait_for_fresh_store("127.0.0.1", 1, node_rank=1, timeout_s=2, poll_s=0.2)  # port 1: nothing listens
