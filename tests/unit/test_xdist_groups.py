"""``make test`` runs on pytest-xdist workers; a cluster start-up shared by several tests must still happen once.

tests/conftest.py gives every test linked to a module-scoped fixture one ``xdist_group``. This runs pytest-xdist
for real (three workers) on a small module and reads where each test ran: a grouping that xdist ignores (as under
pytest 9.2, see pyproject.toml) would set the fixture up on several workers, as it would start several clusters.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = """
import pytest
from tests.conftest import shared_start_up_groups

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item, group in shared_start_up_groups(items).items():
        item.add_marker(pytest.mark.xdist_group(group))
"""

MODULE = """
import os, pytest

def note(what):
    with open(os.environ["LOG"], "a") as f:
        f.write(f"{what} {os.environ['PYTEST_XDIST_WORKER']}\\n")

@pytest.fixture(scope="module")
def cluster():
    note("start-up")

@pytest.fixture(scope="module")
def prometheus(cluster):
    note("start-up")
"""
MODULE += "".join(f"\ndef test_cluster_{i}(cluster):\n    note('cluster')\n" for i in range(4))
MODULE += "".join(f"\ndef test_prometheus_{i}(prometheus):\n    note('cluster')\n" for i in range(2))
MODULE += "".join(f"\ndef test_alone_{i}():\n    note('alone')\n" for i in range(6))


def pytest_passes(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A pytest of its own, in a fresh interpreter, that must exit 0."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run


def test_tests_sharing_a_start_up_run_on_one_worker_which_starts_it_once(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_shared.py").write_text(MODULE)
    log = tmp_path / "where.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOG": str(log)}
    args = ["-n", "3", "--dist", "loadgroup", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
    pytest_passes([*args, str(tmp_path)], tmp_path, env)
    lines = [line.split() for line in log.read_text().splitlines()]
    assert sum(1 for what, _ in lines if what == "start-up") == 2  # cluster, then prometheus on top of it
    workers = {worker for what, worker in lines if what in ("start-up", "cluster")}
    assert len(workers) == 1, f"one shared start-up ran on {sorted(workers)}"
    assert sum(1 for what, _ in lines if what == "alone") == 6


PROBE = """
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        print("GROUP", item.nodeid, mark.args[0] if mark else None)
"""


def test_every_docker_test_runs_in_the_docker_lane_and_the_others_keep_their_own_groups(tmp_path):
    # Two clusters at once on one engine and two cores: what the lane prevents, but for the second lane.
    # The real conftest, on real files.
    (tmp_path / "lane_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    files = ["tests/e2e/test_chaos.py", "tests/e2e/test_chaos_in_place.py", "tests/e2e/test_k8s_emulation.py"]
    files.append("tests/integration/test_invariance.py")
    run = pytest_passes(["--collect-only", "-q", "-p", "lane_probe", "-p", "no:cacheprovider", *files], ROOT, env)
    groups = {line.split()[1]: line.split()[2] for line in run.stdout.splitlines() if line.startswith("GROUP ")}
    docker = {node: group for node, group in groups.items() if node.startswith("tests/e2e/test_k8s")}
    lost_pod = "tests/e2e/test_k8s_emulation.py::test_a_lost_pod_is_replaced_and_its_replacement_waits_for_a_new_store"
    evicted = "tests/e2e/test_k8s_emulation.py::test_an_evicted_pod_and_its_peers_spend_no_retry"
    # single tests of a module, moved to balance the lanes
    assert docker.pop(lost_pod) == "docker-2" and docker.pop(evicted) == "docker-2", groups
    assert docker and set(docker.values()) == {"docker"}, docker  # function-scoped tests too
    chaos = {node: group for node, group in groups.items() if node.startswith("tests/e2e/test_chaos")}
    in_place = chaos.pop("tests/e2e/test_chaos_in_place.py::test_a_run_healed_in_place_equals_the_uninterrupted_run")
    assert in_place == "docker", in_place  # the first lane: its own minutes of containers, away from the other run
    assert len(chaos) == 4 and set(chaos.values()) == {"docker-2"}, chaos  # the second lane, beside the other
    others = {group for node, group in groups.items() if node.startswith("tests/integration/")}
    assert others and "docker" not in others and "None" not in others, others  # the shared fixture's own group


def test_the_e2e_tests_wait_for_the_docker_setup_beside_them_and_a_bound(tmp_path):
    """.ci/run runs make docker-setup beside make test: the e2e tests go on once its status file exists, and a setup
    that never ends fails them with one line at the bound instead of hanging CI."""
    import threading
    import time

    from tests.conftest import wait_for_docker_setup

    status = tmp_path / "docker-setup.status"
    threading.Timer(0.5, status.write_text, args=("0\n",)).start()
    start = time.monotonic()
    assert wait_for_docker_setup(status, wait_s=30) == ""
    assert 0.4 < time.monotonic() - start < 10
    missing = tmp_path / "never"
    assert wait_for_docker_setup(missing, wait_s=2.0) == (
        f"the Docker setup beside the tests ({missing}) did not end within 2 s"
    )


def test_the_harness_switches_are_not_settings_that_the_cluster_forwards():
    """Every DDP_* variable of the caller reaches the compose workers, which refuse a name they do not know: a
    harness variable named DDP_* (as the Docker setup's status file once was) makes every compose test fail."""
    from app.cluster.compose_env import PREFIX
    from app.worker.config.launch import LAUNCH_PREFIX
    from tests.conftest import DOCKER_SETUP_STATUS

    assert not DOCKER_SETUP_STATUS.startswith(PREFIX) and not LAUNCH_PREFIX.startswith(PREFIX)
