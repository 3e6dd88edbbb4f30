"""Shared by every test folder: the markers, and the layout they stand for.

- ``tests/unit``: one process, no network, seconds in all (``make test-fast``).
- ``tests/integration``: real gloo ranks on loopback, torchrun, a real Prometheus (``-m integration``).
- ``tests/e2e``: Docker Compose and containers for real (``-m e2e``).

Each test is marked by the folder it sits in, so ``pytest -m "not e2e"`` selects without per-file decorators.

The long ones carry a marker of their own (``LONG``: the failure drills, the documented chaos run, the GPU check,
world drift) and run only when ``-m`` names it (``make drills`` is ``pytest -m drill ...``): a plain ``pytest`` or
``make test`` leaves them out, even ``-m e2e`` does, so CI stays within its minutes.

``make test`` runs the tests on several pytest-xdist workers (``-n``, ``--dist loadgroup``): most of the e2e tests'
time is waiting on containers, not on the two cores. The tests that share a module-scoped fixture (one cluster
start-up, asserted on by several tests) are put in one xdist group, so that start-up still happens once; the e2e
tests run in two lanes (``DOCKER_LANE``, and ``SECOND_DOCKER_LANE`` for the modules and tests in ``SECOND_LANE``).

CI (``.ci/run``) starts the tests while the Docker engine and the image are still being set up beside them: when
``DOCKER_SETUP_STATUS`` names a file, the e2e tests wait for that file (the setup's exit status) before the first of
them runs, and the unit and integration tests use the minutes in between.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


# Markers of tests that take long or need a GPU (pyproject.toml registers them): each runs only when -m names it.
LONG = ("drill", "chaos", "gpu", "drift")


# tryfirst: pytest-xdist's worker reads the xdist_group marks in its own hook of this name.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    leave_out_long(config, items)
    for item in items:
        folder = Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
        if folder in ("unit", "integration", "e2e"):
            item.add_marker(getattr(pytest.mark, folder))
    groups = shared_start_up_groups(items)
    for item in items:
        if "e2e" in item.keywords:
            module = Path(str(item.fspath)).name
            second = module in SECOND_LANE or f"{module}::{item.originalname}" in SECOND_LANE
            groups[item] = SECOND_DOCKER_LANE if second else DOCKER_LANE
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))


# Every Docker test on one xdist worker, one after the other, as when the suite runs in one process: they share one
# engine and the image its builds cache, and most of their time is spent waiting on containers, which the CPU-bound
# integration tests on the other workers fill.
DOCKER_LANE = "docker"
# But for a second lane beside it, on a worker of its own: once the other tests got cheaper, the Docker lane alone was
# CI's critical path. In it the chaos proof (tests/e2e/test_chaos.py, the longest: minutes of containers training,
# killed and brought back), the pipeline cluster, the user's model and two of the emulated pods' tests (a module, or
# one test of a module that shares no start-up between its tests), so that both lanes end about together (measured
# per worker with a timeline of each test's start and end, in a fresh clone under .ci/run): compose
# projects named by this process's id, their published ports drawn free (free_port), sharing nothing with the other
# lane.
SECOND_DOCKER_LANE = "docker-2"
SECOND_LANE = {
    "test_chaos.py",
    "test_compose_pipeline.py",
    "test_user_model.py",
    "test_k8s_emulation.py::test_a_lost_pod_is_replaced_and_its_replacement_waits_for_a_new_store",
    "test_k8s_emulation.py::test_an_evicted_pod_and_its_peers_spend_no_retry",
}


def leave_out_long(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect each test with a ``LONG`` marker that the ``-m`` expression does not name (as a word)."""
    named = set(re.findall(r"\w+", config.getoption("markexpr") or ""))
    left_out = [item for item in items if any(item.get_closest_marker(m) and m not in named for m in LONG)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        kept = set(items) - set(left_out)
        items[:] = [item for item in items if item in kept]


def shared_start_up_groups(items: list[pytest.Item]) -> dict[pytest.Item, str]:
    """Each test that uses a module- or class-scoped fixture, with a group name shared by every test of its module
    that it is linked to through such fixtures (directly or via another test), so xdist runs them on one worker and
    the fixture is set up once. Tests with only function- or session-scoped fixtures get no group: they spread."""
    root: dict[str, str] = {}  # union-find over "module::fixture" keys

    def find(key: str) -> str:
        while root.setdefault(key, key) != key:
            key = root[key]
        return key

    shared: dict[pytest.Item, list[str]] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs if info else {}
        keys = [
            f"{item.module.__name__}::{name}"
            for name in item.fixturenames
            if defs.get(name) and defs[name][-1].scope in ("module", "class", "package")
        ]
        if keys:
            shared[item] = keys
            for key in keys[1:]:
                root[find(key)] = find(keys[0])
    return {item: find(keys[0]) for item, keys in shared.items()}


# Where .ci/run's Docker setup (make docker-setup && make image) writes its exit status when it ends, and how long the
# e2e tests wait for it: the setup takes minutes on a new machine (../shared/docker/README.md). Not a DDP_* name: the
# cluster forwards every DDP_* variable of the caller to its workers (app/cluster/compose_env.py), which refuse one
# they do not know, so such a name here stopped every compose test.
DOCKER_SETUP_STATUS = "TESTS_DOCKER_SETUP_STATUS"
DOCKER_SETUP_WAIT_S = 900.0
_docker_setup_waited: list[str] = []  # "" once the wait ended, else why it failed (one wait per session)


# tryfirst: before tests/e2e/conftest.py checks (once per session) what the Docker tests need.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if "e2e" in item.keywords and os.environ.get(DOCKER_SETUP_STATUS):
        if not _docker_setup_waited:
            _docker_setup_waited.append(wait_for_docker_setup(Path(os.environ[DOCKER_SETUP_STATUS])))
        if _docker_setup_waited[0]:
            pytest.fail(_docker_setup_waited[0], pytrace=False)


def wait_for_docker_setup(status_file: Path, wait_s: float = DOCKER_SETUP_WAIT_S) -> str:
    """Until the setup beside the tests has written its exit status: "" when it has (a failed setup then shows in
    the Docker checks, which name what is missing), else one line saying it did not end in time."""
    deadline = time.monotonic() + wait_s
    while not status_file.exists():
        if time.monotonic() > deadline:
            return f"the Docker setup beside the tests ({status_file}) did not end within {wait_s:.0f} s"
        time.sleep(1.0)
    return ""


def pytest_sessionfinish(session: pytest.Session) -> None:
    from app.world import close_all

    close_all()


@pytest.fixture(autouse=True)
def _keep_worker_output(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Where tests.trainer_run.keep_output writes a failed worker's whole output: one folder per test under
    pytest's tmp dir (created only when something is written)."""
    from tests import trainer_run

    name = re.sub(r"[^\w.-]+", "_", request.node.name)[:120]
    # Resolved only when something is written: most tests never need pytest's tmp dir.
    trainer_run.OUTPUT_DIR = lambda: tmp_path_factory.getbasetemp() / "worker-output" / name
    yield
    trainer_run.OUTPUT_DIR = None
