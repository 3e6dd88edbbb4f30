"""What the Docker tests need, checked once per session before the first of them runs.

A Docker test (marked ``docker``; the modules in ``DOCKER_MODULES`` are marked automatically) needs:

- a Docker client whose engine answers (``docker info``);
- Compose v2 (``docker compose version``);
- where the build uses the local stand-ins (``BASE_IMAGE=local/...``, as the Makefile picks when
  ``../shared/docker/setup-engine.sh`` exists): that base image in the engine, and a wheelhouse in
  ``docker/wheels/`` that holds every requirement of ``docker/requirements.txt`` (torch at its pinned version),
  because ``compose.local.yaml`` builds with ``pip install --no-index``.

``make docker-setup`` prepares all of it (idempotent: seconds when done). When something is missing, each Docker
test skips with one line that names the missing part and that command, and the summary repeats it once; under
``CI=true`` the same line fails those tests instead, since CI must run them. What is checked here would otherwise
surface minutes later as an error deep inside ``docker compose build`` ("No matching distribution found for
torch==2.13.0").
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.cluster_files import LOCAL_BASE, ROOT, SETUP_ENGINE
from tools.docker_cli import docker

# Test modules that start containers; others (static checks, promtool) run without Docker.
DOCKER_MODULES = {
    "test_compose_cluster.py",
    "test_k8s_emulation.py",
    "test_chaos.py",
    "test_compose_pipeline.py",
    "test_failure_drills.py",
}
WHEELHOUSE = ROOT / "docker/wheels"
REQUIREMENTS = ROOT / "docker/requirements.txt"
SETUP_HINT = "run `make docker-setup`"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "docker: needs a Docker engine with Compose v2 and the image's inputs")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).name in DOCKER_MODULES:
            item.add_marker(pytest.mark.docker)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("docker") is None:
        return
    problem = docker_problem()
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{problem} (CI=true: the Docker tests must run, not skip)", pytrace=False)
    pytest.skip(problem)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    skipped = [
        r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "longrepr", None) and _is_ours(r.longrepr)
    ]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} Docker tests skipped: {docker_problem()}", yellow=True)


def _is_ours(longrepr) -> bool:
    message = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return SETUP_HINT in message and docker_problem() is not None and docker_problem() in message


# Each training step of an e2e run lasts at least this long (TrainConfig.min_step_seconds): a run of N steps then
# spans N x 20 ms or more whatever the machine, long enough for the scrapes, the spare's refusal or the loss a test
# waits for. MiniMLP steps took 20-60 ms on one kind of 2-core machine and 5 ms on a faster kind, where unpaced runs
# ended first; on a slower machine the pace adds nothing.
STEP_PACE_SECONDS = "0.02"


def build_settings() -> tuple[str, str]:
    """(BASE_IMAGE, COMPOSE_FILE) as the Makefile chooses them: the local stand-ins where the setup script exists."""
    base = os.environ.get("BASE_IMAGE") or (LOCAL_BASE if SETUP_ENGINE.exists() else "python:3.11-slim")
    compose_file = os.environ.get("COMPOSE_FILE") or (
        "compose.yaml:compose.local.yaml" if base.startswith("local/") else "compose.yaml"
    )
    return base, compose_file


@functools.cache
def docker_problem() -> str | None:
    """None when the Docker tests can run; otherwise one line: what is missing, and the command that fixes it."""
    if shutil.which("docker") is None:
        return f"no docker client: {SETUP_HINT}"
    if _docker("info").returncode != 0:
        return f"no Docker engine answers `docker info`: {SETUP_HINT}"
    version = _docker("compose", "version", "--short")
    if version.returncode != 0 or not version.stdout.strip().lstrip("v").startswith("2"):
        return f"Docker Compose v2 (`docker compose`) missing: {SETUP_HINT}"
    base, compose_file = build_settings()
    if base.startswith("local/") and _docker("image", "inspect", base).returncode != 0:
        return f"base image {base} not in the engine: {SETUP_HINT}"
    if "compose.local.yaml" in compose_file:  # offline build: pip install --no-index from docker/wheels/
        missing = missing_wheels(WHEELHOUSE, REQUIREMENTS)
        if missing:
            where = WHEELHOUSE.relative_to(ROOT)
            return f"{where}/ lacks {', '.join(missing)} for the offline image build: {SETUP_HINT}"
    return None


def _docker(*args: str) -> subprocess.CompletedProcess:
    try:
        return docker(*args, timeout=30, check=False)
    except subprocess.TimeoutExpired:  # an engine that hangs is one that does not answer
        return subprocess.CompletedProcess(args, 124, "", "timed out")


def missing_wheels(wheelhouse: Path, requirements: Path) -> list[str]:
    """The requirements (``name==version`` or ``name>=version``) that no wheel in ``wheelhouse`` satisfies.

    Args:
        wheelhouse: a folder of ``*.whl`` files.
        requirements: a pip requirements file with one pinned or lower-bounded name per line.

    Example::

        missing_wheels(Path("docker/wheels"), Path("docker/requirements.txt"))  # ['torch==2.13.0'] when empty
    """
    from packaging.version import Version

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "_", name).lower()

    available: dict[str, list[Version]] = {}
    for wheel in wheelhouse.glob("*.whl") if wheelhouse.is_dir() else []:
        name, version = wheel.name.split("-")[:2]
        available.setdefault(norm(name), []).append(Version(version.split("+")[0]))
    missing = []
    for line in requirements.read_text().splitlines():
        line = line.split("#")[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(==|>=)\s*([\w.]+)", line)
        if not m:
            continue
        name, op, wanted = m[1], m[2], Version(m[3])
        versions = available.get(norm(name), [])
        if not any(v == wanted if op == "==" else v >= wanted for v in versions):
            missing.append(line)
    return missing
