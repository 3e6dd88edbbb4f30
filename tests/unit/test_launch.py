"""app.cluster.launch's decisions, each exit code of the launcher's paths, without an agent running.

What a user reads in ``docker compose ps``: 0 for a finished run or a clean stop on request, 2 for a setting no retry
can fix, 1 for anything else, and one line per event. The same paths with real agents and trainers run in
tests/integration/test_launch.py; these pin every branch of the decision in milliseconds.

.venv/bin/python -m pytest tests/unit/test_launch.py
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from app.cli import first_line
from app.cluster.elastic import Reporter
from app.cluster.launch import LaunchError, _one_line, expected_workers, outcome_of_failure, outcome_of_stop
from app.exit_codes import BAD_CONFIG, FAILED, OK

STORE = ("store", 29400)


def reporter(exit_codes: dict[int, int | None]) -> Reporter:
    r = Reporter(store=None, run_id="job", workers=None)
    r.exit_codes = exit_codes
    return r


@pytest.mark.parametrize(
    ("exit_codes", "code", "says"),
    [
        ({}, OK, "no trainer ran"),  # stopped while waiting for the world
        ({0: 0}, OK, "the trainer checkpointed"),
        ({0: 0, 1: 0}, OK, "the trainer checkpointed"),
        ({0: 0, 1: 1}, FAILED, "but the trainer exited 1 (failed)"),  # one of two trainers failed: no clean stop
        ({0: -9, 1: 0}, FAILED, "but the trainer was killed by SIGKILL"),
    ],
)
def test_a_stop_on_request_exits_zero_only_when_every_trainer_did(exit_codes, code, says, caplog):
    with caplog.at_level(logging.INFO, logger="app.cluster.launch"):
        assert outcome_of_stop(reporter(exit_codes), "SIGTERM") == code
    assert says in caplog.text and f"exit {code}" in caplog.text


@pytest.mark.parametrize(
    ("codes", "code"),
    [([BAD_CONFIG], BAD_CONFIG), ([BAD_CONFIG, BAD_CONFIG], BAD_CONFIG), ([1], FAILED), ([BAD_CONFIG, 1], FAILED)],
)
def test_a_failure_is_a_bad_configuration_only_when_every_trainer_said_so(codes, code):
    failures = {rank: SimpleNamespace(exitcode=c) for rank, c in enumerate(codes)}
    assert outcome_of_failure(failures, reporter({})) == code


@pytest.mark.parametrize("raw", ["abc", "0", "5", "-1", "2.5"])
def test_workers_outside_the_range_is_one_line_and_exit_2(raw):
    with pytest.raises(LaunchError) as e:
        expected_workers(4, {"WORKERS": raw})
    assert e.value.code == BAD_CONFIG
    assert str(e.value).startswith(f"WORKERS={raw}: a world holds 1..4 workers") and "\n" not in str(e.value)


def test_workers_in_the_range_or_unset_is_taken():
    assert [expected_workers(4, {"WORKERS": w}) for w in ("1", " 4 ")] == [1, 4]
    assert expected_workers(4, {}) is None and expected_workers(4, {"WORKERS": ""}) is None


def record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("torch.distributed.elastic", logging.ERROR, __file__, 1, msg, None, None)


def test_torchs_reports_are_cut_to_one_line_and_its_worker_exit_note_dropped():
    assert not _one_line(record("failed (exitcode: 1) local_rank: 0 (pid: 7) of binary: python"))
    long = record("Closing the rendezvous.\nTraceback (most recent call last):\n  ...")
    assert _one_line(long) and long.getMessage() == "Closing the rendezvous. [LOGLEVEL=DEBUG: full report]"
    short = record("rendezvous round 2 complete")
    assert _one_line(short) and short.getMessage() == "rendezvous round 2 complete"


def test_an_error_is_told_by_its_first_line_and_one_that_says_nothing_by_its_type():
    # Every one-line report of the launchers and the trainer (the rendezvous, an unusable checkpoint, a store not up).
    assert first_line(RuntimeError("\n  connect() timed out\n  at c10d/TCPStore.cpp:42\n")) == "connect() timed out"
    assert first_line(TimeoutError()) == "TimeoutError"  # str() is "": a line must still name something
    assert first_line("  \n") == "" and first_line("one\ntwo") == "one"


def test_a_node_recognises_itself_and_only_itself():
    r = Reporter(store=None, run_id="job", workers=None)
    r.local_id = 3
    me = SimpleNamespace(addr=r.me, pid=os.getpid(), local_id=3)
    assert r.is_me(me)
    for other in (
        SimpleNamespace(addr=r.me + "x", pid=os.getpid(), local_id=3),  # another container
        SimpleNamespace(addr="a" + r.me, pid=os.getpid(), local_id=3),
        SimpleNamespace(addr=r.me, pid=os.getpid() + 1, local_id=3),  # a previous launcher in this container
        SimpleNamespace(addr=r.me, pid=os.getpid(), local_id=2),  # this launcher's previous rendezvous identity
    ):
        assert not r.is_me(other)


@pytest.mark.parametrize(
    ("argv", "fork", "forked"),
    [
        (["-m", "app.train", "--steps", "5"], True, True),
        (["-m", "app.train"], False, False),  # LAUNCH_FORK=0: a new interpreter, as torchrun
        (["-m", "mypkg.train"], True, False),  # another module may leave its process in ways the agent cannot follow
        (["train.py"], True, False),
        (["--no-python", "app.train"], True, False),
    ],
)
def test_only_app_train_is_forked_and_only_unless_told_not_to(argv, fork, forked, monkeypatch):
    import torch.distributed.run as torchrun

    from app.cluster.forked_trainer import fork_trainers, run_trainer

    monkeypatch.setattr(torchrun, "run_script_path", torchrun.run_script_path)  # undone after the test
    args = torchrun.parse_args(["--standalone", "--nproc-per-node=2", *argv])
    assert fork_trainers(args, fork) is forked
    _, cmd, cmd_args = torchrun.config_from_args(args)
    if forked:  # torchrun's own function entrypoint, forked: run_trainer("app.train", *the trainer's arguments)
        assert (cmd, cmd_args, args.start_method) == (run_trainer, ["app.train", "--steps", "5"], "fork")
    else:
        assert not callable(cmd) and args.start_method == "spawn", (cmd, cmd_args)


def test_a_gpu_build_of_torch_starts_its_trainers_as_new_interpreters(monkeypatch):
    # CUDA does not survive a fork: a CUDA (or ROCm) build of torch keeps torchrun's way, whatever the device.
    import torch
    import torch.distributed.run as torchrun

    from app.cluster.forked_trainer import fork_trainers

    monkeypatch.setattr(torchrun, "run_script_path", torchrun.run_script_path)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    args = torchrun.parse_args(["--standalone", "-m", "app.train"])
    assert not fork_trainers(args) and not args.run_path


def test_replicas_checking_one_checkpoint_dir_at_once_do_not_trip_over_each_other(tmp_path, monkeypatch):
    """Compose replicas share the checkpoint volume and, each in its own container, often the launcher's PID: two
    probing the directory at the same moment must not take each other's probe file (one deleting it while the
    other still writes it made a healthy directory fail with ENOENT). Threads stand for the containers here: one
    PID for all, a host name each."""
    import socket
    import threading

    from app.cluster.launch import check_checkpoint_dir

    monkeypatch.setattr(os, "getpid", lambda: 7)
    monkeypatch.setattr(socket, "gethostname", lambda: threading.current_thread().name)
    start, errors = threading.Barrier(2), []

    def replica() -> None:
        for _ in range(300):
            start.wait()
            try:
                check_checkpoint_dir(str(tmp_path))
            except LaunchError as e:
                errors.append(str(e))

    threads = [threading.Thread(target=replica, name=f"container-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == []  # every probe file removed


def test_a_failed_world_is_told_by_the_doctors_line_from_its_own_dumps_only(tmp_path, caplog):
    """The launcher's line after a trainer fails in a collective (app.cluster.elastic.Reporter.diagnosis): the
    doctor over the dumps this world wrote to the checkpoint volume; dumps older than the world are not its own."""
    import time

    import torch

    from app.diagnostics.recorder import FlightRecorder

    reporter = Reporter(store=None, run_id="job", workers=None, config=SimpleNamespace(checkpoint_dir=str(tmp_path)))
    reporter.world_started = time.time()
    waiting = FlightRecorder(capacity=8)  # rank 0 waits in an all-reduce that rank 1 (stopped) never joins
    waiting.configure(rank=0, world_size=2, dump_dir=tmp_path / "flight", job="job", world_id="w1")
    waiting.start("all_reduce", None, torch.zeros(256), "DDP bucket 0")
    time.sleep(1.1)  # in flight past the doctor's HANG_MIN_S
    waiting.dump("collective timeout")
    with caplog.at_level(logging.INFO, logger="app.cluster.launch"):
        reporter.workers_failed({0: SimpleNamespace(exitcode=1)})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("doctor: ")]
    assert len(lines) == 1 and "rank 1 left no dump" in lines[0] and "all_reduce #1" in lines[0], caplog.text
    caplog.clear()
    reporter.world_started = time.time() + 5  # a later world: those dumps are an earlier failure's
    with caplog.at_level(logging.INFO, logger="app.cluster.launch"):
        reporter.workers_failed({0: SimpleNamespace(exitcode=1)})
    assert "doctor:" not in caplog.text


def test_a_failure_that_is_not_the_stores_is_told_as_itself():
    from app.cluster.launch import explain

    assert explain(ValueError("bad shape (3, 4)\nmore"), STORE, "job") == "ValueError: bad shape (3, 4)"


@pytest.mark.parametrize("what", ["connection", "message"])
def test_a_lost_store_is_named_with_its_address(what):
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from app.cluster.launch import explain

    e = RendezvousConnectionError("gone") if what == "connection" else RuntimeError("the TCP store went away")
    assert explain(e, STORE, "job").startswith("lost the rendezvous store store:29400 (")


@pytest.mark.parametrize("code, says", [(-1, "was killed by SIGHUP"), (-9, "was killed by SIGKILL"), (2, "bad config")])
def test_an_exit_by_signal_is_named_by_its_signal(code, says):
    from app.cluster.launch import describe_exit

    assert says in describe_exit(code)


@pytest.mark.parametrize(
    "flags, address",
    [
        (["--rdzv-backend=c10d", "--rdzv-endpoint=store:29500"], ("store", 29500)),
        (["--rdzv-backend=c10d", "--rdzv-endpoint=store"], ("store", 29400)),  # torchrun's default port
        (["--standalone", "--rdzv-backend=c10d", "--rdzv-endpoint=store:29500"], None),  # the agent hosts its own
        (["--rdzv-backend=static", "--rdzv-endpoint=store:29500"], None),  # no c10d store to wait for
        (["--rdzv-backend=c10d"], None),
    ],
)
def test_the_launcher_waits_for_the_c10d_store_only_where_one_is_named(flags, address):
    from torch.distributed.run import parse_args

    from app.cluster.launch import store_address

    assert store_address(parse_args([*flags, "--nnodes=1:2", "-m", "app.train"])) == address


def test_a_store_port_that_is_not_a_number_is_one_line_and_exit_2():
    from torch.distributed.run import parse_args

    from app.cluster.launch import LaunchError, store_address

    with pytest.raises(LaunchError, match="--rdzv-endpoint='store:abc': give HOST:PORT") as e:
        store_address(parse_args(["--rdzv-backend=c10d", "--rdzv-endpoint=store:abc", "-m", "app.train"]))
    assert e.value.code == 2


def test_only_a_lost_store_is_waited_for_not_an_ended_job_a_join_timeout_or_a_spare():
    """What the launcher retries after waiting for the store (app.cluster.launch.run_rejoining): a store that went
    away. A closed rendezvous (the job ended) or a spare at the end must end the container, and a join timeout has
    its own retry (a RendezvousTimeoutError), without waiting for a store that is there."""
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    from app.cluster.elastic import SpareAtTheEnd
    from app.cluster.launch import store_lost

    assert store_lost(RendezvousConnectionError("the store is gone"))
    assert not store_lost(RendezvousClosedError("the rendezvous store says closed"))
    assert not store_lost(RendezvousTimeoutError("timed out waiting for the store's participants"))
    assert not store_lost(SpareAtTheEnd())
    assert not store_lost(ValueError("bad shape"))


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_is_left_to_torchrun_by_the_early_look_at_the_job_id(flag, capsys):
    """``launch --help`` must show torchrun's options: the parser that reads --rdzv-id before torch is imported
    must neither print its own two options nor exit."""
    from app.cluster.launch import job_state
    from app.worker.config.launch import LaunchConfig

    assert job_state([flag, "--rdzv-id", "job"], LaunchConfig()).dir is None  # no LAUNCH_STATE_DIR here: nothing kept
    assert capsys.readouterr().out == ""


def test_a_checkpoint_dir_without_room_for_the_next_save_is_refused_before_training(tmp_path):
    """The launcher's storage check: the newest step file's size against the free space (a sparse file of 8 TiB
    stands for a checkpoint bigger than the disk), ZeRO's shards summed, hidden temp files not counted."""
    from app.cluster.launch import LaunchError, check_checkpoint_dir, newest_checkpoint_bytes

    (tmp_path / "step-00000010.pt").write_bytes(b"x" * 300)
    (tmp_path / "step-00000020.pt").write_bytes(b"x" * 200)
    (tmp_path / ".step-00000030.pt.tmp").write_bytes(b"x" * 5000)
    assert newest_checkpoint_bytes(str(tmp_path)) == 200
    shards = tmp_path / "zero"
    shards.mkdir()
    for name, size in [("manifest.json", 10), ("shard-0.pt", 100), ("shard-1.pt", 120)]:
        (shards / name).write_bytes(b"x" * size)
    assert newest_checkpoint_bytes(str(shards)) == 230
    check_checkpoint_dir(str(tmp_path))  # room enough: nothing said
    check_checkpoint_dir("")  # no checkpoints
    check_checkpoint_dir(str(tmp_path / "not yet"))  # the trainer creates it
    try:
        with open(tmp_path / "step-00000040.pt", "wb") as f:
            f.truncate(8 * 2**40)
    except OSError:
        pytest.skip("this file system cannot hold an 8 TiB sparse file")
    with pytest.raises(LaunchError, match=r"has \d+ bytes free, its newest checkpoint took 8796093022208") as e:
        check_checkpoint_dir(str(tmp_path))
    assert e.value.code == 1


