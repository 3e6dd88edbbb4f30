"""app.cluster.elastic, the launcher's reading of torch's elastic internals, on a real c10d TCPStore on loopback:
the line each world's forming says (who is in it, who left, who came), a trainer's failure and the leaving line, the
rendezvous handler's two wrapped calls, the trainers' exit codes, the node identity of a restarted container, and
heal=in_place's exit barrier at heal_store. The agent's whole run: tests/integration/test_launch.py."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from app.cluster.elastic import (
    Reporter,
    describe_exit,
    exit_codes,
    fresh_node_identity,
    hook_rendezvous_handler,
    replica_addresses,
    short,
)
from app.exit_codes import PEER_STOPPED
from app.worker.config import TrainConfig
from app.worker.config.launch import LaunchConfig

LOG = "app.cluster.launch"


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    yield store
    del store


def write_state(server, job: str, round: int, participants: dict[str, int], complete: bool = True) -> None:
    """torch's rendezvous state as its c10d backend writes it: ``participants`` maps a node's address to its rank."""
    state = _RendezvousState()
    state.round, state.complete = round, complete
    state.participants = {_NodeDesc(addr, 100 + rank, 0): rank for addr, rank in participants.items()}
    backend = C10dRendezvousBackend(server, job)
    found = backend.get_state()  # its token: torch's backend writes over the state it read, never blind
    backend.set_state(pickle.dumps(state), found[1] if found else None)


def group(size: int, *ranks: int):
    """What torch's agent hands ``_rendezvous``'s caller: the world's size and this container's ranks in it."""
    return SimpleNamespace(group_world_size=size, workers=[SimpleNamespace(global_rank=r) for r in ranks])


def formed_lines(reporter, world, caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOG):
        reporter.world_formed(world)
    return [r.getMessage() for r in caplog.records]


def test_a_node_is_named_as_docker_ps_shows_its_container():
    assert short("0123456789abcdef.ddp-cluster_default") == "0123456789ab"
    assert short("worker-1") == "worker-1"


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (0, "exited 0 (finished)"),
        (1, "exited 1 (failed)"),
        (2, "exited 2 (bad configuration)"),
        (PEER_STOPPED, f"exited {PEER_STOPPED} (stopped with a departing peer, checkpointed)"),
        (74, "exited 74 (could not write a checkpoint)"),
        (3, "exited 3 (failed)"),
        (-signal.SIGTERM, "was killed by SIGTERM"),
        (-200, "was killed by signal 200"),
    ],
)
def test_a_trainers_exit_is_said_in_words(code, says):
    assert describe_exit(code) == says


def test_the_replicas_of_a_service_are_its_dns_addresses_and_none_on_error():
    assert replica_addresses("localhost") == {"127.0.0.1"}
    assert replica_addresses("no-such-service.invalid") == set()


def test_each_world_says_who_is_in_it_by_rank_who_left_and_who_came(server, caplog):
    """One line per world: its size, this container's ranks, the round, each rank's container in rank order; from
    the second world on, the containers that left (with their old rank) and the new ones."""
    reporter = Reporter(("127.0.0.1", server.port), "job", workers=None)
    write_state(server, "job", 2, {"zed.net": 0, "amy.net": 1, "kim.net": 2})
    assert formed_lines(reporter, group(3, 1), caplog) == ["joined a world of 3 as rank 1 (round 2; 0=zed 1=amy 2=kim)"]
    assert reporter.world == 1 and reporter.members == {"zed": 0, "amy": 1, "kim": 2}
    write_state(server, "job", 3, {"kim.net": 0, "zed.net": 1, "bob.net": 2, "ann.net": 3})
    assert formed_lines(reporter, group(4, 2, 3), caplog) == [
        "joined a world of 4 as rank 2,3 (round 3; 0=kim 1=zed 2=bob 3=ann; left: amy (was rank 1); new: bob, ann)"
    ]
    assert reporter.world == 2


def test_a_world_whose_state_is_already_the_next_rounds_says_no_members(server, caplog):
    """The state read after a world formed may be the next round's (forming, or of another size): its members are
    not this world's, so the line gives none, and no one is taken to have left."""
    reporter = Reporter(("127.0.0.1", server.port), "job", workers=None)
    write_state(server, "job", 1, {"zed.net": 0, "amy.net": 1})
    formed_lines(reporter, group(2, 0), caplog)
    write_state(server, "job", 2, {"zed.net": 0}, complete=False)  # the next round forming
    assert formed_lines(reporter, group(2, 0), caplog) == ["joined a world of 2 as rank 0"]
    write_state(server, "job", 2, {"zed.net": 0, "amy.net": 1, "kim.net": 2})  # complete, but of 3
    assert formed_lines(reporter, group(2, 1), caplog) == ["joined a world of 2 as rank 1"]
    assert formed_lines(Reporter(None, "job", None), group(1, 0), caplog) == ["joined a world of 1 as rank 0"]


