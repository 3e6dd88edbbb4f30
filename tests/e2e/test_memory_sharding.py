"""The seed's problem, run for real (issue 37): a user's model that ddp cannot fit in its containers trains under zero3.

bench/memory_demo.py (`make memory-demo`, which also runs zero2) writes a model file to a temporary folder
outside the checkout and mounts it into the workers as docs/your-model.md does; 4 containers (``--scale worker=4``)
of ``WORKER_MEMORY`` each train it, once under ``parallel=ddp``, once under ``parallel=zero3``; then 4 containers
with no limit train it under ddp, the reference. Asserted on that one shared run:

- ddp: each container ends once, exit 1, with exactly one ERROR line, the one naming memory and the limit; no
  FINISHED, no traceback;
- zero3, in containers of the same limit: every rank FINISHED at the last step, one checksum, exit 0;
- zero3's parameters equal the reference's within tests/integration/test_train_sharded.py's ``TOLERANCE`` (its
  reduce-scatter adds in another order than ddp's all-reduce, so its checksum, a hash of the bytes, differs);
- the model came from the folder outside the checkout, mounted read-only.

About 90 s on a quiet 2-core machine with the image's layers cached; Docker prerequisites as in tests/e2e/conftest.py.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from bench import memory_demo as demo
from tests.e2e.conftest import build_settings
from tests.e2e.test_compose_cluster import ROOT, remove_image
from tests.integration.test_train_sharded import TOLERANCE
from tools.compose_project import Project

pytestmark = [pytest.mark.e2e, pytest.mark.docker, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tag = f"memwt-e2e-{os.getpid()}"
    base, compose_file = build_settings()
    # The image of this checkout, named for this test alone (as tests/e2e's small_project names each project's).
    env = {"BASE_IMAGE": base, "COMPOSE_FILE": compose_file, "IMAGE_NAME": tag, "COMPOSE_BAKE": "false"}
    builder = Project(tag, {**os.environ, **env})
    builder.compose("build", "worker", timeout=900)
    started = time.monotonic()
    try:
        runs = demo.scenario(["ddp", "zero3"], demo.WORKER_MEMORY, tag, tag, tmp_path_factory.mktemp("outside"))
    finally:
        remove_image(tag)
    runs["wall_s"] = round(time.monotonic() - started, 1)
    demo.show({k: v for k, v in runs.items() if k != "wall_s"})
    print(f"memory scenario: 3 projects of {demo.WORKERS} containers in {runs['wall_s']} s")
    return runs


def describe(run: dict) -> str:
    return "\n".join(f"{c['container']}: exit {c['exit_code']}\n{c['log_tail']}" for c in run["containers"])


def test_ddp_is_killed_for_memory_once_per_container_in_one_line(runs):
    ddp, limit = runs["ddp"], int(demo.WORKER_MEMORY.rstrip("m"))
    assert len(ddp["containers"]) == demo.WORKERS, describe(ddp)
    for c in ddp["containers"]:
        assert (c["exit_code"], c["restarts"]) == (1, 0), describe(ddp)
        assert len(c["errors"]) == 1, describe(ddp)
        assert re.search(
            rf"rank \d \(this container, \w+\) was killed for memory: over its container's limit of {limit} MiB",
            c["errors"][0],
        ), c["errors"][0]
        assert c["errors"][0].endswith(": exit 1") and "parallel=zero2 or zero3" in c["errors"][0], c["errors"][0]
        assert not c["finished"] and not c["traceback"], describe(ddp)


def test_zero3_trains_to_the_end_in_the_same_containers(runs):
    zero3 = runs["zero3"]
    assert zero3["memory"] == runs["ddp"]["memory"] == demo.WORKER_MEMORY
    finished = sorted((int(r), int(ws), int(s)) for c in zero3["containers"] for r, ws, s, _ in c["finished"])
    assert finished == [(rank, demo.WORKERS, demo.STEPS) for rank in range(demo.WORKERS)], describe(zero3)
    assert len(demo.checksums(zero3)) == 1, describe(zero3)
    assert {(c["exit_code"], c["restarts"]) for c in zero3["containers"]} == {(0, 0)}, describe(zero3)
    assert not any(c["errors"] for c in zero3["containers"]), describe(zero3)


def test_zero3_ends_with_the_parameters_of_ddp_without_a_limit(runs):
    reference, zero3 = runs["reference"], runs["zero3"]
    assert reference["memory"] == "0" and demo.trained(reference), describe(reference)
    assert zero3["params"] is not None, describe(zero3)
    diff = demo.max_param_diff(zero3["params"], reference["params"])
    print(f"max |Δparam| zero3 (in {demo.WORKER_MEMORY}) vs ddp (no limit) after {demo.STEPS} steps: {diff:.3g}")
    assert diff <= TOLERANCE, f"max |Δparam| {diff:.3g} > {TOLERANCE:g}"


def test_the_model_came_from_outside_the_checkout_read_only(runs):
    mounts = {m for label in ("ddp", "zero3", "reference") for c in runs[label]["containers"] for m in c["model_mount"]}
    ((source, writable),) = mounts
    assert ROOT not in Path(source).resolve().parents and not writable, mounts
