"""The cluster as a user runs it: build the image, `docker compose up --scale worker=3`, watch Prometheus, tear down.

What it proves, each a test below on one shared run:
- 3 replicas of one service, started with `--scale worker=3` and no other setting (no WORKERS: the elastic world
  follows the replicas), which get no index from Compose, become ranks 0..2 through the rendezvous store,
  train to the last step and end with one parameter checksum; every worker container exits 0 (judged per
  container: `docker compose wait` reports only the first);
- Prometheus (the compose service) finds all 3 replicas by DNS and scrapes them while they train;
- every query of every panel of the Grafana dashboard returns data from that Prometheus (Grafana's variables
  substituted as Grafana would: $rank = All, $__rate_interval = 4 scrape intervals), evaluated at the moment
  of the last step;
- `docker compose down -v` leaves no container, network or volume of the project behind.

Grafana itself cannot run here (no registry to pull grafana/grafana from, no Debian package):
test_grafana_loads_the_provisioning says so when it skips, and runs Grafana where its image is present.

Where no registry is reachable (this project's machines, CI) the run uses local/python:3.11-slim and
compose.local.yaml, as the Makefile does; `make docker-setup` prepares both. Run it with

    make e2e                    (or: .venv/bin/python -m pytest tests/e2e/test_compose_cluster.py -s)

about 2 minutes with a built image (a cold image build adds 2-5 minutes on 2 cores). Without Docker it skips
outside CI and fails under CI=true. Figures of each run (build time, up -> first step, step time) are printed
and written to runs/compose-e2e.json.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

import pytest

from app.net import free_port
from tests.e2e.cluster_files import (
    COMPOSE,
    ROOT,
    PanelQuery,
    compose_services,
    panel_queries,
    scrape_interval_seconds,
    substitute,
)
from tests.e2e.conftest import build_settings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

WORKERS = 3  # not the compose default (4): --scale alone must set the world size
# Long enough for several scrapes (every 5 s) during training, whatever the machine's load: 1000 MiniMLP steps of
# 4 ranks on 2 cores take 15-30 s.
STEPS = 1000
RUN_DEADLINE_S = 300
FINISHED = re.compile(r"FINISHED rank=(\d+) world_size=(\d+) step=(\d+) checksum=([0-9a-f]{16})")


def unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI must run the e2e tests: .ci/run sets Docker up with make docker-setup)")
    pytest.skip(reason)


def stamp(line: str) -> float | None:
    """Unix time of a `docker compose logs --timestamps` line (RFC 3339 with nanoseconds)."""
    m = re.search(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z", line)
    if not m:
        return None
    whole = dt.datetime.fromisoformat(m[1]).replace(tzinfo=dt.timezone.utc).timestamp()
    return whole + float("0." + (m[2] or "0"))


@dataclass
class ClusterRun:
    project: str
    prometheus: str
    build_s: float = 0.0
    up_to_first_step_s: float | None = None
    up_to_all_exited_s: float | None = None
    workers: list[dict] = field(default_factory=list)  # docker compose ps -a rows of the worker service
    logs: str = ""
    most_targets_up: int = 0  # the most ddp-worker targets Prometheus reported up at one time
    last_step_time: float | None = None
    panel_results: dict[PanelQuery, list] = field(default_factory=dict)
    rank_label_values: list[str] = field(default_factory=list)
    store_restarted: bool = False  # the store left and came back empty after the job (app.cluster.rendezvous_store)
    second_logs: str = ""  # the workers' logs of the second `up` (same project, no `down` in between)
    second_workers: list[dict] = field(default_factory=list)
    leftovers: dict[str, list[str]] = field(default_factory=dict)
    failure: str = ""


class Compose:
    def __init__(self, project: str, env: dict[str, str]):
        self.project, self.env = project, env

    def __call__(
        self, *args: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            ["docker", "compose", "-p", self.project, *args],
            cwd=ROOT,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"docker compose {' '.join(args)} exited {result.returncode}:\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result

    def containers(self) -> list[dict]:
        out = self("ps", "-a", "--format", "json").stdout.strip()
        if out.startswith("["):
            return json.loads(out)
        return [json.loads(line) for line in out.splitlines() if line.strip()]


def inspect(*ids: str) -> list[dict]:
    out = subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


def wait_for_workers_to_exit(compose: Compose, since: float, deadline_s: float) -> bool:
    """True once WORKERS worker containers have exited after `since` (unix time)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        ids = [c["ID"] for c in compose.containers() if c["Service"] == "worker"]
        if len(ids) == WORKERS:
            states = [c["State"] for c in inspect(*ids)]
            if all(st["Status"] == "exited" and (stamp(st["FinishedAt"]) or 0) > since for st in states):
                return True
        time.sleep(2)
    return False


