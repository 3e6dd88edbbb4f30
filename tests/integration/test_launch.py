"""app.cluster.launch (torchrun's engine with readable outcomes): exit codes and one-line reasons, real agents.

Each test runs ``python -m app.cluster.launch`` as compose does (torchrun's flags), real trainer processes on loopback:
0 for a finished run and for a stop on request that checkpointed (plain torchrun: 1), 2 for a bad setting whether the
launcher or the trainer finds it (plain torchrun: 1 after a ChildFailedError report), 1 with one line naming the store
when the rendezvous store is unreachable. No line of the launcher's output is a Python traceback.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.test_resume import small_disk  # noqa: F401 - the fixture: a 200 KiB tmpfs that fills up
from tests.trainer_run import clean_env, free_port, run_module, start_module, wait_for_lines, worker_args

pytestmark = pytest.mark.timeout(600)


def launch(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    # The launcher forked from a template that has imported torch (tests/trainer_run.py): it starts its trainers
    # as torchrun does, each its own interpreter.
    return run_module("app.cluster.launch", *args, timeout=timeout, env=clean_env(**env))


def start_launch(*args: str, **env: str):
    return start_module("app.cluster.launch", *args, env=clean_env(**env))


def start_store(port: int):
    """The compose file's rendezvous store on loopback, once it listens (as test_rendezvous_store.start_store, from
    the template: its own start is tested there)."""
    store = start_module("app.cluster.rendezvous_store", "--host", "127.0.0.1", "--port", str(port))
    wait_for_lines(store, store.stderr, f"rendezvous store listening on 127.0.0.1:{port}", timeout=120)
    return store


def assert_no_traceback(output: str) -> None:
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]


def test_a_finished_run_exits_zero():
    out = launch("--standalone", "--nproc-per-node=2", "-m", "app.train", "--steps", "3", "--metrics-port", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("FINISHED") == 2
    assert "the workers finished: exit 0" in out.stderr


@pytest.mark.parametrize(
    "args, says",
    [
        (["--standalone", "--nproc-per-node=1", "-m", "app.train", "--lr", "-1"], "config error: lr=-1.0"),
        (["--nnodes=3:1", "--nproc-per-node=1", "-m", "app.train"], "--nnodes='3:1'"),
        (  # the store would drop a silent agent only after its peers gave up on it
            ["--standalone", "--nproc-per-node=1", "--rdzv-conf=keep_alive_interval=10,keep_alive_max_attempt=5"]
            + ["-m", "app.train", "--collective-timeout-seconds", "30"],
            "config error: keep_alive_interval x keep_alive_max_attempt=50",
        ),
    ],
)
def test_a_setting_the_launcher_checks_exits_two_in_one_line(args, says):
    out = launch(*args)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and says in errors[0], out.stderr[-3000:]


@pytest.mark.parametrize(
    "variable, value, says",
    [
        ("LAUNCH_STORE_WAIT_SECONDS", "soon", "LAUNCH_STORE_WAIT_SECONDS='soon': must be a number of seconds >= 0"),
        ("LAUNCH_PEERS_WAIT_SECONDS", "-5", "LAUNCH_PEERS_WAIT_SECONDS=-5.0: must be a number of seconds >= 0"),
        ("LAUNCH_FORK", "yes", "LAUNCH_FORK='yes': must be 1 (on) or 0 (off)"),
        ("LAUNCH_FORK_TRAINER", "0", "LAUNCH_FORK_TRAINER: no such launcher setting; did you mean LAUNCH_FORK?"),
    ],
)
def test_a_bad_launch_variable_exits_two_naming_it_and_writes_nothing(tmp_path, variable, value, says):
    state = tmp_path / "state"
    env = {"LAUNCH_STATE_DIR": str(state), variable: value}
    out = launch("--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1", "-m", "app.train", **env)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line.split("ERROR ", 1)[1] for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and errors[0].startswith(says), out.stderr
    assert not state.exists()  # refused before anything is recorded: the fix is picked up by the next start


def test_a_setting_only_the_trainer_can_check_still_exits_two_and_is_not_restarted():
    # effective_batch < world size is known only once the world is: the trainers exit 2, and so must the launcher,
    # without spending its restarts on a refusal that every restart would repeat (a checkpoint of another kind, a
    # shard that fails its digest: the same path).
    out = launch(
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=2",
        "-m",
        "app.train",
        "--effective-batch",
        "1",
        "--metrics-port",
        "0",
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "bad configuration" in out.stderr
    assert "leaving the world to re-form it" not in out.stderr, out.stderr[-3000:]
    assert_no_traceback(out.stderr)


def test_an_unreachable_store_is_named_within_the_wait():
    port = free_port()
    started = time.monotonic()
    out = launch(
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=t",
        "-m",
        "app.train",
        LAUNCH_STORE_WAIT_SECONDS="2",
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"rendezvous store 127.0.0.1:{port} unreachable for 2 s" in out.stderr
    assert time.monotonic() - started < 120  # the import of torch, then 2 s: not torchrun's minutes of retries
    assert_no_traceback(out.stderr)


def test_a_stop_on_request_that_checkpointed_exits_zero(tmp_path):
    proc = start_launch(
        *("--standalone", "--nproc-per-node=2", "-m", "app.train", "--steps", "100000", "--metrics-port", "0"),
        *("--checkpoint-dir", str(tmp_path), "--log-every", "1000"),
    )
    try:
        wait_for_lines(proc, proc.stderr, "INFO step 1/", timeout=240)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "stopped on request (SIGTERM): the trainer checkpointed; exit 0" in err
    assert list(tmp_path.glob("step-*.pt")), "no checkpoint written on the stop"


def children(pid: int) -> dict[int, tuple[str, str]]:
    """pid -> (process name, command line) of each child process of ``pid``."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if entry.name.isdigit() and int(stat.rpartition(")")[2].split()[1]) == pid:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                found[int(entry.name)] = (stat.partition("(")[2].rpartition(")")[0], cmdline)
        except OSError:
            continue  # ended meanwhile
    return found


