"""A user's model package from outside the repository, trained by the cluster: compose, a derived image, Kubernetes.

examples/user_model/ is copied to a temporary folder first (not under the checkout), and every run uses that copy:
what trains needs nothing from the checkout but the cluster's image. One module-scoped run, each test reads it:

- compose, the package mounted (compose.user.yaml): `docker compose up --scale worker=3` of app.train with the
  package's specs (DDP_MODEL, DDP_DATA, DDP_LOSS and their keywords); 3 ranks, one checksum, every container exits 0;
- the derived image (compose.user-image.yaml builds examples/user_model/Dockerfile FROM the project's image): the
  user's own train.py it carries trains 2 ranks under the cluster's launcher, in a container with a read-only root
  (compose.user-script.yaml, the same script under compose, is checked against compose.yaml's launcher flags by
  tests/unit/test_user_model.py);
- the Kubernetes overlay (k8s/overlays/user-model/), its pods emulated as containers of the derived image
  (tests/e2e/test_k8s_emulation.py's EmulatedJob), app.train with the package's specs (DDP_MODEL, ...).

    .venv/bin/python -m pytest tests/e2e/test_user_model.py -s      (about 2 minutes with the image's layers cached)

Needs Docker (skips outside CI without it, as the other e2e modules do) and `make docker-setup`'s local images.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import build_settings
from tests.e2e.test_compose_cluster import (
    FINISHED,
    container_logs,
    remove_image,
    small_project,
    wait_until_settled,
)
from tests.unit.test_k8s import ROOT, kustomize
from tools.docker_cli import docker

pytestmark = [pytest.mark.e2e, pytest.mark.docker, pytest.mark.timeout(1200)]

WORKERS = 3
STEPS = 60  # a few seconds of training, enough for the loss to fall
DEADLINE_S = 300
SUMMARY = re.compile(r"summary: steps=(\d+) loss_first=([\d.]+) loss_last=([\d.]+)")  # app.worker.progress


def copy_outside(tmp: Path) -> Path:
    """The example package in a folder of its own, readable by the image's user (the mount is read-only)."""
    copy = tmp / "user_model"
    shutil.copytree(
        ROOT / "examples/user_model", copy, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    )
    assert ROOT not in copy.resolve().parents, f"{copy} is inside the checkout"
    for path in [copy, *copy.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return copy


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    package = copy_outside(tmp_path_factory.mktemp("outside"))
    _, compose_file = build_settings()
    mounted = f"{compose_file}:{package}/compose.user.yaml"
    compose = small_project("userpkg", COMPOSE_FILE=mounted, USER_MODEL_DIR=str(package), DDP_STEPS=str(STEPS))
    derived = f"{compose.project}-user-model:latest"  # compose.user-image.yaml's name for it
    out: dict = {"package": package, "derived": derived}
    try:
        started = time.monotonic()
        compose("up", "-d", "--no-build", "--scale", f"worker={WORKERS}", "worker", timeout=180)
        out["workers"] = wait_until_settled(compose, WORKERS, DEADLINE_S)
        out["compose_s"] = time.monotonic() - started  # settle_s included
        out["logs"] = {s["Id"]: container_logs(s["Id"]) for s in out["workers"]}
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180, check=False)

        started = time.monotonic()
        compose(
            "build", "worker", timeout=600, env={"COMPOSE_FILE": f"{compose_file}:{package}/compose.user-image.yaml"}
        )
        out["derived_build_s"] = time.monotonic() - started
        # The image alone, a read-only root as compose runs it; named, so that a hang cannot leave it running.
        script = ["python", "-m", "app.cluster.launch", "--standalone", "--nproc-per-node=2"]
        name = f"{compose.project}-derived"
        started = time.monotonic()
        out["derived_run"] = docker(
            "run", "--rm", "--name", name, "--read-only", "--tmpfs", "/tmp", "-e", "OMP_NUM_THREADS=1",
            derived, *script, "/opt/user_model/train.py", "--steps=20", timeout=180, check=False,
        )  # fmt: skip
        out["derived_run_s"] = time.monotonic() - started
        yield out
    finally:
        docker("rm", "-f", f"{compose.project}-derived", check=False)
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180, check=False)
        remove_image(compose.project)
        docker("image", "rm", derived, timeout=120, check=False)


def test_the_mounted_package_trains_on_every_replica_with_one_checksum(runs):
    everything = "\n".join(runs["logs"].values())
    finished = sorted((int(r), int(ws), int(s), c) for r, ws, s, c in FINISHED.findall(everything))
    assert [(r, ws, s) for r, ws, s, _ in finished] == [(r, WORKERS, STEPS) for r in range(WORKERS)], everything[-4000:]
    assert len({c for *_, c in finished}) == 1, f"ranks ended with different parameters: {finished}"
    steps, first, last = SUMMARY.search(everything).groups()
    assert int(steps) == STEPS and float(last) < 0.8 * float(first), f"the model did not learn: {first} -> {last}"
    assert "user_model.model:build_model" in everything, "app.train did not name the package's model spec"
    assert {(s["State"]["ExitCode"], s["RestartCount"]) for s in runs["workers"]} == {(0, 0)}, everything[-4000:]


def test_the_package_came_from_outside_the_checkout(runs):
    for state in runs["workers"]:  # as `docker inspect` saw them, before `down`
        (mount,) = [m for m in state["Mounts"] if m["Destination"] == "/opt/user_model"]
        assert (Path(mount["Source"]), mount["RW"]) == (runs["package"], False)


def test_the_derived_image_carries_the_package_and_the_script(runs):
    run = runs["derived_run"]
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-4000:]
    finished = FINISHED.findall(text)
    assert sorted((int(r), int(ws), int(s)) for r, ws, s, _ in finished) == [(0, 2, 20), (1, 2, 20)], text[-4000:]
    assert len({c for *_, c in finished}) == 1, finished
    print(
        f"user package: compose up -> {WORKERS} settled {runs['compose_s']:.1f} s; derived image built in "
        f"{runs['derived_build_s']:.1f} s, its 2-rank run {runs['derived_run_s']:.1f} s"
    )


def test_the_k8s_overlay_trains_the_package_from_the_derived_image(runs, tmp_path, monkeypatch):
    from tests.e2e.test_k8s_emulation import FINISHED as POD_FINISHED
    from tests.e2e.test_k8s_emulation import POD0_DELAY_S, EmulatedJob

    monkeypatch.setenv("DDP_IMAGE", runs["derived"])  # the overlay names ddp-cluster-user-model:latest: this build
    steps = 40
    emu = EmulatedJob(tmp_path, {"DDP_STEPS": str(steps), "DDP_METRICS_LINGER_SECONDS": "0"})
    objs = kustomize("overlays/user-model")
    emu.job, emu.objs = objs[("Job", "ddp-train")], objs
    try:
        pod1 = emu.start(1)
        time.sleep(POD0_DELAY_S)
        pod0 = emu.start(0)
        codes = {name: emu.wait_exit(name, DEADLINE_S) for name in (pod0, pod1)}
        report = emu.report()
        assert codes == {pod0: 0, pod1: 0}, report
        lines = [line for name in (pod0, pod1) for line in POD_FINISHED.findall(emu.logs(name))]
        assert sorted((int(r), int(ws), int(s)) for r, ws, s, _ in lines) == [(0, 2, steps), (1, 2, steps)], report
        assert len({c for *_, c in lines}) == 1, lines
        assert "user_model.model:build_model" in emu.logs(pod0), "rank 0's settings table names the model's spec"
    finally:
        emu.close()