def prom_get(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params, doseq=True)}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]


def worker_targets_up(base: str) -> int:
    try:
        targets = prom_get(base, "/api/v1/targets", state="active")["activeTargets"]
    except OSError:
        return 0  # Prometheus still starting
    return sum(t["labels"].get("job") == "ddp-worker" and t["health"] == "up" for t in targets)


@pytest.fixture(scope="module")
def cluster() -> ClusterRun:
    if shutil.which("docker") is None:
        unavailable("docker not installed: make docker-setup")
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        unavailable("no Docker engine answers: make docker-setup")
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode != 0:
        unavailable("docker compose (v2 plugin) missing: make docker-setup")

    base_image, compose_file = build_settings()  # as the Makefile chooses them
    project = f"ddp-e2e-{os.getpid()}"
    prom_port = free_port()
    env = {
        **os.environ,
        "BASE_IMAGE": base_image,
        "COMPOSE_FILE": compose_file,
        "COMPOSE_BAKE": "false",
        "PROMETHEUS_PORT": str(prom_port),
        "GRAFANA_PORT": str(free_port()),
        "RUN_ID": project,
        "DDP_STEPS": str(STEPS),
        "DDP_LOG_EVERY": "100",
        "DDP_CHECKPOINT_EVERY": "250",
    }
    env.pop("WORKERS", None)  # --scale alone decides; a WORKERS from the caller's shell would only add a warning
    compose = Compose(project, env)
    run = ClusterRun(project, f"http://127.0.0.1:{prom_port}")

    try:
        started = time.monotonic()
        compose("build", timeout=900)
        run.build_s = time.monotonic() - started

        up_wall = time.time()
        # --no-build: built just above (the compose file says pull_policy: build, so `up` alone builds too).
        compose("up", "-d", "--no-build", "--scale", f"worker={WORKERS}", timeout=180)
        deadline = time.monotonic() + RUN_DEADLINE_S
        while True:
            run.most_targets_up = max(run.most_targets_up, worker_targets_up(run.prometheus))
            workers = [c for c in compose.containers() if c["Service"] == "worker"]
            if len(workers) == WORKERS and all(c["State"] == "exited" for c in workers):
                run.up_to_all_exited_s = time.time() - up_wall
                break
            if time.monotonic() > deadline:
                run.failure = f"workers still running after {RUN_DEADLINE_S} s"
                break
            time.sleep(2)
        run.workers = [c for c in compose.containers() if c["Service"] == "worker"]
        run.logs = compose("logs", "--no-color", "--timestamps", "worker").stdout
        first_steps = [stamp(line) for line in run.logs.splitlines() if re.search(r"\] INFO step 1/", line)]
        if first_steps and first_steps[0]:
            run.up_to_first_step_s = first_steps[0] - up_wall

        # Every panel's query, as Grafana would send it, at the moment of the last step.
        last = prom_get(
            run.prometheus, "/api/v1/query", query="max(max_over_time(ddp_last_step_timestamp_seconds[30m]))"
        )["result"]
        if last:
            run.last_step_time = float(last[0]["value"][1])
            rate_interval = 4 * scrape_interval_seconds()
            for q in panel_queries():
                run.panel_results[q] = prom_get(
                    run.prometheus, "/api/v1/query", time=run.last_step_time, query=substitute(q.expr, rate_interval)
                )["result"]
            run.rank_label_values = prom_get(
                run.prometheus,
                "/api/v1/label/rank/values",
                **{"match[]": "ddp_world_size", "start": up_wall, "end": time.time()},
            )

        # A second `docker compose up`, no `down` in between (other metrics linger, so new worker containers):
        # the store must have restarted empty after the job, and the workers resume from the shared checkpoint.
        store_id = next(c["ID"] for c in compose.containers() if c["Service"] == "rendezvous")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not run.store_restarted:
            state = inspect(store_id)[0]
            run.store_restarted = (
                state["RestartCount"] >= 1 and state["State"].get("Health", {}).get("Status") == "healthy"
            )
            time.sleep(1)
        second_wall = time.time()
        compose(
            "up",
            "-d",
            "--no-build",
            "--scale",
            f"worker={WORKERS}",
            timeout=180,
            env={"DDP_METRICS_LINGER_SECONDS": "0"},
        )
        if not wait_for_workers_to_exit(compose, second_wall, RUN_DEADLINE_S):
            run.failure += f"; second up: workers still running after {RUN_DEADLINE_S} s"
        run.second_workers = [c for c in compose.containers() if c["Service"] == "worker"]
        since = dt.datetime.fromtimestamp(second_wall, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        run.second_logs = compose("logs", "--no-color", "--timestamps", "--since", since, "worker").stdout
    finally:
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180, check=False)
        label = f"label=com.docker.compose.project={project}"
        for kind, cmd in {
            "containers": ["docker", "ps", "-aq", "--filter", label],
            "networks": ["docker", "network", "ls", "-q", "--filter", label],
            "volumes": ["docker", "volume", "ls", "-q", "--filter", label],
        }.items():
            left = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.split()
            run.leftovers[kind] = left
            if left and kind == "containers":  # never leave a stray container running, even on failure
                subprocess.run(["docker", "rm", "-f", *left], capture_output=True, timeout=60)

    figures = {
        "build_s": round(run.build_s, 1),
        "up_to_first_step_s": run.up_to_first_step_s,
        "up_to_all_exited_s": run.up_to_all_exited_s,
        "workers": WORKERS,
        "steps": STEPS,
        "median_step_ms_rank0": (re.findall(r"median_step_ms=([\d.]+)", run.logs) or [None])[0],
        "base_image": base_image,
        "compose_file": compose_file,
    }
    (ROOT / "runs").mkdir(exist_ok=True)
    (ROOT / "runs/compose-e2e.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\ncompose e2e figures: {json.dumps(figures)}")
    return run