def test_the_newest_checkpoint_size_counts_only_finished_checkpoint_files(tmp_path):
    # ZeRO's layout (shards and a manifest, no step-*.pt): every finished file counts, a writer's hidden temp file
    # and a directory do not; with step files, only the newest one counts.
    from app.cluster.launch import newest_checkpoint_bytes

    (tmp_path / "manifest.json").write_bytes(b"m" * 10)
    (tmp_path / "shard-0.pt").write_bytes(b"s" * 20)
    (tmp_path / ".shard-1.pt.tmp").write_bytes(b"t" * 1000)
    (tmp_path / "older").mkdir()
    assert newest_checkpoint_bytes(str(tmp_path)) == 30
    (tmp_path / "step-00000005.pt").write_bytes(b"a" * 7)
    (tmp_path / "step-00000010.pt").write_bytes(b"b" * 9)
    assert newest_checkpoint_bytes(str(tmp_path)) == 9


REDUNDANT_CONTAINER = """
import os, sys
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState
from app.cluster.elastic import Reporter
from app.worker.config.launch import LaunchConfig

reporter = Reporter(None, "job", None, settings=LaunchConfig(redundant_grace_seconds=0.5))
reporter.local_id = 7
state = _RendezvousState()  # torch's own: its join puts a member past MAX on the redundancy list
node = _NodeDesc(reporter.me, os.getpid(), 7) if sys.argv[1] == "me" else _NodeDesc("other", 1, 7)
state.redundancy_list.add(node)
reporter.state = lambda: state
reporter.watch_redundancy(4, refuse=lambda reason: print("refused:", reason, flush=True))
"""


