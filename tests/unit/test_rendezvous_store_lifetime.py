"""The rendezvous store's lifetime with ``--restart-after-job``: it serves for as long as its job runs, however long,
and leaves only once torchrun has closed the job's rendezvous; with no worker at all it says so, once. A port
outside 1-65535 is refused in one line.

``watch_job`` (app.cluster.rendezvous_store) runs here in a thread against a real TCPStore, reading the rendezvous
state torchrun's c10d backend writes (torch's own ``_RendezvousState``, written with torch's own backend), with
its poll, grace and silence periods shortened so that a "long job" takes a second, not an hour.
The whole store process, with a real torchrun job, runs in tests/integration/test_rendezvous_store.py.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import threading
import time

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from app.cluster.rendezvous_store import watch_job

POLL_S = 0.05
GRACE_S = 0.1


def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


def write_state(backend: C10dRendezvousBackend, *, closed: bool) -> None:
    """What torchrun's agents leave at the store: a world of two that formed, and later (closed) a job that ended."""
    state = _RendezvousState()
    state.round, state.complete, state.closed = 1, True, closed
    state.participants = {_NodeDesc("node-a", 100, 0): 0, _NodeDesc("node-b", 200, 0): 1}
    found = backend.get_state()
    backend.set_state(pickle.dumps(state), found[1] if found else None)


def watch(s: TCPStore, run_id: str, alone_s: float = 60.0) -> threading.Event:
    stop = threading.Event()
    args = (s, run_id, stop, POLL_S, GRACE_S, alone_s)
    threading.Thread(target=watch_job, args=args, name="watch-job", daemon=True).start()
    return stop


def test_the_store_serves_a_running_job_and_leaves_once_it_has_ended(caplog):
    s = store()
    backend = C10dRendezvousBackend(s, "job")
    stop = watch(s, "job")
    try:
        assert not stop.wait(40 * POLL_S), "the store left before any job came"
        write_state(backend, closed=False)  # the world forms and trains
        assert not stop.wait(40 * POLL_S), "the store left while its job was running"
        with caplog.at_level(logging.INFO, logger="rendezvous_store"):
            write_state(backend, closed=True)  # torchrun closes the rendezvous when the job ends
            ended = time.monotonic()
            assert stop.wait(10), "the store did not leave after its job ended"
        assert time.monotonic() - ended >= GRACE_S  # the last agents get the grace period to finish
        assert "job 'job' ended (rendezvous closed)" in caplog.text
    finally:
        stop.set()


def test_no_worker_at_all_is_said_once_and_the_store_keeps_serving(caplog):
    s = store()
    with caplog.at_level(logging.WARNING, logger="rendezvous_store"):
        stop = watch(s, "nobody", alone_s=10 * POLL_S)
        try:
            assert not stop.wait(60 * POLL_S), "the store left with no job"
        finally:
            stop.set()
    said = [r.getMessage() for r in caplog.records if "no worker has joined" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert "rendezvous 'nobody'" in said[0]


def test_no_worker_is_not_said_before_alone_s(caplog):
    # A store that has waited less than alone_s for its first worker says nothing yet.
    s = store()
    with caplog.at_level(logging.WARNING, logger="rendezvous_store"):
        stop = watch(s, "early", alone_s=60.0)
        try:
            assert not stop.wait(10 * POLL_S)
        finally:
            stop.set()
    assert "no worker has joined" not in caplog.text, caplog.text


def test_the_store_reads_the_rendezvous_about_once_a_second_by_default(monkeypatch):
    # The store's only background work: a poll that spun would take a core from the workers beside it.
    from app.cluster import elastic

    reads = []
    real = elastic.state_reader

    def counting(store, run_id):
        read = real(store, run_id)
        return lambda: (reads.append(1), read())[1]

    monkeypatch.setattr(elastic, "state_reader", counting)
    stop = threading.Event()
    threading.Thread(target=watch_job, args=(store(), "job", stop), name="watch-job", daemon=True).start()
    time.sleep(2.5)
    stop.set()
    assert 1 <= len(reads) <= 4, len(reads)


@pytest.mark.parametrize("port", ["0", "65536", "-1"])
def test_the_store_refuses_a_port_outside_1_to_65535_in_one_line(port, capsys):
    from app.cluster.rendezvous_store import main

    assert main(["--host", "127.0.0.1", "--port", port]) == 2
    assert capsys.readouterr().err.strip() == f"error: --port {port} is not a TCP port; give 1-65535"


@pytest.mark.parametrize("waiting_in", ["wait_list", "redundancy_list"])
def test_a_worker_waiting_to_join_or_spare_is_a_worker_that_came(waiting_in, caplog):
    """A worker that waits for the next round (torch's wait list) or as a spare beyond the maximum (its redundancy
    list) has reached the store: no "no worker has joined" line, however long it waits."""
    s = store()
    state = _RendezvousState()
    setattr(state, waiting_in, {_NodeDesc("node-a", 100, 0)})
    C10dRendezvousBackend(s, "job").set_state(pickle.dumps(state))
    with caplog.at_level(logging.WARNING, logger="rendezvous_store"):
        stop = watch(s, "job", alone_s=10 * POLL_S)
        try:
            assert not stop.wait(40 * POLL_S), "the store left with a worker waiting"
        finally:
            stop.set()
    assert "no worker has joined" not in caplog.text, caplog.text