def finished_lines(logs: str) -> dict[int, tuple[str, int, int, str]]:
    """rank -> (container, world_size, step, checksum) of the last FINISHED line per rank of `docker compose logs
    --timestamps`. The lines are taken in time order: compose prints each container's lines together, so after a
    world re-formed, an earlier world's rank 0 (another container) could otherwise come last."""
    finished = {}
    for line in sorted(logs.splitlines(), key=lambda line: stamp(line) or 0.0):
        if m := FINISHED.search(line):
            finished[int(m[1])] = (line.split("|", 1)[0].strip(), int(m[2]), int(m[3]), m[4])
    return finished


def test_scale_alone_makes_that_many_ranks_that_train_to_the_end_in_step(cluster):
    assert not cluster.failure, cluster.failure + "\n" + cluster.logs[-4000:]
    finished = finished_lines(cluster.logs)
    assert sorted(finished) == list(range(WORKERS)), cluster.logs[-4000:]
    containers = {c for c, *_ in finished.values()}
    assert len(containers) == WORKERS, f"one rank per container expected: {finished}"
    assert {(ws, step) for _, ws, step, _ in finished.values()} == {(WORKERS, STEPS)}
    checksums = {cs for *_, cs in finished.values()}
    assert len(checksums) == 1, f"ranks ended with different parameters: {finished}"


def test_a_second_up_without_down_resumes_from_the_shared_checkpoint(cluster):
    assert cluster.store_restarted, "the rendezvous store did not come back empty after the job"
    first = finished_lines(cluster.logs)
    second = finished_lines(cluster.second_logs)
    assert sorted(second) == list(range(WORKERS)), cluster.second_logs[-4000:]
    # Nothing left to train: every rank loaded the last checkpoint from the shared volume, so the same parameters.
    assert {(ws, step, cs) for _, ws, step, cs in second.values()} == {(WORKERS, STEPS, first[0][3])}, (
        cluster.second_logs[-4000:]
    )
    codes = {c["Name"]: (c["State"], c["ExitCode"]) for c in cluster.second_workers}
    assert len(codes) == WORKERS and all(v == ("exited", 0) for v in codes.values()), codes