@pytest.mark.parametrize(
    ("workers", "first_of_job", "size", "warned"),
    # None: a launcher that never waited for peers (it came to a running job): what it starts as
    [(4, True, 3, True), (3, True, 3, False), (None, True, 3, False), (4, False, 3, False), (4, None, 3, False)],
)
def test_a_first_world_of_another_size_than_workers_says_the_running_containers_win(
    workers, first_of_job, size, warned, caplog
):
    reporter = Reporter(None, "job", workers=workers)
    if first_of_job is not None:
        reporter.first_of_job = first_of_job
    lines = formed_lines(reporter, group(size, 0), caplog)
    warning = f"the world formed with {size} workers, not WORKERS={workers}: the world follows the running containers"
    assert any(line.startswith(warning) for line in lines) == warned, lines
    assert not any("WORKERS=" in line for line in formed_lines(reporter, group(size, 0), caplog))  # a later world


def test_a_failed_trainer_is_a_warning_a_departing_peers_stop_is_not_and_the_leaving_line_says_why(caplog):
    reporter = Reporter(None, "job", workers=None)
    with caplog.at_level(logging.INFO, logger=LOG):
        reporter.leaving(3, 3)
        reporter.workers_failed({1: SimpleNamespace(exitcode=1), 0: SimpleNamespace(exitcode=PEER_STOPPED)})
        reporter.leaving(2, 3)
        reporter.leaving(1, 3)
    me = short(__import__("socket").gethostname())
    got = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert got == [
        (logging.INFO, "leaving the world to re-form it: new containers are waiting to join; restarts left 3 of 3"),
        (
            logging.INFO,
            f"rank 0 (this container, {me}) exited {PEER_STOPPED} (stopped with a departing peer, checkpointed)",
        ),
        (logging.WARNING, f"rank 1 (this container, {me}) exited 1 (failed)"),
        (logging.INFO, "leaving the world to re-form it: its trainer stopped (above); restarts left 2 of 3"),
        (logging.INFO, "leaving the world to re-form it: new containers are waiting to join; restarts left 1 of 3"),
    ]


def test_the_jobs_rendezvous_is_closed_only_by_a_finished_job_and_the_first_join_waits_for_peers(caplog):
    """One container giving up must not close the job's rendezvous for the others; the first join (world 0) waits
    for the replicas of LAUNCH_PEERS, a later one joins at once; both say where they join."""
    closed: list[str] = []
    handler = SimpleNamespace(shutdown=lambda: closed.append("closed") or True, next_rendezvous=lambda: "joined")
    reporter = Reporter(("store", 29400), "job", workers=None, settings=LaunchConfig(peers=""))
    hook_rendezvous_handler(handler, reporter)
    assert handler.shutdown() is False and closed == []
    reporter.succeeded = True
    assert handler.shutdown() is True and closed == ["closed"]
    waited: list[tuple[str, float]] = []
    reporter.wait_for_peers = lambda peers, timeout_s: waited.append((peers, timeout_s))
    with caplog.at_level(logging.INFO, logger=LOG):
        assert handler.next_rendezvous() == "joined"
    assert waited == [] and "joining a world of job 'job' at store:29400" in caplog.text
    reporter.settings = LaunchConfig(peers="worker", peers_wait_seconds=42)
    assert handler.next_rendezvous() == "joined" and waited == [("worker", 42)]
    reporter.world = 1
    assert handler.next_rendezvous() == "joined" and waited == [("worker", 42)]