@pytest.mark.parametrize("fork", ["1", "0"])
def test_the_trainers_are_forked_from_the_launcher_unless_told_not_to(tmp_path, fork):
    # Forked (app/cluster/forked_trainer.py), a trainer does not import torch again: it is the launcher's child,
    # named app.train. LAUNCH_FORK=0: a new interpreter, `python -u -m app.train`, as plain torchrun.
    proc = start_launch(
        *("--standalone", "--nproc-per-node=2", "-m", "app.train", "--steps", "100000", "--metrics-port", "0"),
        *("--checkpoint-dir", str(tmp_path), "--log-every", "1000"),
        LAUNCH_FORK=fork,
    )
    try:
        wait_for_lines(proc, proc.stderr, "INFO step 1/", timeout=240)
        trainers = children(proc.pid)
        launcher = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert len(trainers) == 2, trainers
    if fork == "1":
        assert {name for name, _ in trainers.values()} == {"app.train"}, trainers
        assert {cmd for _, cmd in trainers.values()} == {launcher}, (launcher, trainers)  # no exec of its own
    else:
        assert all(
            cmd.endswith(
                "-u -m app.train --steps 100000 --metrics-port 0 --checkpoint-dir "
                + str(tmp_path)
                + " --log-every 1000"
            )
            for _, cmd in trainers.values()
        ), trainers
    # Either way, the stop on request ends as before: both trainers checkpoint and exit 0, and so does the launcher.
    assert proc.returncode == 0, err[-3000:]
    assert "stopped on request (SIGTERM): the trainer checkpointed; exit 0" in err
    assert err.count("SIGTERM: stopped at step") == 2 and list(tmp_path.glob("step-*.pt")), err[-3000:]


# -- what a new start finds (app/cluster/job_state.py): `up` again after a refusal -----------------------------------
def c10d_args(port: int, *trainer: str) -> list[str]:
    """The compose workers' flags (a fixed --rdzv-id: --standalone would draw a new one each time)."""
    return [
        "--nnodes=1",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=job-state-test",
        "-m",
        "app.train",
        "--metrics-port",
        "0",
        *trainer,
    ]


def test_a_refused_container_started_again_exits_2_in_one_line(tmp_path):
    # The config is checked before the store is dialled: no store needed (nothing listens on this port).
    args = c10d_args(free_port(), "--steps", "3")
    first = launch(*args, LAUNCH_STATE_DIR=str(tmp_path), DDP_STESP="10")
    assert first.returncode == 2, first.stderr[-3000:]
    assert "DDP_STESP: no such setting (did you mean DDP_STEPS?)" in first.stderr
    again = launch(*args, LAUNCH_STATE_DIR=str(tmp_path), DDP_STESP="10")
    assert again.returncode == 2, again.stderr[-3000:]
    lines = [line for line in again.stderr.splitlines() if "[launch" in line]
    assert len(lines) == 1 and "refused before, with these same settings" in lines[0], again.stderr[-3000:]
    # Fixed settings are a new launch, not a repeat of the refusal: it gets as far as the (absent) store.
    fixed = launch(*args, LAUNCH_STATE_DIR=str(tmp_path), DDP_STEPS="10", LAUNCH_STORE_WAIT_SECONDS="1")
    assert fixed.returncode == 1 and "unreachable for 1 s" in fixed.stderr, fixed.stderr[-3000:]


