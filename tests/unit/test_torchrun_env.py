"""app.worker.config.torchrun_env: the elastic range a worker reads from torchrun's --nnodes, in each form it
comes in, and what a worker assumes when there is none (the command-line forms: tests/unit/test_config.py)."""

from __future__ import annotations

import pytest

from app.worker.config import WorldEnv

TWO_PER_NODE = {"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize(
    ("nnodes", "expected"),
    [
        ("3", (6, 6)),  # a static --nnodes N: MIN = MAX = N nodes of 2 ranks
        ("1:4", (2, 8)),
        ("two", (6, 6)),  # not a number: the world size, as without a range
        ("2:x", (6, 6)),
    ],
)
def test_the_elastic_range_is_nnodes_times_the_ranks_per_node(nnodes, expected):
    world = WorldEnv.from_environ({**TWO_PER_NODE, "PET_NNODES": nnodes})
    assert (world.min_world_size, world.max_world_size) == expected


def test_a_worker_of_torchrun_without_nnodes_takes_torchruns_default_of_one_node():
    """Under torchrun (TORCHELASTIC_RUN_ID) with no --nnodes on its command line (this test's parent has none):
    torchrun's default, one node, however large the world; without torchrun, the world as it is."""
    world = WorldEnv.from_environ({**TWO_PER_NODE, "TORCHELASTIC_RUN_ID": "job"})
    assert (world.min_world_size, world.max_world_size) == (2, 2)
    plain = WorldEnv.from_environ(TWO_PER_NODE)
    assert (plain.min_world_size, plain.max_world_size) == (6, 6)


def test_a_flag_given_last_with_no_value_is_no_value(monkeypatch, tmp_path):
    """torchrun's command line as /proc/<parent>/cmdline holds it: --nnodes=V, --nnodes V, or a --nnodes that ends
    the line (no value: none read), or no such file (not Linux): none."""
    from app.worker.config import torchrun_env

    cmdline = tmp_path / "cmdline"
    real_open = open

    def parents(path, *args, **kwargs):
        return real_open(cmdline if str(path).startswith("/proc/") else path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", parents)
    for argv, value in (
        (["torchrun", "--nnodes=2:4", "-m", "app.train"], "2:4"),
        (["torchrun", "--nnodes", "3", "-m", "app.train"], "3"),
        (["torchrun", "-m", "app.train", "--nnodes"], None),
        (["torchrun", "--nnodes-x=2", "-m", "app.train"], None),
    ):
        cmdline.write_bytes("".join(a + "\0" for a in argv).encode())  # the kernel ends each with a NUL
        assert (torchrun_env._parent_flag("--nnodes") or None) == value, argv
    cmdline.unlink()
    assert torchrun_env._parent_flag("--nnodes") is None
