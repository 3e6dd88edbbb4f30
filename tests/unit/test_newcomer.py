"""app.cluster.newcomer, a container that comes to a live heal=in_place world: whether it joins as a newcomer, how
its launcher ends for each way its trainer ends (finished: the healed world's exit barrier and the job's record;
bad configuration: refused and recorded; failed: exit 1, or torchrun's path when the world is gone), and the stop
signals it forwards. Against a real TCPStore on loopback standing in for heal_store, and real child processes; the
whole container (a launcher joining a live world of real ranks): tests/integration/test_heal.py."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from app.cluster.job_state import JobState
from app.cluster.newcomer import failed, finished, live_world_to_join, wait_forwarding_signals
from app.worker.config import TrainConfig
from app.worker.heal import Member, Quorum

LOG = "app.cluster.launch"


@pytest.fixture
def world():
    """A store holding job1's live world of 2 (ids a, b) as its rank 0 publishes it, and ``beat()``: a thread that
    moves member a's heartbeat until the test ends (a world whose ranks train)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{server.port}"
    quorum = Quorum(address, "job1", "a", timeout_s=10, beat=False)
    quorum.enter("a", publish=True)
    quorum.publish(0, [Member("a", 3, 0), Member("b", 3, 1)])
    stop = threading.Event()

    def beat() -> None:
        def run() -> None:
            while not stop.wait(0.05):
                quorum.store.add(quorum.heartbeat_key("a"), 1)

        threading.Thread(target=run, daemon=True).start()

    yield SimpleNamespace(address=address, quorum=quorum, beat=beat)
    stop.set()
    del server


def config(address: str, **settings) -> TrainConfig:
    return TrainConfig(heal="in_place", heal_store=address, effective_batch=64, steps=9, **settings)


def args(nproc="1"):
    return SimpleNamespace(rdzv_id="job1", nproc_per_node=nproc)


@pytest.fixture
def job(tmp_path):
    state = JobState.in_dir(str(tmp_path), "job1", "here", "digest")
    state.arrived()
    return state


def test_a_container_joins_as_a_newcomer_only_under_heal_in_place_with_one_trainer_and_a_live_world(world):
    world.beat()
    assert live_world_to_join(args(), config(world.address)) == 2
    assert live_world_to_join(args("2"), config(world.address)) is None  # several trainers: torchrun's path
    assert live_world_to_join(args(), None) is None  # the launcher read no config (another script)
    assert live_world_to_join(args(), TrainConfig()) is None  # heal=restart
    assert live_world_to_join(SimpleNamespace(rdzv_id="job2", nproc_per_node=1), config(world.address)) is None


def test_a_newcomer_that_finished_waits_at_the_healed_worlds_barrier_and_records_the_finish(world, job, caplog):
    world.quorum.store.add(world.quorum.key("exit/n"), 1)  # the other container's launcher has arrived
    with caplog.at_level(logging.INFO, logger=LOG):
        assert finished(args(), config(world.address), job) == 0
    assert "waited for the 2 container(s) of the trainers' world" in caplog.text
    assert caplog.records[-1].getMessage() == "the workers finished: exit 0"
    assert job.finished_since_arrival()["step"] == 9  # a restart of this container ends 0 at once


def test_a_newcomer_with_no_world_at_its_barrier_still_finishes(world, job, caplog):
    lonely = config(world.address)
    with caplog.at_level(logging.INFO, logger=LOG):
        assert finished(SimpleNamespace(rdzv_id="job2"), lonely, job) == 0
    assert f"exit barrier at heal_store={world.address}: no world there to wait for" in caplog.text
    assert job.finished_since_arrival()["step"] == 9


def test_a_newcomers_bad_configuration_is_exit_2_and_recorded(world, job, caplog):
    with caplog.at_level(logging.INFO, logger=LOG):
        assert failed(args(), config(world.address), job, code=2) == 2
    assert caplog.records[-1].getMessage() == "bad configuration (the trainer's line above names the setting): exit 2"
    assert "refused its configuration" in job.refused_before()
    assert job.finished_since_arrival() is None