def test_a_container_past_max_workers_exits_2_after_the_grace_period_and_only_that_one():
    def watch(who: str) -> subprocess.Popen:
        argv = [sys.executable, "-c", REDUNDANT_CONTAINER, who]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    redundant, member = watch("me"), watch("other")
    out, err = redundant.communicate(timeout=60)
    assert redundant.returncode == 2, err
    assert "refused: one container more than the world's maximum of 4 workers (MAX_WORKERS)" in out
    assert "scale to at most 4" in err
    assert member.poll() is None, "a container in the world must not be told it is one too many"
    member.kill()
    member.communicate()


def test_an_unreadable_rendezvous_state_is_none_with_its_cause_in_the_debug_log(caplog):
    # The reporter's reads are a courtesy (never break the agent), so the traceback at debug level is all that is
    # left to find why the reports went quiet.
    reporter = Reporter(("127.0.0.1", 1), "job", None)

    def store_gone():
        raise ConnectionResetError("the store went away")

    reporter._read = store_gone
    with caplog.at_level(logging.DEBUG, logger="app.cluster.launch"):
        assert reporter.state() is None
    assert str(caplog.records[-1].exc_info[1]) == "the store went away"


def test_the_newest_checkpoint_size_is_the_newest_complete_one_of_either_kind(tmp_path):
    # Sharded saves each in their own directory: the newest complete one is summed (shards and manifest), an
    # unfinished newer one (no manifest) and the older plain files are not.
    from app.cluster.launch import newest_checkpoint_bytes

    (tmp_path / "step-00000004.pt").write_bytes(b"p" * 7)
    done = tmp_path / "sharded-step-00000006"
    done.mkdir()
    (done / "shard-00000-of-00002-ab.pt").write_bytes(b"s" * 40)
    (done / "shard-00001-of-00002-ab.pt").write_bytes(b"s" * 50)
    (done / "manifest.json").write_bytes(b"m" * 10)
    unfinished = tmp_path / "sharded-step-00000008"
    unfinished.mkdir()
    (unfinished / "shard-00000-of-00002-cd.pt").write_bytes(b"u" * 1000)
    assert newest_checkpoint_bytes(str(tmp_path)) == 100
