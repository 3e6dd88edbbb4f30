"""tools/docker_cli.py, the one way tests, drills and benches run Docker: against the real engine where one answers."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tools.docker_cli import DockerFailed, compose, docker, stamp


def engine() -> None:
    if shutil.which("docker") is None or docker("info", check=False, timeout=30).returncode != 0:
        pytest.skip("no Docker engine answers here")


def test_a_failing_docker_command_names_itself_and_dockers_reason():
    engine()
    with pytest.raises(DockerFailed) as e:
        docker("inspect", "ddp-no-such-container-here")
    said = str(e.value)
    assert said.startswith("docker inspect ddp-no-such-container-here: exit 1: ") and "no such" in said.lower()
    assert isinstance(e.value, subprocess.SubprocessError)  # what the callers that skip on failure catch
    assert docker("inspect", "ddp-no-such-container-here", check=False).returncode == 1


def test_compose_runs_in_the_checkout_whatever_the_callers_folder(tmp_path, monkeypatch):
    engine()
    monkeypatch.chdir(tmp_path)
    out = compose("ddp-docker-cli-unit", {"PATH": "/usr/bin:/bin"}, "config", "--services", plain=True, timeout=60)
    assert "worker" in out.stdout.split() and "rendezvous" in out.stdout.split()


def test_stamp_reads_dockers_nanosecond_timestamps():
    assert stamp("2026-12-04T22:51:17.123456789Z worker-1 | hello") == pytest.approx(1796424677.123456, abs=1e-6)
    assert stamp("2026-12-04T22:51:17Z") == 1796424677.0
    assert stamp("no time here") is None