def test_each_local_ranks_exit_code_is_read_from_new_interpreters_and_forked_trainers():
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    done.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        handlers = {0: SimpleNamespace(proc=done), 1: SimpleNamespace(proc=running)}
        assert exit_codes(SimpleNamespace(subprocess_handlers=handlers)) == {0: 3, 1: None}
    finally:
        running.kill()
        running.wait()
    forked = SimpleNamespace(_pc=SimpleNamespace(processes=[SimpleNamespace(exitcode=0), SimpleNamespace(exitcode=-9)]))
    assert exit_codes(forked) == {0: 0, 1: -9}
    assert exit_codes(SimpleNamespace()) == {}


def test_a_restarted_container_names_its_rendezvous_node_afresh_and_knows_it(monkeypatch):
    """A container Docker restarts keeps its hostname and pid: its agent's node id must differ from the dead one's
    (still listed in the state), and the reporter must recognise the node torch names next as itself."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    generator = DynamicRendezvousHandler._node_desc_generator
    monkeypatch.setattr(generator, "_local_id", generator._local_id)
    reporter = Reporter(None, "job", workers=None)
    dead = SimpleNamespace(addr=reporter.me, pid=os.getpid(), local_id=0)
    fresh_node_identity(reporter)
    node = generator.generate()
    assert reporter.is_me(node) and not reporter.is_me(dead)
    assert 0 < reporter.local_id < 2**31


def test_heal_in_places_exit_barrier_says_how_many_containers_it_waited_for_and_a_timeout_is_a_warning(caplog):
    """heal=in_place: the barrier at heal_store counts the newest world's containers (its ranks over the local world
    size); past its timeout it warns as torch's does and is still done (the trainers' exit code stands)."""
    from app.cluster.elastic import heal_exit_barrier
    from app.worker.heal import Member, Quorum

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{store.port}"
    quorum = Quorum(address, "job", "a", timeout_s=10, beat=False)
    quorum.enter("a", publish=True)
    quorum.publish(0, [Member(str(i), 1, i) for i in range(4)])  # 4 ranks, 2 per container: 2 containers
    config = TrainConfig(heal="in_place", heal_store=address, effective_batch=64)
    with caplog.at_level(logging.INFO, logger=LOG):
        assert heal_exit_barrier(config, "job", local_world_size=2, timeout_s=0.2) is True
    assert f"exit barrier at heal_store={address}: 1 of the 2 containers of the world finished in 0.2 s" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOG):
        assert heal_exit_barrier(config, "job", local_world_size=2, timeout_s=5) is True
    assert "the exit barrier at heal_store waited for the 2 container(s) of the trainers' world" in caplog.text
    assert heal_exit_barrier(None, "job", 2, 5) is False  # the launcher checked no config: torch's barrier


def test_a_heal_store_out_of_reach_leaves_the_ending_to_torchs_barrier_with_the_cause_at_debug(caplog):
    import socket

    from app.cluster.elastic import heal_exit_barrier

    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = TrainConfig(heal="in_place", heal_store=f"127.0.0.1:{port}", effective_batch=64)
    with caplog.at_level(logging.DEBUG, logger=LOG):
        assert heal_exit_barrier(config, "job", local_world_size=2, timeout_s=0.3) is False
    (record,) = [r for r in caplog.records if r.getMessage().startswith("cannot reach the healed world")]
    # LOGLEVEL=DEBUG is where a user looks for why: the record carries the connection's own error.
    assert record.levelno == logging.DEBUG and record.exc_info and "127.0.0.1" in str(record.exc_info[1])


def test_the_reporting_agent_gives_its_trainers_torchs_own_time_to_stop(monkeypatch):
    """The agent ``install_agent`` has elastic_launch build stops its trainers as torch's does: a re-formation's
    ``_shutdown()`` (torch calls it with no timeout) waits torch's own grace before SIGKILL, with SIGTERM first."""
    import inspect

    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from app.cluster.elastic import install_agent

    monkeypatch.setattr(launcher_api, "LocalElasticAgent", LocalElasticAgent)
    install_agent(Reporter(None, "job", workers=None))
    agent = launcher_api.LocalElasticAgent
    assert issubclass(agent, LocalElasticAgent) and agent is not LocalElasticAgent
    ours, torchs = (
        inspect.signature(agent._shutdown).parameters,
        inspect.signature(LocalElasticAgent._shutdown).parameters,
    )
    assert ours["timeout"].default == torchs["timeout"].default and ours["death_sig"].default == signal.SIGTERM
