"""The cluster running a 2-stage pipeline: `DDP_PARALLEL=pipeline docker compose up --scale worker=2`.

What it proves, on one run: both containers (one stage each) train to the last step and print the same merged-model
checksum, every worker container exits 0, Prometheus scrapes each stage's ``ddp_pipeline_*`` series (stage 0 and
stage 1), and every query of the dashboard's Pipeline row returns data, evaluated at the moment of the last step.

    .venv/bin/python -m pytest tests/e2e/test_compose_pipeline.py -s     (about 2 minutes with a built image)

Uses the same compose driver as test_compose_cluster.py; its own project name, torn down with ``down -v``.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from app.worker.dist import free_port
from tests.e2e.cluster_files import PIPELINE_ROW, panel_queries, scrape_interval_seconds, substitute
from tests.e2e.conftest import STEP_PACE_SECONDS, build_settings
from tests.e2e.test_compose_cluster import FINISHED, Compose, prom_get

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

WORKERS = 2
# Long enough that training spans several 5 s scrapes (steps paced to STEP_PACE_SECONDS at least): a rate() over
# 4 scrape intervals needs two samples that differ, or the panel is empty.
STEPS = 1500
RUN_DEADLINE_S = 300


@pytest.fixture(scope="module")
def pipeline_run() -> dict:
    base_image, compose_file = build_settings()
    project = f"pipeworker-e2e-{os.getpid()}"
    prom_port = free_port()
    env = {
        **os.environ,
        "BASE_IMAGE": base_image,
        "COMPOSE_FILE": compose_file,
        "COMPOSE_BAKE": "false",
        "PROMETHEUS_PORT": str(prom_port),
        "GRAFANA_PORT": str(free_port()),
        "ALERTMANAGER_PORT": str(free_port()),
        "RUN_ID": project,
        "DDP_PARALLEL": "pipeline",
        "DDP_STEPS": str(STEPS),
        "DDP_MIN_STEP_SECONDS": STEP_PACE_SECONDS,  # at least 30 s of training on a fast machine too
        "DDP_LOG_EVERY": "100",
        "DDP_CHECKPOINT_EVERY": "300",
    }
    env.pop("WORKERS", None)
    compose = Compose(project, env)
    base = f"http://127.0.0.1:{prom_port}"
    run: dict = {"failure": "", "panels": {}, "stages": {}}
    try:
        compose("build", timeout=900)
        compose("up", "-d", "--no-build", "--scale", f"worker={WORKERS}", timeout=180)
        deadline = time.monotonic() + RUN_DEADLINE_S
        while True:
            workers = [c for c in compose.containers() if c["Service"] == "worker"]
            if len(workers) == WORKERS and all(c["State"] == "exited" for c in workers):
                break
            if time.monotonic() > deadline:
                run["failure"] = f"workers still running after {RUN_DEADLINE_S} s"
                break
            time.sleep(2)
        run["workers"] = [c for c in compose.containers() if c["Service"] == "worker"]
        run["logs"] = compose("logs", "--no-color", "worker").stdout
        last = prom_get(base, "/api/v1/query", query="max(max_over_time(ddp_last_step_timestamp_seconds[30m]))")
        if last["result"]:
            rate_interval = 4 * scrape_interval_seconds()
            # One scrape after the last step (workers linger): the final counters are then inside every window.
            at = float(last["result"][0]["value"][1]) + scrape_interval_seconds()
            for q in panel_queries(pipeline=True):
                if q.row.startswith(PIPELINE_ROW):
                    expr = substitute(q.expr, rate_interval)
                    run["panels"][q] = prom_get(base, "/api/v1/query", time=at, query=expr)["result"]
            stages = prom_get(base, "/api/v1/query", time=at, query="ddp_pipeline_stage")["result"]
            run["stages"] = {s["metric"]["rank"]: s["value"][1] for s in stages}
    finally:
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180, check=False)
    return run


def test_both_stages_finish_with_one_merged_checksum_and_exit_zero(pipeline_run):
    assert not pipeline_run["failure"], pipeline_run["failure"] + "\n" + pipeline_run["logs"][-4000:]
    finished = {int(m[1]): (int(m[2]), int(m[3]), m[4]) for m in FINISHED.finditer(pipeline_run["logs"])}
    assert sorted(finished) == [0, 1], pipeline_run["logs"][-4000:]
    assert len(set(finished.values())) == 1 and finished[0][:2] == (WORKERS, STEPS), finished
    assert re.search(r"pipeline: 2 stages x 1 replicas", pipeline_run["logs"]), pipeline_run["logs"][-4000:]
    codes = {c["Name"]: (c["State"], c["ExitCode"]) for c in pipeline_run["workers"]}
    assert len(codes) == WORKERS and all(v == ("exited", 0) for v in codes.values()), codes


def test_each_stage_reaches_prometheus(pipeline_run):
    assert pipeline_run["stages"] == {"0": "0", "1": "1"}, pipeline_run["stages"]


def test_every_pipeline_panel_query_returns_data(pipeline_run):
    assert pipeline_run["panels"], "the dashboard has no Pipeline row, or Prometheus saw no step"
    empty = [f"{q.panel} [{q.ref}]: {q.expr}" for q, result in pipeline_run["panels"].items() if not result]
    assert not empty, "Pipeline panels without data:\n" + "\n".join(empty)
