"""The launchers' LAUNCH_* settings (app.worker.config.launch): read once, each bad one a one-line ConfigError."""

from __future__ import annotations

import pytest

from app.worker.config import ConfigError
from app.worker.config.launch import LaunchConfig


def test_unset_and_empty_variables_keep_the_defaults_and_set_ones_reach_their_field():
    assert LaunchConfig.from_environ({"PATH": "/bin", "LAUNCH_PEERS": ""}) == LaunchConfig()
    got = LaunchConfig.from_environ(
        {"LAUNCH_STORE_WAIT_SECONDS": " 2.5 ", "LAUNCH_PEERS": "worker", "LAUNCH_FORK": "0", "LAUNCH_STATE_DIR": "/s"}
    )
    assert (got.store_wait_seconds, got.peers, got.fork, got.state_dir) == (2.5, "worker", False, "/s")


@pytest.mark.parametrize(
    "environ, says",
    [
        ({"LAUNCH_STORE_LOST_SECONDS": "2m"}, "LAUNCH_STORE_LOST_SECONDS='2m': must be a number of seconds >= 0"),
        ({"LAUNCH_REDUNDANT_GRACE_SECONDS": "nan"}, "LAUNCH_REDUNDANT_GRACE_SECONDS=nan: must be a number"),
        ({"LAUNCH_FIRST_WORLD_HOLD_SECONDS": "-1"}, "LAUNCH_FIRST_WORLD_HOLD_SECONDS=-1.0: must be a number"),
        ({"LAUNCH_FORK": "true"}, "LAUNCH_FORK='true': must be 1 (on) or 0 (off)"),
        ({"LAUNCH_STORE_WAIT": "5"}, "LAUNCH_STORE_WAIT: no such launcher setting; did you mean"),
    ],
)
def test_a_bad_value_or_an_unknown_name_is_one_line_naming_the_variable(environ, says):
    with pytest.raises(ConfigError) as e:
        LaunchConfig.from_environ(environ)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_the_defaults_are_the_ones_docs_cluster_md_gives():
    """docs/cluster.md names each wait with its default ("`LAUNCH_PEERS_WAIT_SECONDS`, 90"): a launcher run without
    the variable waits that long; forking the trainer is on unless LAUNCH_FORK=0; nothing is recorded and no peers
    are waited for unless named."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "cluster.md").read_text()
    documented = {name: float(value) for name, value in re.findall(r"`(LAUNCH_[A-Z_]+)`(?:, | \()(\d+)\)", text)}
    assert len(documented) >= 4, documented
    defaults = LaunchConfig()
    for name, value in documented.items():
        assert getattr(defaults, name.removeprefix("LAUNCH_").lower()) == value, name
    assert defaults.fork is True and defaults.peers == "" and defaults.state_dir == ""
    assert LaunchConfig.from_environ({"LAUNCH_FORK": "1"}).fork is True
