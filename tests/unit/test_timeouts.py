"""The timeouts' order (app/worker/config/timeouts.py): a setting that breaks it is refused at start in one line
naming both values, exit 2; the launch files this project ships are in order.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from app.worker.config import ConfigError, TrainConfig
from app.worker.config.timeouts import check_launch_timeouts, rdzv_timeouts
from tests.trainer_run import REPO, clean_env

COMPOSE_RDZV = "join_timeout=120,last_call_timeout=15,close_timeout=10,keep_alive_interval=2,keep_alive_max_attempt=5"


@pytest.mark.parametrize(
    ("settings", "short", "long"),
    [
        ({"stop_timeout_seconds": 1.5}, "checkpoint_timeout_seconds=2", "stop_timeout_seconds=1.5"),
        ({"collective_timeout_seconds": 2}, "checkpoint_timeout_seconds=2", "collective_timeout_seconds=2"),
        (
            {"checkpoint_timeout_seconds": 30, "stop_timeout_seconds": 60, "collective_timeout_seconds": 20},
            "checkpoint_timeout_seconds=30",
            "collective_timeout_seconds=20",
        ),
    ],
)
def test_a_checkpoint_write_longer_than_what_waits_for_it_is_refused(settings, short, long):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**settings)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{short} (") and f"shorter than {long} (" in line, line


def test_the_defaults_and_a_long_checkpoint_with_room_for_it_are_accepted():
    TrainConfig()
    TrainConfig(checkpoint_timeout_seconds=60, stop_timeout_seconds=90, collective_timeout_seconds=300)


def test_the_worker_exits_2_with_the_one_line():
    run = subprocess.run(
        [sys.executable, "-m", "app.train", "--stop-timeout-seconds", "1", "--metrics-port", "0"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == (
        "config error: checkpoint_timeout_seconds=2 (one checkpoint write) must be shorter than "
        "stop_timeout_seconds=1 (a stop's final save must fit in it); lower checkpoint_timeout_seconds or raise "
        "stop_timeout_seconds (docs/diagnostics.md#timeouts)"
    ), run.stderr


@pytest.mark.parametrize(
    ("conf", "collective", "short", "long"),
    [
        (COMPOSE_RDZV, 5, "keep_alive_interval x keep_alive_max_attempt=10", "collective_timeout_seconds=5"),
        ("join_timeout=8,keep_alive_interval=2,keep_alive_max_attempt=5", 300, "=10 ", "join_timeout=8"),
        ("join_timeout=20,last_call_timeout=30", 300, "last_call_timeout=30", "join_timeout=20"),
        ("keep_alive_interval=60", 120, "keep_alive_max_attempt=180", "collective_timeout_seconds=120"),  # x3: torch's
    ],
)
def test_rendezvous_timeouts_out_of_order_are_refused_naming_both(conf, collective, short, long):
    with pytest.raises(ConfigError) as e:
        check_launch_timeouts(conf, collective)
    assert short in str(e.value) and f"shorter than {long} (" in str(e.value), str(e.value)


def test_the_shipped_launch_settings_are_in_order():
    compose = (REPO / "compose.yaml").read_text()
    conf = re.search(r"--rdzv-conf=(\S+)", compose)[1].replace("${RDZV_LAST_CALL_SECONDS:-15}", "15")
    assert conf == COMPOSE_RDZV
    collective = TrainConfig().collective_timeout_seconds
    check_launch_timeouts(conf, collective)
    check_launch_timeouts(conf, 30)  # make drills' collective timeout (tests/e2e/drills/drills.py)
    k8s = re.search(r"--rdzv-conf=([\w=.,]+)", (REPO / "k8s/elastic/kustomization.yaml").read_text())[1]
    check_launch_timeouts(k8s, collective)
    assert rdzv_timeouts(k8s)["join_timeout"] == 900


def test_the_rendezvous_defaults_assumed_are_torchs_own():
    # A launcher without --rdzv-conf gets torch's defaults: the order is checked against those, so they must be
    # what torch's c10d handler really takes (read off a real one, not its docs).
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    params = RendezvousParameters("c10d", "127.0.0.1:0", "job", 1, 1)
    settings = create_handler(store, C10dRendezvousBackend(store, "job"), params).settings
    torchs = {
        "join_timeout": settings.timeout.join.total_seconds(),
        "last_call_timeout": settings.timeout.last_call.total_seconds(),
        "close_timeout": settings.timeout.close.total_seconds(),
        "keep_alive_interval": settings.keep_alive_interval.total_seconds(),
        "keep_alive_max_attempt": float(settings.keep_alive_max_attempt),
    }
    assert rdzv_timeouts("") == torchs
