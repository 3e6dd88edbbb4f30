"""heal=in_place's refusals and the new world's rank order (app.worker.heal; the heal itself, on real ranks with a
real kill: tests/integration/test_heal.py)."""

from __future__ import annotations

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


def test_the_launchers_exit_barrier_counts_the_newest_healed_world_not_torchruns():
    """app.cluster.elastic's exit barrier waits for as many containers as the newest world at heal_store holds: after
    a heal from 3 to 2, two (the lost launcher never arrives); heal=restart, or no world there: torch's own."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from app.cluster.elastic import Reporter
    from app.worker.heal import Quorum, newest_world_size

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{server.port}"
    assert newest_world_size(address, "job1") is None
    # Quorum's own writes, without its heartbeat thread (which would outlive this test's store).
    quorum = SimpleNamespace(store=server, base="heal/job1/", prefix="heal/job1/")
    quorum.key = lambda name: quorum.prefix + name
    members = [Member(i, 4, r) for r, i in enumerate("abc")]
    Quorum.enter(quorum, "a")
    Quorum.publish(quorum, 0, members)
    Quorum.enter(quorum, "a", publish=True)
    assert newest_world_size(address, "job1") == 3
    Quorum.publish(quorum, 1, members[:2])  # the world healed to 2
    assert newest_world_size(address, "job1") == 2 and newest_world_size(address, "job2") is None
    healed = TrainConfig(heal="in_place", heal_store=address, effective_batch=64)
    assert Reporter(None, "job1", 3, healed).healed_agents(local_world_size=1) == 2
    assert Reporter(None, "job1", 3, TrainConfig()).healed_agents(local_world_size=1) is None
    gone = TrainConfig(heal="in_place", heal_store="127.0.0.1:1", effective_batch=64)
    assert Reporter(None, "job1", 3, gone).healed_agents(local_world_size=1) is None  # torch's barrier then
