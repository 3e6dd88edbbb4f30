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