def test_a_join_that_times_out_is_tried_again_within_the_budget_then_ends_in_one_line(tmp_path):
    # Docker restarts no worker: the launcher itself joins again after a join timeout (here: a world of 2 that only
    # this container comes to), --max-restarts times, then exits 1 with the one line.
    port = free_port()
    store = start_store(port)
    try:
        args = c10d_args(port, "--steps", "3")
        args[0] = "--nnodes=2"
        # The store's heartbeat (1 s x 2) within the 3 s join timeout, as the launcher's timeout check asks.
        args.insert(0, "--rdzv-conf=join_timeout=3,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2")
        args.insert(0, "--max-restarts=1")
        out = launch(*args)
    finally:
        store.terminate()
        store.wait(30)
    assert out.returncode == 1, out.stderr[-3000:]
    assert_no_traceback(out.stderr)
    lines = [line for line in out.stderr.splitlines() if "[launch" in line and "no world formed in time" in line]
    assert len(lines) == 2 and "then joining again (1 of 1)" in lines[0], out.stderr[-3000:]
    assert lines[1].endswith(": exit 1"), out.stderr[-3000:]


def test_a_store_that_crashes_and_comes_back_is_joined_again_and_the_run_finishes(tmp_path):
    # What compose's store-crash does, in one process: no Docker restart, the launcher waits for the new, empty
    # store on the same address and its agent joins a world there, resuming from the checkpoint.
    port = free_port()
    store = start_store(port)
    ckpt = tmp_path / "ckpt"
    # Each step paced to at least 20 ms: still training when the agent notices the lost store, on a fast machine too
    # (unpaced, 300 steps took 0.4 s there and finished first).
    trainer = worker_args(
        "until_stopped", checkpoint_dir=ckpt, steps=300, checkpoint_every=5, log_every=10, min_step_seconds=0.02
    )
    args = c10d_args(port, *trainer)
    proc = start_launch("--max-restarts=1", *args, LAUNCH_STORE_LOST_SECONDS="60")
    try:
        wait_for_lines(proc, proc.stderr, "INFO step 10/", timeout=240)
        store.kill()
        store.wait(30)
        wait_for_lines(proc, proc.stderr, "then joining again (1 of 1)", timeout=120)
        store = start_store(port)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        store.terminate()
        store.wait(30)
    assert proc.returncode == 0, err[-3000:]
    assert out.count("FINISHED") == 1 and "INFO resumed from" in err, err[-3000:]


def test_a_container_started_again_after_its_job_finished_does_not_train_again(tmp_path):
    port = free_port()
    store = start_store(port)
    try:
        args = c10d_args(port, "--steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"))
        first = launch(*args, LAUNCH_STATE_DIR=str(tmp_path / "state"))
        assert first.returncode == 0 and first.stdout.count("FINISHED") == 1, first.stderr[-3000:]
        # The world's members, read from the store through the launcher's own client: who is which rank.
        assert re.search(r"joined a world of 1 as rank 0 \(round \d+; 0=\S+\)", first.stderr), first.stderr[-3000:]
        again = launch(*args, LAUNCH_STATE_DIR=str(tmp_path / "state"))
    finally:
        store.terminate()
        store.wait(30)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "FINISHED" not in again.stdout and "joined a world" not in again.stderr, again.stderr[-3000:]
    assert "job finished (step 3) while this container was part of it" in again.stderr, again.stderr[-3000:]


def test_a_full_checkpoint_disk_ends_the_launch_without_a_retry_and_a_restart_in_one_line(small_disk):  # noqa: F811
    ckpt = small_disk / "ckpt"
    trainer = worker_args("nan_drill", inject_nan_at_step=0, checkpoint_dir=ckpt, keep_checkpoints=5)
    args = ["--standalone", "--nproc-per-node=2", "--max-restarts=3", "-m", "app.train", *trainer]
    first = launch(*args)
    assert first.returncode == 1, first.stderr[-3000:]
    assert_no_traceback(first.stderr)
    assert "restarts left" not in first.stderr, first.stderr[-3000:]  # the agent formed no second world
    assert first.stderr.count("could not take the checkpoint of step") == 2, first.stderr[-3000:]  # one per rank
    gave_up = [line for line in first.stderr.splitlines() if "[launch" in line and " ERROR " in line]
    assert len(gave_up) == 1 and "could not write a checkpoint" in gave_up[0], first.stderr[-3000:]
    # What Docker's on-failure restart does next: the disk is still full, so the launch ends before any trainer.
    again = launch(*args)
    assert again.returncode == 1, again.stderr[-3000:]
    errors = [line for line in again.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"checkpoint_dir {ckpt} has" in errors[0], again.stderr[-3000:]
    assert "the next save would fail" in errors[0] and "joining" not in again.stderr, again.stderr[-3000:]


def test_a_peers_planned_departure_is_info_a_failure_a_warning(caplog):
    from types import SimpleNamespace

    from app.cluster.elastic import Reporter

    reporter = Reporter(store=None, run_id="t", workers=None)
    with caplog.at_level("INFO", logger="app.cluster.launch"):
        reporter.workers_failed({0: SimpleNamespace(exitcode=75), 1: SimpleNamespace(exitcode=1)})
    levels = {r.getMessage().split(") ", 1)[1]: r.levelname for r in caplog.records}
    assert levels == {"exited 75 (stopped with a departing peer, checkpointed)": "INFO", "exited 1 (failed)": "WARNING"}