def test_every_worker_container_exits_zero(cluster):
    assert len(cluster.workers) == WORKERS
    codes = {c["Name"]: (c["State"], c["ExitCode"]) for c in cluster.workers}
    assert all(state == "exited" and code == 0 for state, code in codes.values()), codes


def test_prometheus_finds_and_scrapes_every_replica(cluster):
    assert cluster.most_targets_up == WORKERS, f"at most {cluster.most_targets_up} worker targets were up"
    assert sorted(cluster.rank_label_values) == [str(r) for r in range(WORKERS)]


def test_every_dashboard_query_returns_data(cluster):
    assert cluster.last_step_time, "Prometheus has no ddp_last_step_timestamp_seconds: nothing was scraped"
    queries = panel_queries()
    assert set(cluster.panel_results) == set(queries)

    def has_number(series: dict) -> bool:
        value = float(series["value"][1])
        return value == value and abs(value) != float("inf")  # not NaN (e.g. 0/0), not infinite

    empty = [
        f"{q.panel} [{q.ref}]: {q.expr}"
        for q, result in cluster.panel_results.items()
        if not any(has_number(s) for s in result)
    ]
    assert not empty, "panels whose query returns no data:\n" + "\n".join(empty)
    # Per-rank panels show every rank, not only some.
    step_p50 = next(r for q, r in cluster.panel_results.items() if q.panel == "Step time p50 / p95")
    assert sorted(s["metric"]["rank"] for s in step_p50) == [str(r) for r in range(WORKERS)]


def test_down_leaves_nothing_behind(cluster):
    assert cluster.leftovers == {"containers": [], "networks": [], "volumes": []}


def test_grafana_loads_the_provisioning():
    """Grafana with our provisioning: the datasource uid the panels name and the dashboard, through its API."""
    grafana = compose_services(COMPOSE)["grafana"]
    image = grafana["image"]
    if (
        shutil.which("docker") is None
        or subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=30).returncode != 0
    ):
        pytest.skip(
            f"Grafana cannot run here: {image} is not in the engine and no registry (nor a Debian "
            "package) provides it. The dashboard is proven instead by test_every_dashboard_query_returns_data "
            "(every panel's query against the real Prometheus) and test_cluster_files.py (datasource uid)."
        )
    port = free_port()
    name = f"ddp-e2e-grafana-{os.getpid()}"
    prov = ROOT / "docker/grafana"
    subprocess.run(
        [
            "docker",
            "run",
            "-d",
            "--rm",
            "--name",
            name,
            "-p",
            f"127.0.0.1:{port}:3000",
            "-v",
            f"{prov}/provisioning:/etc/grafana/provisioning:ro",
            "-v",
            f"{prov}/dashboards:/etc/grafana/dashboards:ro",
            "--entrypoint",  # compose's: a random admin password (docker run does not undo compose's $$)
            grafana["entrypoint"][0],
            image,
            *(arg.replace("$$", "$") for arg in grafana["entrypoint"][1:]),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/health", timeout=5) as r:
                    if json.load(r).get("database") == "ok":
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Grafana did not become healthy in 90 s"
            time.sleep(2)

        password = subprocess.run(
            ["docker", "exec", name, "cat", "/var/lib/grafana/admin-password"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert password != "admin"
        token = base64.b64encode(f"admin:{password}".encode()).decode()

        def get(path: str) -> dict:  # the admin account, with the password the entrypoint made
            req = urllib.request.Request(f"{url}{path}", headers={"Authorization": f"Basic {token}"})
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.load(r)

        source = get("/api/datasources/uid/prometheus")
        assert source["type"] == "prometheus"
        dash = get("/api/dashboards/uid/ddp-cluster")["dashboard"]
        assert len(dash["panels"]) >= 15
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
