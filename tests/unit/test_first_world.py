"""The job's first world under compose (app.cluster.elastic.complete_first_world_when_full), on torch's own
rendezvous state machine: it forms the moment every ready replica is in, and not before while they are arriving.

    .venv/bin/python -m pytest tests/unit/test_first_world.py
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _RendezvousState,
)

from app.cluster.elastic import Reporter, complete_first_world_when_full

LAST_CALL = timedelta(seconds=15)  # compose.yaml's RDZV_LAST_CALL_SECONDS


class Holder:
    """The state holder torch's executor reads and marks dirty (in a real agent: synced through the store)."""

    def __init__(self):
        self.state = _RendezvousState()

    def mark_dirty(self) -> None:
        pass


@pytest.fixture
def rendezvous(monkeypatch):
    """join(i): replica i adds itself to round 0, as torch's join operation does; the patch undone afterwards."""
    monkeypatch.setattr(
        _DistributedRendezvousOpExecutor, "_add_to_participants", _DistributedRendezvousOpExecutor._add_to_participants
    )
    reporter = Reporter(None, "job", None)
    complete_first_world_when_full(reporter)
    settings = RendezvousSettings(
        "job", 1, 8, RendezvousTimeout(join=timedelta(seconds=120), last_call=LAST_CALL), timedelta(seconds=2), 5
    )
    holder = Holder()

    def join(i: int):
        executor = _DistributedRendezvousOpExecutor(_NodeDesc(f"replica-{i}", 1, 0), holder, settings)
        executor._state = holder.state  # what the executor's run() does before each action
        executor._add_to_participants()
        return holder.state

    return reporter, join


def test_the_first_world_forms_once_every_ready_replica_is_in_and_holds_its_last_call_until_then(rendezvous):
    reporter, join = rendezvous
    reporter.first_of_job, reporter.expected = True, 4  # wait_for_peers saw four replicas ready
    for i in range(3):
        state = join(i)
        assert not state.complete, f"the first world formed with {i + 1} of the 4 ready replicas"
    # torch's last call would end LAST_CALL after the first arrival; it is held the LAUNCH_ setting from now.
    hold = timedelta(seconds=reporter.settings.first_world_hold_seconds)
    assert (
        state.deadline
        > datetime.now(timezone.utc) + hold - timedelta(seconds=5)
        > datetime.now(timezone.utc) + LAST_CALL
    )
    state = join(3)
    assert state.complete and sorted(state.participants.values()) == [0, 1, 2, 3]  # at once: no last call


def test_later_worlds_keep_torchs_last_call(rendezvous):
    reporter, join = rendezvous
    reporter.first_of_job, reporter.expected, reporter.world = True, 4, 1  # a world has run: this one may grow
    state = join(0)
    for i in range(1, 4):
        state = join(i)
    assert not state.complete  # four in, below MAX: torch waits the last call for more
    assert state.deadline <= datetime.now(timezone.utc) + LAST_CALL


def test_without_a_known_count_the_first_world_keeps_torchs_last_call(rendezvous):
    # wait_for_peers timed out, or there is no store to count on: nobody knows how many replicas are coming, so
    # the first arrival must not form a world of one.
    reporter, join = rendezvous
    reporter.first_of_job = True
    for i in range(2):
        state = join(i)
    assert not state.complete, "a world formed before torch's last call, with no replica count known"
    assert state.deadline <= datetime.now(timezone.utc) + LAST_CALL


def test_a_job_has_started_once_its_rendezvous_has_members_a_formed_world_or_a_past_round():
    """What a launcher reads at a real c10d store before waiting for its peers (``Reporter.job_started``): torch's
    own rendezvous state, written with torch's own backend. Joining at once is right only for a started job."""
    import datetime
    import pickle

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    from app.cluster.elastic import Reporter

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))

    def started(job: str, **fields) -> bool:
        if fields:
            state = _RendezvousState()
            for name, value in fields.items():
                setattr(state, name, value)
            C10dRendezvousBackend(server, job).set_state(pickle.dumps(state))
        return Reporter(("127.0.0.1", server.port), job, None).job_started()

    node = _NodeDesc("node-a", 1, 0)
    assert not started("no state yet")
    assert not started("fresh", round=0)
    assert started("someone waits", participants={node: 0})
    assert started("formed", complete=True)
    assert started("a past round", round=1)
    assert not Reporter(None, "standalone", None).job_started()  # no store: nothing to read


def test_a_replica_listed_late_is_waited_for_until_the_set_stands_still():
    """`up --scale worker=4` on a busy machine: three replicas listed (and ready), the fourth a few seconds later.
    The set counts as complete only once no address is new for the settle time."""
    from app.cluster.elastic import Sightings

    now = [100.0]
    sightings = Sightings(3.0, clock=lambda: now[0])
    assert not sightings.settled()  # nothing listed yet: nothing to form
    sightings.see({"10.0.0.2", "10.0.0.3", "10.0.0.4"})
    now[0] += 2.0
    assert not sightings.settled(), "the first world formed 2 s after the first listing: settle is 3 s"
    sightings.see({"10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"})  # the fourth container runs now
    now[0] += 2.0
    assert not sightings.settled(), "the fourth address is only 2 s old"
    now[0] += 1.0
    assert sightings.settled()
    sightings.see({"10.0.0.2", "10.0.0.3"})  # two went away (killed before the first world): still settled
    assert sightings.settled()


def test_waiting_for_peers_returns_once_every_listed_replica_is_ready_and_the_list_stood_still():
    """A real store, a real DNS name (localhost), every listed replica ready: the wait lasts the settle time, no
    more, and the launcher then knows how many replicas the first world holds."""
    import datetime
    import time

    import torch.distributed as dist

    from app.cluster.elastic import Reporter, replica_addresses
    from app.worker.config.launch import LaunchConfig

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    listed = replica_addresses("localhost")
    assert listed, "localhost resolves to no IPv4 address on this machine"
    for ip in listed:  # every other replica's launcher is ready
        server.set(f"app.cluster.launch/job/ready/{ip}", "1")
    reporter = Reporter(("127.0.0.1", server.port), "job", None, settings=LaunchConfig(peers_settle_seconds=1.5))
    start = time.monotonic()
    reporter.wait_for_peers("localhost", timeout_s=30)
    waited = time.monotonic() - start
    assert reporter.expected == len(listed) and reporter.first_of_job
    assert 1.5 <= waited < 10, f"waited {waited:.1f} s for replicas that were all ready (settle 1.5 s)"


def test_a_launcher_waits_for_a_replica_that_is_not_ready_yet_then_counts_it():
    """``Reporter.wait_for_peers`` against a real store: the one replica its peers name (an address of its own, as
    Docker's service name gives one per container) marks itself ready a second later; the launcher polls until then
    and counts it, rather than join a first world alone or fail."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    reporter = Reporter(("127.0.0.1", server.port), "job", None)
    late = threading.Timer(1.0, lambda: server.set("app.cluster.launch/job/ready/127.0.0.2", "1"))
    late.start()
    t0 = time.monotonic()
    try:
        reporter.wait_for_peers("127.0.0.2", timeout_s=30)
    finally:
        late.cancel()
    assert reporter.first_of_job and reporter.expected == 1
    assert 0.9 < time.monotonic() - t0 < 20
