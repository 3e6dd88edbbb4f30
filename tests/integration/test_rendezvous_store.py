"""app.cluster.rendezvous_store for real: a TCPStore server that torchrun's c10d rendezvous meets at; its restart rule.

.venv/bin/python -m pytest tests/test_rendezvous_store.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.trainer_run import free_port, start_module

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def start_store(port: int, *args: str) -> subprocess.Popen:
    """The store, serving (``start_module``: forked from a template that has imported torch, which the store needs;
    the ``--check`` runs stay fresh interpreters: the health check imports no torch)."""
    proc = start_module(
        "app.cluster.rendezvous_store", "--host", "127.0.0.1", "--port", str(port), *args, env=dict(os.environ)
    )
    deadline = time.monotonic() + 60
    while (
        subprocess.run(
            [sys.executable, "-m", "app.cluster.rendezvous_store", "--check", f"127.0.0.1:{port}"], cwd=ROOT
        ).returncode
        != 0
    ):
        assert proc.poll() is None, output(proc)
        assert time.monotonic() < deadline, "the store did not answer within 60 s"
        time.sleep(0.5)
    return proc


def output(proc: subprocess.Popen) -> str:
    """Everything the store wrote, stdout then stderr (its log), once it has exited."""
    return proc.stdout.read() + proc.stderr.read()


def job(port: int, run_id: str) -> subprocess.CompletedProcess:
    """A one-node torchrun job that meets at the store and runs `true`."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            TORCHRUN,
            "--nnodes=1",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
            "--no-python",
            "true",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_health_check_answers_only_while_a_store_serves():
    port = free_port()
    check = [sys.executable, "-m", "app.cluster.rendezvous_store", "--check", f"127.0.0.1:{port}"]
    assert subprocess.run(check, cwd=ROOT).returncode == 1
    proc = start_store(port)
    try:
        assert subprocess.run(check, cwd=ROOT).returncode == 0
    finally:
        proc.terminate()  # SIGTERM: PID 1 of a container gets this from `docker stop`
        assert proc.wait(timeout=10) == 0


def test_store_exits_once_its_job_ends_so_a_restart_serves_the_next_run():
    port = free_port()
    proc = start_store(port, "--restart-after-job", "job-a")
    try:
        assert job(port, "job-a").returncode == 0
        # Closed at the end of the job: the store leaves (exit 0) for its restart policy to bring it back empty.
        assert proc.wait(timeout=30) == 0
        assert "job 'job-a' ended" in output(proc)
        proc = start_store(port, "--restart-after-job", "job-a")
        assert job(port, "job-a").returncode == 0, "the same run id must train again on the fresh store"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_without_the_restart_a_finished_run_id_is_refused():
    # What the restart is for: torchrun refuses to join a rendezvous whose job has ended.
    port = free_port()
    proc = start_store(port)
    try:
        assert job(port, "job-b").returncode == 0
        second = job(port, "job-b")
        assert second.returncode != 0 and "RendezvousClosedError" in second.stderr
        assert proc.poll() is None, "without --restart-after-job the store keeps serving"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_bad_port_is_a_one_line_error():
    result = subprocess.run(
        [sys.executable, "-m", "app.cluster.rendezvous_store", "--port", "70000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --port 70000 is not a TCP port; give 1-65535"
