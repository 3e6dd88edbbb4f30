"""heal=in_place's refusals and the new world's rank order (app.worker.heal; the heal itself, on real ranks with a
real kill: tests/integration/test_heal.py)."""

from __future__ import annotations

import re
import threading
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


# -- the agreement at a real TCPStore on loopback: the members, their order, who is left out and when ---------------


@pytest.fixture
def store_address():
    """A fresh TCPStore on loopback standing in for heal_store (the compose rendezvous store)."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield f"127.0.0.1:{server.port}"
    del server
    # The members' heartbeat threads end once the store is gone; one still inside the store's C++ call when the
    # interpreter exits aborts the process (exit 134), which a run of this test alone then reports as a failure.
    for thread in threading.enumerate():
        if thread.name == "heal-heartbeat":
            thread.join(timeout=10)


def _quorum(address, member_id, timeout_s=30.0, beat=False):
    from app.worker.heal import Quorum

    return Quorum(address, "job1", member_id, timeout_s=timeout_s, beat=beat)


def _agree_all(quorums, generation, members, previous):
    """Each quorum's ``agree`` in a thread of its own (the members are processes in real life): their answers."""
    import threading

    answers: dict[str, list] = {}
    errors: list[BaseException] = []

    def run(quorum, me):
        try:
            answers[me.id] = quorum.agree(generation, me, previous)
        except BaseException as e:  # noqa: BLE001 - the test's thread reports whatever it met
            errors.append(e)

    threads = [threading.Thread(target=run, args=(q, m), daemon=True) for q, m in zip(quorums, members, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return answers


def test_a_quorum_publishes_its_incarnation_and_world_for_newcomers_to_find(store_address):
    """Before any world: no incarnation, no generation, no members. Rank 0 publishes world 0 and names the live
    incarnation; a newcomer's reader finds both, and a world torchrun starts again (another incarnation) reads none of
    the last one's keys."""
    q = _quorum(store_address, "a")
    assert q.current() is None and q.generation() is None and q.published(0) == []
    members = [Member("a", 3, 0), Member("b", 3, 1)]
    q.enter("a")
    q.publish(0, members)
    assert q.current() is None  # entered, not yet published as the live one
    q.enter("a", publish=True)
    reader = _quorum(store_address, "")
    assert reader.current() == "a"
    reader.enter(reader.current())
    assert reader.generation() == 0 and reader.published(0) == members and reader.published(1) == []
    reader.enter("z")  # another incarnation of the job
    assert reader.generation() is None and reader.published(0) == []
    from app.worker.heal import Quorum

    assert Quorum(store_address, "job2", "", timeout_s=5, beat=False).current() is None  # another job's: none


def test_a_quorum_member_beats_its_heartbeat_and_a_reader_does_not(store_address):
    from app.worker.heal import Heartbeats

    member = _quorum(store_address, "a", beat=True)
    reader = _quorum(store_address, "", beat=False)
    first = reader.store.add(reader.heartbeat_key("a"), 0)
    deadline = time.monotonic() + 30
    while reader.store.add(reader.heartbeat_key("a"), 0) == first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reader.store.add(reader.heartbeat_key("a"), 0) > first
    assert reader.store.add(reader.heartbeat_key(""), 0) == 0  # the reader's own never moves
    beats = Heartbeats(reader, ["a", "gone"])
    assert beats.alive("gone")  # not silent for STALE_SECONDS yet: given the benefit of the doubt
    del member


def test_every_member_of_the_last_world_takes_the_same_world_in_rank_order(store_address):
    """Three survivors that all register agree on one world: the most steps first, then by old rank; a newcomer
    that asked in is last; each candidate reads the one winning proposal."""
    ids = ["a", "b", "c", "new"]
    quorums = [_quorum(store_address, i, beat=True) for i in ids]  # alive however late a thread starts
    for q in quorums:
        q.enter("a")
    me = [Member("a", 4, 0), Member("b", 5, 1), Member("c", 4, 2), Member("new", -1, -1)]
    answers = _agree_all(quorums, 1, me, previous=["a", "b", "c"])
    expected = [Member("b", 5, 1), Member("a", 4, 0), Member("c", 4, 2), Member("new", -1, -1)]
    assert answers == {i: expected for i in ids}


def test_the_agreement_waits_for_a_member_whose_heartbeat_moves(store_address):
    """A member of the last world that still beats but registers late is waited for, not left out."""
    import threading

    late = _quorum(store_address, "c", beat=True)  # its heartbeat moves all along
    quorums = [_quorum(store_address, i) for i in "ab"]
    for q in (*quorums, late):
        q.enter("a")
    result: dict = {}
    waiter = threading.Thread(
        target=lambda: result.update(_agree_all(quorums, 1, [Member("a", 4, 0), Member("b", 4, 1)], ["a", "b", "c"])),
        daemon=True,
    )
    waiter.start()
    deadline = time.monotonic() + 30
    while late.store.add(late.key("q1/n"), 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # both others registered: only c is missing
    assert waiter.is_alive()
    got = late.agree(1, Member("c", 4, 2), ["a", "b", "c"])
    waiter.join(60)
    assert [m.id for m in got] == ["a", "b", "c"] and result == {"a": got, "b": got}


def test_a_member_whose_heartbeat_stands_still_is_left_out_of_the_next_world(store_address, monkeypatch):
    from app.worker import heal

    monkeypatch.setattr(heal, "STALE_SECONDS", 0.3)
    quorums = [_quorum(store_address, i, beat=True) for i in "ab"]  # alive however late a thread starts
    answers = _agree_all(quorums, 1, [Member("a", 4, 0), Member("b", 4, 1)], previous=["a", "b", "gone"])
    assert answers == {i: [Member("a", 4, 0), Member("b", 4, 1)] for i in "ab"}


def test_a_join_request_is_pending_once_a_newcomer_registers_for_the_next_world(store_address):
    """Rank 0's step control polls ``join_pending``: nothing before a newcomer registers for world g + 1, then yes
    (and a request for a later world is not one for this)."""
    q = _quorum(store_address, "a")
    q.enter("a")
    assert not q.join_pending(0)
    q.store.add(q.key("q2/n"), 1)
    assert not q.join_pending(0) and q.join_pending(1)
    q.store.add(q.key("q1/n"), 1)
    assert q.join_pending(0)


@pytest.fixture
def restore_logging():
    """``Healer._form`` sets the log's tag for the new rank (``setup_logging``, which replaces the root handlers)."""
    import logging

    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)


def _config(address, **settings):
    return TrainConfig(heal="in_place", heal_store=address, effective_batch=64, device="cpu", **settings)


def test_a_process_without_world_size_is_a_newcomer_only_when_a_world_is_live(store_address, monkeypatch):
    """``Healer.connect``: no live incarnation at the store, or a rank torchrun started (WORLD_SIZE set): not a
    newcomer; a process no launcher gave a world, with a live one at the store: a newcomer, reading that one."""
    from app.worker.heal import Healer

    cfg = _config(store_address, rendezvous_timeout_seconds=5)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not Healer.connect(cfg, "job1").joining  # no world formed yet
    q = _quorum(store_address, "a")
    q.enter("a", publish=True)
    q.publish(0, [Member("a", 2, 0)])
    newcomer = Healer.connect(cfg, "job1")
    assert newcomer.joining and newcomer.quorum.generation() == 0 and newcomer.since is not None
    monkeypatch.setenv("WORLD_SIZE", "2")
    ranked = Healer.connect(cfg, "job1")
    assert not ranked.joining and ranked.quorum.generation() is None and ranked.since is None


def test_a_newcomer_is_refused_by_a_finished_job_and_by_a_world_whose_ranks_are_gone(store_address):
    """No world to join: the job finished (at once), or no member with a state came before the deadline (the
    newcomers alone are no world): one line each, and no process group is formed."""
    import torch.distributed as dist

    from app.worker.config import WorldEnv
    from app.worker.heal import Healer

    q = _quorum(store_address, "a")
    q.enter("a", publish=True)
    q.publish(0, [Member("a", 2, 0), Member("b", 2, 1)])  # nobody beats: its ranks are gone
    cfg = _config(store_address, rendezvous_timeout_seconds=0.5)
    newcomer = Healer(cfg, _quorum(store_address, "new", timeout_s=0.5), joining=True)
    newcomer.quorum.enter("a")
    world = WorldEnv(rank=0, local_rank=0, world_size=1, local_world_size=1)
    with pytest.raises(
        RuntimeError, match=r"^no live world at heal_store=127.0.0.1:\d+ to join \(its ranks are gone\)"
    ):
        newcomer.join_world(world)
    q.store.set(q.key("finished"), "1")
    with pytest.raises(RuntimeError, match=r"^the job at heal_store=127.0.0.1:\d+ has finished: no world to join"):
        newcomer.join_world(world)
    assert not dist.is_initialized()


def test_a_lone_survivor_forms_the_next_world_and_publishes_it(store_address, monkeypatch, restore_logging):
    """A heal where the other member is gone: the survivor agrees on a world of itself (once the other's heartbeat
    stood still), forms a real group of 1 under that world's keys, and publishes it as rank 0 for newcomers."""
    import torch
    import torch.distributed as dist

    from app.worker import heal

    monkeypatch.setattr(heal, "STALE_SECONDS", 0.3)
    q = _quorum(store_address, "b")
    q.enter("a", publish=True)
    q.publish(0, [Member("a", 6, 0), Member("b", 5, 1)])
    healer = heal.Healer(_config(store_address, rendezvous_timeout_seconds=30), q, joining=False)
    ctx = healer._enter(Member("b", 5, 1), torch.device("cpu"), "gloo", local_rank=3)
    try:
        assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend) == (0, 3, 1, "gloo")
        assert dist.get_world_size() == 1
        assert healer.generation == 1 and healer.members == [Member("b", 5, 1)]
        assert q.generation() == 1 and q.published(1) == [Member("b", 5, 1)]
    finally:
        dist.destroy_process_group()


def test_a_heal_asks_for_the_generation_after_the_newest_published(store_address, monkeypatch, restore_logging):
    """A member left out of world g (too late to its agreement) asks for g + 1, never for a generation already
    taken: the newest published one decides, whatever this member saw last."""
    import torch
    import torch.distributed as dist

    from app.worker import heal

    monkeypatch.setattr(heal, "STALE_SECONDS", 0.3)
    q = _quorum(store_address, "c")
    q.enter("a", publish=True)
    q.publish(0, [Member("a", 6, 0)])
    q.publish(4, [Member("a", 6, 0)])  # the world has healed four times meanwhile
    healer = heal.Healer(_config(store_address, rendezvous_timeout_seconds=30), q, joining=False)
    ctx = healer._enter(Member("c", 6, 2), torch.device("cpu"), "gloo", local_rank=0)
    try:
        assert ctx.world_size == 1 and healer.generation == 5 and q.published(5) == [Member("c", 6, 2)]
    finally:
        dist.destroy_process_group()


def test_a_step_after_a_heal_says_how_long_the_heal_took_once(caplog):
    """The first step that finishes after a failure (or a newcomer's start) logs what it waited for, once; the
    step's data position is committed (a heal from here rewinds nothing)."""
    from types import SimpleNamespace

    from app.worker.heal import Healer

    class Batches:
        def state_dict(self):
            return {"position": 12}

    healer = Healer(TrainConfig(), quorum=None, joining=True)
    trainer = SimpleNamespace(step_index=7, step=SimpleNamespace(batches=Batches()))
    healer.before_step(trainer)
    assert healer.data_state == {"position": 12}
    with caplog.at_level("WARNING", logger="app.train"):
        healer.after_step(trainer)
        healer.after_step(trainer)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and re.match(r"heal: step 7 finished \d+\.\d\d s after this rank asked to join", lines[0])
    assert healer.data_state is None
    assert Healer(TrainConfig(), quorum=None, joining=False).since is None  # a rank of the first world: no line


def test_only_rank_0_tells_the_store_the_job_finished(store_address):
    from types import SimpleNamespace

    from app.worker.heal import Healer, job_finished

    q = _quorum(store_address, "a")
    q.enter("a", publish=True)
    healer = Healer(TrainConfig(), q, joining=False)
    healer.leave(SimpleNamespace(ctx=SimpleNamespace(rank=1)))
    assert not job_finished(store_address, "job1")
    healer.leave(SimpleNamespace(ctx=SimpleNamespace(rank=0)))
    assert job_finished(store_address, "job1") and not job_finished(store_address, "job2")


class _Batches:
    """The data position a trainer's step keeps (``state_dict``/``load_state_dict``, as the real dealer has)."""

    def __init__(self, position):
        self.position = position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def _trainer(seed_offset: int, step_index: int, position: int, rank: int = 0):
    from types import SimpleNamespace

    import torch

    torch.manual_seed(seed_offset)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    for _ in range(seed_offset):
        schedule.step()
    step = SimpleNamespace(model=model, optimizer=optimizer, batches=_Batches(position), lr_schedule=schedule,
                           grad_scaler=None)  # fmt: skip
    return SimpleNamespace(step=step, step_index=step_index, ctx=SimpleNamespace(rank=rank),
                           control=SimpleNamespace(poll=None))  # fmt: skip


def test_the_source_state_gives_a_newcomer_the_parameters_optimizer_schedule_and_data_position():
    """What rank 0 sends: a member that loads it holds rank 0's parameters, optimizer state (momentum), learning
    rate schedule and data position where its step began, not its own."""
    import torch

    from app.worker.heal import load_source_state, source_state

    source, newcomer = _trainer(1, step_index=9, position=40), _trainer(3, step_index=0, position=0)
    state = source_state(source, {"position": 36})
    assert state["step"] == 9 and state["data"] == {"position": 36} and state["grad_scaler"] is None
    assert source_state(source, None)["data"] == {"position": 40}  # no step under way: where it stands
    load_source_state(newcomer, state)
    for got, want in zip(newcomer.step.model.parameters(), source.step.model.parameters(), strict=True):
        torch.testing.assert_close(got, want)
    momentum = [newcomer.step.optimizer.state[p]["momentum_buffer"] for p in newcomer.step.model.parameters()]
    for got, p in zip(momentum, source.step.model.parameters(), strict=True):
        torch.testing.assert_close(got, source.step.optimizer.state[p]["momentum_buffer"])
    assert newcomer.step.lr_schedule.state_dict() == source.step.lr_schedule.state_dict()
    assert newcomer.step.batches.position == 36


def test_a_healed_member_takes_the_newest_step_rewinds_its_data_and_reseeds(store_address):
    """After the agreement: every member takes rank 0's step count, rewinds its data to where the failed step began
    (the steps agree: nobody sends) and reseeds as a resume onto another world size does; rank 0 polls for
    newcomers, the others never do."""
    import torch
    import torch.distributed as dist

    from app.worker.heal import Healer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = TrainConfig(seed=11)
        q = _quorum(store_address, "a")
        healer = Healer(cfg, q, joining=False)
        trainer = _trainer(1, step_index=5, position=44)
        healer.members, healer.data_state = [Member("a", 4, 1)], {"position": 40}
        healer._sync_state(trainer)
        assert trainer.step_index == 4 and trainer.step.batches.position == 40
        assert torch.initial_seed() == 11 + 0 + 1_000_003 * 4
        assert trainer.control.poll == healer._poll
        # The steps differ (b's last collective failed where a's completed, and a failed in its next step): rank 0
        # sends its state, and rewinds its own data to where its failed step began, as every member does.
        healer.members = [Member("a", 4, 0), Member("b", 3, 1)]
        healer.data_state, trainer.step.batches.position = {"position": 40}, 44
        before = [p.detach().clone() for p in trainer.step.model.parameters()]
        healer._sync_state(trainer)
        assert trainer.step_index == 4 and trainer.step.batches.position == 40
        assert all(torch.equal(a, b) for a, b in zip(before, trainer.step.model.parameters(), strict=True))
        healer.data_state, trainer.step.batches.position = None, 44  # failed between steps: nothing to rewind
        healer._sync_state(trainer)
        assert trainer.step.batches.position == 44
        other = _trainer(1, step_index=5, position=44, rank=1)
        other.ctx.rank = 1
        healer.members, healer.data_state = [Member("a", 4, 0)], None
        healer._sync_state(other)  # rank 1 of the same agreement (its steps agree): no poll of its own
        assert other.control.poll() == 0 and other.step.batches.position == 44
    finally:
        dist.destroy_process_group()


def test_a_member_too_late_for_a_world_joins_the_next_one_with_its_members(store_address, monkeypatch):
    """A survivor whose agreement was decided without it (too late) waits for that world to be published, then
    asks for the next one as a newcomer (its old rank no longer counts) and is taken in with the world's members;
    well before its deadline. (Its process group is another process's business: the group of two is not formed.)"""
    import threading

    from app.worker import heal

    monkeypatch.setattr(heal, "STALE_SECONDS", 0.3)
    rank0 = _quorum(store_address, "a", beat=True)
    rank0.enter("a", publish=True)
    rank0.publish(0, [Member("a", 3, 0), Member("late", 3, 1)])
    assert rank0.agree(1, Member("a", 3, 0), previous=["a", "late"]) == [Member("a", 3, 0)]  # late's beat stood still

    late = heal.Healer(_config(store_address, rendezvous_timeout_seconds=60), _quorum(store_address, "late"), False)
    late.quorum.enter("a")
    formed: list = []
    monkeypatch.setattr(late, "_form", lambda generation, members, *_: formed.append((generation, members)))
    started = time.monotonic()
    entering = threading.Thread(target=late._enter, args=(Member("late", 3, 1), None, "gloo", 0), daemon=True)
    entering.start()
    deadline = time.monotonic() + 30
    while rank0.store.add(rank0.key("q1/n"), 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # late has registered for world 1, and found it decided without it
    rank0.publish(1, [Member("a", 3, 0)])  # world 1's rank 0, once formed
    while not rank0.join_pending(1) and time.monotonic() < deadline:
        time.sleep(0.01)  # rank 0's step control sees the request ...
    world2 = rank0.agree(2, Member("a", 3, 0), previous=["a"])  # ... and the world agrees on the next one
    entering.join(60)
    assert world2 == [Member("a", 3, 0), Member("late", 3, -1)]
    assert formed == [(2, world2)]
    assert time.monotonic() - started < 30  # not its 60 s deadline


def test_rank_0s_poll_says_1_once_a_newcomer_asks_for_the_world_after_its_own(store_address):
    """What rank 0's step control carries to every rank: 0 while nobody asks in, 1 once a newcomer registers for
    the world after the one that trains now (not for one already formed)."""
    from app.worker.heal import Healer

    q = _quorum(store_address, "a")
    q.enter("a", publish=True)
    healer = Healer(TrainConfig(), q, joining=False)
    healer.generation = 2
    assert healer._poll() == 0
    q.store.add(q.key("q2/n"), 1)  # a registration for world 2, which formed already
    assert healer._poll() == 0
    q.store.add(q.key("q3/n"), 1)
    assert healer._poll() == 1


def test_the_first_world_publishes_itself_for_newcomers_under_rank_0s_id(store_address, caplog):
    """``attach`` in the first world (a real gloo group of one): its members are every rank's id with the steps it
    starts from, the incarnation is named by rank 0's id, and generation 0 and the live incarnation are published
    (a newcomer finds both); rank 0 polls for newcomers. A newcomer's ``attach`` instead takes the state and says
    which world it joined, at which step."""
    import torch.distributed as dist

    from app.worker.heal import Healer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        q = _quorum(store_address, "first-id")
        healer = Healer(TrainConfig(), q, joining=False)
        trainer = _trainer(1, step_index=6, position=0)
        trainer.ctx.world_size = 1
        healer.attach(trainer)
        assert healer.members == [Member("first-id", 6, 0)]
        reader = _quorum(store_address, "")
        assert reader.current() == "first-id"
        reader.enter("first-id")
        assert reader.generation() == 0 and reader.published(0) == [Member("first-id", 6, 0)]
        assert trainer.control.poll == healer._poll

        newcomer = Healer(TrainConfig(), _quorum(store_address, "new"), joining=True)
        newcomer.members = [Member("first-id", 6, 0)]  # as _form left them: the world it was taken into
        joined = _trainer(2, step_index=0, position=0)
        with caplog.at_level("WARNING", logger="app.train"):
            newcomer.attach(joined)
        assert joined.step_index == 6 and "rank 0 joined a world of 1 at step 6" in caplog.text
    finally:
        dist.destroy_process_group()


def test_a_newcomer_joins_a_world_that_has_committed_no_step_yet(store_address, monkeypatch):
    """A world at its very start (its members at step 0) is a live world with a state to give: a newcomer asking in
    then is taken in, not told that the world's ranks are gone."""
    import threading

    from app.worker import heal

    rank0 = _quorum(store_address, "a", beat=True)
    rank0.enter("a", publish=True)
    rank0.publish(0, [Member("a", 0, 0)])
    newcomer = heal.Healer(_config(store_address, rendezvous_timeout_seconds=60), _quorum(store_address, "new"), True)
    newcomer.quorum.enter("a")
    formed: list = []
    monkeypatch.setattr(newcomer, "_form", lambda generation, members, *_: formed.append((generation, members)))
    errors: list = []

    def enter() -> None:
        try:
            newcomer._enter(Member("new", -1, -1), None, "gloo", 0)
        except RuntimeError as e:
            errors.append(e)

    entering = threading.Thread(target=enter, daemon=True)
    entering.start()
    deadline = time.monotonic() + 30
    while not rank0.join_pending(0) and time.monotonic() < deadline:
        time.sleep(0.01)
    world = rank0.agree(1, Member("a", 0, 0), previous=["a"])
    entering.join(60)
    assert errors == [] and world == [Member("a", 0, 0), Member("new", -1, -1)] and formed == [(1, world)]
