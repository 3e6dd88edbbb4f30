"""heal=in_place's refusals and the new world's rank order (app.worker.heal; the heal itself, on real ranks with a
real kill: tests/integration/test_heal.py)."""

from __future__ import annotations

import time

import pytest

from app.worker.config import ConfigError, TrainConfig
from app.worker.heal import Member, order
from tests.trainer_run import clean_env, run_module

IN_PLACE = {"heal": "in_place", "heal_store": "rendezvous:29400", "effective_batch": 64}


def test_heal_in_place_is_refused_by_a_sharded_kind_in_one_line_exit_2():
    """A kind whose lost rank takes state no survivor holds cannot heal in place: said before any rank starts."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in IN_PLACE.items()]
    result = run_module("app.train", "--metrics-port", "0", "--parallel", "zero2", *flags, timeout=60, env=clean_env())
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "config error: heal=in_place works with parallel=ddp only: under parallel=zero2 a lost rank takes its "
        "shard of the optimizer state and gradients with it; set heal=restart (resume from the checkpoint) "
        "(set by flag --heal)"
    ]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"parallel": "zero3"}, r"^heal=in_place works with parallel=ddp only: under parallel=zero3 .* parameters"),
        ({"parallel": "pipeline"}, r"^heal=in_place works with parallel=ddp only: under parallel=pipeline .* stage"),
        ({"heal_store": ""}, r"^heal_store='': heal=in_place needs HOST:PORT of a store that outlives every rank"),
        ({"heal_store": "rendezvous"}, r"^heal_store='rendezvous': heal=in_place needs HOST:PORT"),
        ({"effective_batch": None}, r"^effective_batch unset: heal=in_place needs the global batch fixed in samples"),
        ({"heal": "restart"}, r"^heal_store='rendezvous:29400' is for heal=in_place only"),
        ({"compile": "inductor"}, r"^heal=in_place with compile=inductor is not wired: set compile=none"),
        ({"heal": "inplace"}, r"^heal='inplace': must be one of restart \| in_place"),
    ],
)
def test_heal_settings_name_the_field_and_the_fix(settings, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{**IN_PLACE, **settings})


def test_heal_in_place_is_accepted_for_ddp_and_restart_stays_the_default():
    assert TrainConfig().heal == "restart"
    assert TrainConfig(**IN_PLACE).heal == "in_place"


def test_the_member_with_the_most_steps_becomes_rank_0_and_newcomers_come_last():
    """Rank 0 of the new world sends its state: it must be one that applied every step any survivor applied (a
    collective can complete on some survivors and fail on others)."""
    members = [Member("new", -1, -1), Member("b", 7, 2), Member("a", 7, 1), Member("c", 8, 3)]
    assert [m.id for m in order(members)] == ["c", "a", "b", "new"]


@pytest.fixture
def published():
    """A store holding job1's world of 3 (ids a, b, c) as its rank 0 publishes it: ``(address, quorum)``, the quorum
    writing as Quorum does, without its heartbeat thread (which would outlive this test's store)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from app.worker.heal import Quorum

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    quorum = SimpleNamespace(store=server, base="heal/job1/", prefix="heal/job1/")
    quorum.key = lambda name: quorum.prefix + name
    quorum.heartbeat_key = lambda member_id: f"heal/job1/hb/{member_id}"
    members = [Member(i, 4, r) for r, i in enumerate("abc")]
    Quorum.enter(quorum, "a")
    Quorum.publish(quorum, 0, members)
    Quorum.enter(quorum, "a", publish=True)
    yield f"127.0.0.1:{server.port}", quorum
    del server


def test_the_launchers_exit_barrier_counts_the_newest_world_at_heal_store_not_torchruns(published):
    """Every launcher of the newest world arrives at heal_store's barrier: after a heal from 3 to 2, two (the lost
    one's never comes); after a newcomer joins, three (its launcher never entered torch's rendezvous)."""
    from app.worker.heal import Quorum, exit_barrier, newest_world_size

    address, quorum = published
    assert newest_world_size(address, "job1") == 3 and newest_world_size(address, "job2") is None
    assert exit_barrier(address, "job2", 1, timeout_s=1) is None  # no world: torch's own barrier then
    members = Quorum.published(quorum, 0)
    Quorum.publish(quorum, 1, members[:2])  # the world healed to 2 ...
    Quorum.publish(quorum, 2, [*members[:2], Member("new", -1, -1)])  # ... and took a newcomer in
    assert newest_world_size(address, "job1") == 3
    quorum.store.add(quorum.key("exit/n"), 1)  # one survivor's launcher has arrived
    with pytest.raises(TimeoutError, match="2 of the 3 containers"):
        exit_barrier(address, "job1", 1, timeout_s=0.3)  # the other's: the newcomer's is still to come
    assert exit_barrier(address, "job1", 1, timeout_s=5) == 3  # the newcomer's launcher: the third


def test_the_launcher_uses_heal_stores_barrier_only_for_heal_in_place_with_a_world_there(published):
    from app.cluster.elastic import Reporter

    address, quorum = published
    quorum.store.add(quorum.key("exit/n"), 2)
    healed = TrainConfig(heal="in_place", heal_store=address, effective_batch=64)
    assert Reporter(None, "job1", 3, healed).heal_exit_barrier(local_world_size=1, timeout_s=5) is True
    assert Reporter(None, "job1", 3, TrainConfig()).heal_exit_barrier(1, 5) is False  # heal=restart: torch's
    assert Reporter(None, "job9", 3, healed).heal_exit_barrier(1, 5) is False  # no world at the store: torch's
    gone = TrainConfig(heal="in_place", heal_store="127.0.0.1:1", effective_batch=64)
    assert Reporter(None, "job1", 3, gone).heal_exit_barrier(1, 1) is False  # torch's barrier then


def test_a_world_is_live_to_a_newcomer_while_a_members_heartbeat_moves_and_until_it_finishes(published):
    """What a container's launcher asks before it joins as a newcomer (app.cluster.newcomer): a world whose ranks
    all stopped beating, or that finished, is no world to join (torchrun's rendezvous then)."""
    import threading

    from app.worker.heal import STALE_SECONDS, job_finished, live_world

    address, quorum = published
    started = time.monotonic()
    assert live_world(address, "job1") is None  # published, but nobody beats: its ranks are gone
    assert STALE_SECONDS <= time.monotonic() - started < STALE_SECONDS + 2
    assert live_world(address, "job2") is None
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            quorum.store.add(quorum.heartbeat_key("b"), 1)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        assert live_world(address, "job1") == 3
        assert not job_finished(address, "job1")
        quorum.store.set(quorum.key("finished"), "1")
        assert live_world(address, "job1") is None and job_finished(address, "job1")
    finally:
        stop.set()
        beating.join()


def test_a_newcomer_waiting_to_join_is_told_at_once_when_the_job_finishes(published, tmp_path):
    """Registered for the next world while the world's ranks still beat, a newcomer would wait out
    rendezvous_timeout_seconds for a step boundary that never comes once the job has finished: it is told within a
    poll, and its launcher ends 0 in one line (app.cluster.newcomer.failed)."""
    import threading
    from types import SimpleNamespace

    from app.cluster.job_state import JobState
    from app.cluster.newcomer import failed
    from app.worker.heal import JobFinished, Quorum

    address, quorum = published
    newcomer = Quorum(address, "job1", "new", timeout_s=60, beat=False)
    newcomer.enter("a")
    stop = threading.Event()

    def beat_then_finish() -> None:
        for _ in range(10):  # the world's ranks beat for a second, then rank 0 says the job finished
            quorum.store.add(quorum.heartbeat_key("a"), 1)
            stop.wait(0.1)
        quorum.store.set(quorum.key("finished"), "1")

    threading.Thread(target=beat_then_finish, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(JobFinished, match="finished while this rank waited to join"):
        newcomer.agree(1, Member("new", -1, -1), previous=["a", "b", "c"])
    assert time.monotonic() - started < 10
    config = TrainConfig(heal="in_place", heal_store=address, effective_batch=64, steps=7)
    job = JobState.in_dir(str(tmp_path), "job1", "here", "digest")
    job.arrived()
    assert failed(SimpleNamespace(rdzv_id="job1"), config, job, code=1) == 0
    assert job.finished_since_arrival()["step"] == 7  # a start of this container again ends 0 at once


def test_a_container_over_the_maximum_is_refused_rather_than_joining_a_full_live_world(tmp_path, caplog):
    """A live world at --nnodes' MAX takes no newcomer: exit 2 in one line, recorded (a restart of the container ends
    at once), no trainer started; below MAX, the same container would join."""
    from types import SimpleNamespace

    from app.cluster.job_state import JobState
    from app.cluster.newcomer import join_live_world

    job = JobState.in_dir(str(tmp_path), "job1", "here", "digest")
    job.arrived()
    config = TrainConfig(heal="in_place", heal_store="127.0.0.1:1", effective_batch=64)
    with caplog.at_level("ERROR", logger="app.cluster.launch"):
        assert join_live_world(SimpleNamespace(rdzv_id="job1"), config, None, job, size=3, high=3) == 2
    assert "holds 3 ranks, its maximum (MAX_WORKERS)" in caplog.text
    assert "maximum of 3 workers" in job.refused_before()