def test_a_newcomers_failure_in_a_live_world_is_exit_1_in_one_line(world, job, caplog):
    world.beat()
    with caplog.at_level(logging.INFO, logger=LOG):
        assert failed(args(), config(world.address), job, code=-9) == 1
    assert caplog.records[-1].getMessage() == "the newcomer's trainer (this container) was killed by SIGKILL: exit 1"
    assert job.finished_since_arrival() is None and job.refused_before() is None


def test_a_newcomer_whose_world_is_gone_goes_on_through_torchruns_rendezvous(world, job, caplog, monkeypatch):
    """Every rank's heartbeat stands still: the world is gone, and torchrun's path starts the next from the
    checkpoint (None: the launcher goes on)."""
    from app.worker import heal

    monkeypatch.setattr(heal, "STALE_SECONDS", 0.3)
    with caplog.at_level(logging.INFO, logger=LOG):
        assert failed(args(), config(world.address), job, code=1) is None
    assert "the world this container asked to join is gone: joining torchrun's rendezvous instead" in caplog.text
    assert job.finished_since_arrival() is None


def test_the_trainers_exit_code_is_the_launchers_to_read():
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert wait_forwarding_signals(child.pid) == (3, None)


def test_a_stop_signal_reaches_the_trainer_and_is_named(tmp_path):
    """docker stop (SIGTERM to the launcher, PID 1): the trainer gets it, checkpoints and exits; the launcher waits
    for it and knows it was stopped; its own handlers are back afterwards."""
    ready = tmp_path / "ready"
    script = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        f"pathlib.Path({str(ready)!r}).write_text('1')\n"
        "time.sleep(120)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script])
    before = signal.getsignal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    timer = threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        assert wait_forwarding_signals(child.pid) == (0, "SIGTERM")
    finally:
        timer.cancel()
        if child.poll() is None:
            child.kill()
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize(
    ("trainer_args", "code", "recorded"),
    [
        (["--help"], 0, "finished"),  # a trainer that ends 0 (its help: the cheapest real app.train that does)
        (["--parallel", "nope"], 2, "refused"),  # its config error: one line, exit 2
    ],
)
def test_a_newcomers_launcher_ends_with_its_trainers_exit_code(world, job, trainer_args, code, recorded, caplog):
    """The container's exit code is its trainer's (app.train run as a newcomer: no WORLD_SIZE), and the launcher
    records the ending a restart of the container must know: the job finished, or this configuration refused."""
    from app.cluster.newcomer import join_live_world
    from app.worker.config.launch import LaunchConfig

    world.quorum.store.add(world.quorum.key("exit/n"), 1)  # the other container's launcher, at the exit barrier
    launch_args = SimpleNamespace(rdzv_id="job1", nnodes="1:4", training_script_args=trainer_args)
    with caplog.at_level(logging.INFO, logger=LOG):
        got = join_live_world(launch_args, config(world.address), LaunchConfig(fork=False), job, size=2, high=4)
    assert got == code, caplog.text
    assert "joining its live world of 2 at heal_store" in caplog.text
    assert (job.finished_since_arrival() is not None) == (recorded == "finished")
    assert (job.refused_before() is not None) == (recorded == "refused")


def test_a_store_that_does_not_say_is_torchruns_path_with_its_traceback_at_debug(world, caplog):
    """heal_store answers with something no heal wrote (here: a generation that is not a number): the container
    goes through torchrun's rendezvous, and LOGLEVEL=DEBUG shows why, traceback included."""
    world.quorum.store.set(world.quorum.key("generation"), "not a number")
    with caplog.at_level(logging.DEBUG, logger=LOG):
        assert live_world_to_join(args(), config(world.address)) is None
    [record] = [r for r in caplog.records if r.getMessage() == f"cannot read heal_store={world.address}"]
    assert record.levelno == logging.DEBUG and record.exc_info[0] is ValueError
