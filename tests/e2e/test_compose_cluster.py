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
from tests.e2e.conftest import STEP_PACE_SECONDS, build_settings
from tests.e2e.drills.drill_faults import OOM_MEMORY, OOM_MODEL
from tools import docker_cli
from tools.docker_cli import docker, stamp

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

WORKERS = 3  # not the compose default (4): --scale alone must set the world size
# Long enough for several scrapes (every 5 s) during training, whatever the machine's load: 1000 paced steps
# (STEP_PACE_SECONDS) are at least 20 s.
STEPS = 1000
RUN_DEADLINE_S = 300
FINISHED = re.compile(r"FINISHED rank=(\d+) world_size=(\d+) step=(\d+) checksum=([0-9a-f]{16})")


def unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI must run the e2e tests: .ci/run sets Docker up with make docker-setup)")
    pytest.skip(reason)


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
    """``docker compose -p PROJECT ...`` with the environment ``env``: as a user types it (``plain``: the shell's
    ``DDP_*`` reach the workers because compose.yaml names them), or as `make up` runs it, with the env file that
    carries every ``DDP_*`` name (app/cluster/compose_env.py)."""

    def __init__(self, project: str, env: dict[str, str], plain: bool = False):
        self.project, self.env, self.plain = project, env, plain

    def __call__(
        self, *args: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        run_env = {**self.env, **(env or {})}
        return docker_cli.compose(self.project, run_env, *args, timeout=timeout, check=check, plain=self.plain)

    def containers(self) -> list[dict]:
        out = self("ps", "-a", "--format", "json").stdout.strip()
        if out.startswith("["):
            return json.loads(out)
        return [json.loads(line) for line in out.splitlines() if line.strip()]


def inspect(*ids: str) -> list[dict]:
    return json.loads(docker("inspect", *ids).stdout)


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
    if docker("info", timeout=30, check=False).returncode != 0:
        unavailable("no Docker engine answers: make docker-setup")
    if docker("compose", "version", timeout=30, check=False).returncode != 0:
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
        "ALERTMANAGER_PORT": str(free_port()),
        "RUN_ID": project,
        "DDP_STEPS": str(STEPS),
        "DDP_MIN_STEP_SECONDS": STEP_PACE_SECONDS,
        "DDP_LOG_EVERY": "100",
        "DDP_CHECKPOINT_EVERY": "250",
        # The panels are evaluated at the last step's time, so what Prometheus scrapes later shows in none of them:
        # the linger (configs/compose.yaml: 15 s) need only cover one scrape (5 s) that records the last step's time.
        "DDP_METRICS_LINGER_SECONDS": "7",
    }
    env.pop("WORKERS", None)  # --scale alone decides; a WORKERS from the caller's shell would only add a warning
    # As a user types it: `DDP_STEPS=1000 docker compose up --scale worker=3`, no env file named. A .cluster.env left
    # by an earlier `make up` must not be read: one naming no setting would stop every worker (exit 2).
    compose = Compose(project, env, plain=True)
    run = ClusterRun(project, f"http://127.0.0.1:{prom_port}")
    stale = ROOT / ".cluster.env"
    planted = not stale.exists()
    if planted:
        stale.write_text("DDP_YESTERDAYS_SETTING=1\nDDP_STEPS=3\n")

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
        if planted:
            stale.unlink(missing_ok=True)
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180, check=False)
        remove_image(compose.project)
        label = f"label=com.docker.compose.project={project}"
        for kind, cmd in {
            "containers": ["ps", "-aq", "--filter", label],
            "networks": ["network", "ls", "-q", "--filter", label],
            "volumes": ["volume", "ls", "-q", "--filter", label],
        }.items():
            left = docker(*cmd, check=False).stdout.split()
            run.leftovers[kind] = left
            if left and kind == "containers":  # never leave a stray container running, even on failure
                docker("rm", "-f", *left, check=False)

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
    assert "settings from env file" not in cluster.logs, "a plain up read an env file (.cluster.env left behind?)"


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
    if shutil.which("docker") is None or docker("image", "inspect", image, timeout=30, check=False).returncode != 0:
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

        password = docker("exec", name, "cat", "/var/lib/grafana/admin-password", timeout=30).stdout
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
        docker("rm", "-f", name, check=False)


# -- every setting reaches every worker, no retries of what cannot be fixed, one finished job one ending ----------
# Each fixture below is a small project of its own (only the worker service and its store: no Prometheus), so one
# failing says which promise broke.

# A value for every TrainConfig field, none the compose default where the run allows it: each must reach both
# workers through compose's environment (the env file `make up` writes), none through a list in compose.yaml.
EVERY_SETTING = {
    "model": "mini_mlp",
    "model_kwargs": '{"hidden": 48}',  # a JSON object through the environment
    "data": "",  # unset: mini_mlp's own data set, sized by dataset_size
    "data_kwargs": "{}",
    "loss": "cross_entropy",
    "loss_kwargs": '{"label_smoothing": 0.05}',
    "init_from": "",  # set and empty: a fresh run from the model's own initialisation (no weights file in the image)
    "steps": "6",
    "micro_batch": "8",
    "grad_accum_steps": "2",
    "effective_batch": "",  # unset: configs/compose.yaml's 128 must give way to the environment's "unset"
    "lr": "0.0042",
    "lr_schedule": "linear",
    "warmup_steps": "2",
    "min_lr_ratio": "0.1",
    "lr_reference_batch": "32",
    "autocast": "none",  # set and "none": bf16/fp16 need dtype=float32, and this run is float64
    "grad_clip_norm": "2.5",
    "dtype": "float64",
    "seed": "7",
    "dataset_size": "4096",
    "seq_len": "16",
    "eval_fraction": "0.1",  # 410 samples held out of the 4096
    "eval_every": "3",
    "wrapper": "torch",
    "bucket_cap_mb": "1.5",
    "parallel": "ddp",
    "fsdp_units": "",  # set and empty: it is for parallel=zero3 only, and ddp must still see it from the environment
    "activation_checkpointing": "every:2",
    "activation_checkpointing_units": "Linear",  # mini_mlp's 3: every second is net.2
    "compile": "none",  # set and "none": activation_checkpointing is on, and the two are refused together
    "compile_units": "",
    "overlap_gather": "0",  # for parallel=zero2 only: set to its default, it must still come from the environment
    "prefetch": "0",  # for parallel=zero3 only, as overlap_gather
    "reshard_after_forward": "1",
    "pipeline_stages": "0",
    "pipeline_microbatches": "2",
    "pipeline_schedule": "1f1b",
    "pipeline_split": "",  # set and empty: it is for parallel=pipeline only, as fsdp_units above
    "device": "cpu",
    "rendezvous_timeout_seconds": "90",
    "collective_timeout_seconds": "45",
    "heal": "restart",  # the default, set: it must still come from the environment (in_place: test_heal.py)
    "heal_store": "",  # set and empty: it is for heal=in_place only
    "checkpoint_dir": "/checkpoints",
    "checkpoint_every": "3",
    "checkpoint_timeout_seconds": "2.5",
    "keep_checkpoints": "2",
    "metrics_port": "9411",
    "metrics_linger_seconds": "0",
    "log_every": "1",
    "flight_recorder_entries": "512",
    "desync_check": "0",  # the default, set: it must still come from the environment
    "min_step_seconds": "0.001",
    "stop_timeout_seconds": "12",
    "inject_nan_at_step": "0",
}


def small_project(name: str, plain: bool = False, **env: str) -> Compose:
    """A project of its own with the worker settings ``env`` (DDP_*, MAX_WORKERS, ...), its image built; ``plain``:
    run as a user types ``docker compose``, with no env file."""
    if shutil.which("docker") is None or docker("info", check=False).returncode:
        unavailable("no Docker engine answers: make docker-setup")
    base_image, compose_file = build_settings()
    project = f"ddp-e2e-{name}-{os.getpid()}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("DDP_") and k != "WORKERS"}
    compose = Compose(
        project,
        {**base, "BASE_IMAGE": base_image, "COMPOSE_FILE": compose_file, "COMPOSE_BAKE": "false", "RUN_ID": project}
        | env,
        plain,
    )
    compose("build", "worker", timeout=900)
    return compose


def remove_image(project: str) -> None:
    """The project's own image tag (compose.yaml names the image after the project); its layers stay cached."""
    docker("image", "rm", f"{project}:latest", timeout=120, check=False)


def worker_rows(compose: Compose) -> list[dict]:
    return [c for c in compose.containers() if c["Service"] == "worker"]


def wait_until_settled(compose: Compose, count: int, deadline_s: float, settle_s: float = 3.0) -> list[dict]:
    """The worker containers once ``count`` of them have exited and none has changed for ``settle_s``
    (a restart policy would bring an exited one back a moment later: Docker's first restart comes after 100 ms,
    its back-off doubles from there, so a few seconds show one)."""
    deadline, last, since = time.monotonic() + deadline_s, None, time.monotonic()
    while time.monotonic() < deadline:
        ids = [c["ID"] for c in worker_rows(compose)]
        states = [(s["Id"], s["State"]["Status"], s["RestartCount"], s["State"]["ExitCode"]) for s in inspect(*ids)]
        if states != last:
            last, since = states, time.monotonic()
        elif (
            len(states) == count
            and all(st == "exited" for _, st, _, _ in states)
            and time.monotonic() - since >= settle_s
        ):
            return inspect(*ids)
        time.sleep(1)
    raise AssertionError(f"workers not settled in {deadline_s} s: {last}")


def container_logs(container_id: str, since: float | None = None) -> str:
    after = ["--since", f"{since:.3f}"] if since is not None else []
    out = docker("logs", "--timestamps", *after, container_id, check=False)
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def settings_run() -> dict:
    env = {f"DDP_{name.upper()}": value for name, value in EVERY_SETTING.items()}
    # No env file: each of them reaches the workers because compose.yaml names it (`make docs-config`).
    compose = small_project("settings", plain=True, **env)
    try:
        compose("up", "-d", "--no-build", "--scale", "worker=2", "worker", timeout=180)
        first = wait_until_settled(compose, 2, RUN_DEADLINE_S)
        logs = {s["Id"]: container_logs(s["Id"]) for s in first}
        # Start one worker again after its job has finished: it must not train (nor form a world) a second time.
        again, started = first[0]["Id"], time.time()
        docker("start", again)
        second = wait_until_settled(compose, 2, 120)
        again_logs = container_logs(again, since=started)
        return {"first": first, "logs": logs, "second": second, "again": again, "again_logs": again_logs}
    finally:
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180, check=False)
        remove_image(compose.project)


def test_every_setting_reaches_every_worker(settings_run):
    from app.worker.config import FIELDS, TrainConfig, convert, digest

    assert set(EVERY_SETTING) == set(FIELDS), "give the new field a value above: it must reach the workers too"
    expected = TrainConfig(**{name: convert(name, raw, "test") for name, raw in EVERY_SETTING.items()})
    line = f"trainer settings: {len(FIELDS)} of {len(FIELDS)} from the environment, digest {digest(expected)}"
    for cid, text in settings_run["logs"].items():
        assert text.count(line) == 1, f"{cid[:12]}: no line {line!r}:\n{text[-3000:]}"
    table = "\n".join(settings_run["logs"].values())  # rank 0's trainer logs the resolved table, with sources
    for name in FIELDS:
        assert re.search(rf"\b{name} +=.*\(env DDP_{name.upper()}\)", table), f"{name} not from the environment"
    finished = FINISHED.findall(table)
    assert sorted((int(r), int(ws), int(s)) for r, ws, s, _ in finished) == [(0, 2, 6), (1, 2, 6)], table[-3000:]
    assert {(s["State"]["ExitCode"], s["RestartCount"]) for s in settings_run["first"]} == {(0, 0)}


def test_a_worker_started_after_its_job_finished_neither_trains_nor_forms_a_world(settings_run):
    text = settings_run["again_logs"]
    assert "job finished (step 6) while this container was part of it: nothing left to do; exit 0" in text, text
    assert "joined a world" not in text and "FINISHED" not in text, text
    again = next(s for s in settings_run["second"] if s["Id"] == settings_run["again"])
    assert again["State"]["ExitCode"] == 0


@pytest.fixture(scope="module")
def typo_run() -> dict:
    # `make up`'s way: the env file carries a name compose.yaml cannot list (a typo).
    compose = small_project("typo", DDP_STESP="10", DDP_STEPS="5")
    try:
        # `run` applies no restart policy: the launcher's own exit code, as docker compose ps would show it at first.
        once = compose("run", "--rm", "--no-deps", "worker", check=False, timeout=300)
        # A user's way: `DDP_LR=abc docker compose up --scale worker=2`, no env file.
        plain = Compose(compose.project, {**compose.env, "DDP_LR": "abc"}, plain=True)
        plain("up", "-d", "--no-build", "--scale", "worker=2", "worker", timeout=180)
        settled = wait_until_settled(compose, 2, 240)
        return {"once": once, "settled": settled, "logs": {s["Id"]: container_logs(s["Id"]) for s in settled}}
    finally:
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180, check=False)
        remove_image(compose.project)


TYPO = "config error: DDP_STESP: no such setting (did you mean DDP_STEPS?)"
BAD_LR = "config error: lr='abc' (from env DDP_LR): must be a float"


def test_an_unknown_setting_exits_2_naming_the_nearest(typo_run):
    once = typo_run["once"]
    output = once.stdout + once.stderr
    assert once.returncode == 2, output[-2000:]
    errors = [line for line in output.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and TYPO in errors[0], output[-2000:]
    # The env file is never read silently: the launcher names it and what it carried.
    assert re.search(r"settings from env file \S+\.cluster\.env \(written [\dT:Z-]+\): DDP_STEPS, DDP_STESP", output)


def test_a_bad_value_from_a_plain_up_stops_each_worker_once_naming_the_setting(typo_run):
    # Docker restarts no worker (restart: "no"): each container ends once, with its exit 2 and its one error.
    for s in typo_run["settled"]:
        text = typo_run["logs"][s["Id"]]
        assert (s["RestartCount"], s["State"]["ExitCode"]) == (0, 2), (s["RestartCount"], text[-3000:])
        errors = [line for line in text.splitlines() if "ERROR" in line]
        assert len(errors) == 1 and BAD_LR in errors[0], text[-3000:]
        assert "joining a world" not in text and "Traceback" not in text, text[-3000:]
        assert "settings from env file" not in text, "a plain up reads no env file"


@pytest.fixture(scope="module")
def oom_run() -> dict:
    # More than the containers hold (tests/e2e/drills/drill_faults.py: OOM_MODEL in OOM_MEMORY), as a user starts it.
    compose = small_project(
        "oom", plain=True, WORKER_MEMORY=OOM_MEMORY, DDP_MODEL_KWARGS=OOM_MODEL, DDP_STEPS="5", DDP_MICRO_BATCH="64"
    )
    try:
        compose("up", "-d", "--no-build", "--scale", "worker=2", "worker", timeout=180)
        settled = wait_until_settled(compose, 2, 300)
        return {"settled": settled, "logs": {s["Id"]: container_logs(s["Id"]) for s in settled}}
    finally:
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180, check=False)
        remove_image(compose.project)


def test_a_worker_over_its_memory_ends_in_one_line_naming_the_limit_and_the_fix_with_no_restart(oom_run):
    for s in oom_run["settled"]:
        text = oom_run["logs"][s["Id"]]
        assert (s["RestartCount"], s["State"]["ExitCode"]) == (0, 1), (s["RestartCount"], text[-3000:])
        errors = [line for line in text.splitlines() if "ERROR" in line]
        assert len(errors) == 1, text[-3000:]
        limit = int(OOM_MEMORY.rstrip("m"))
        assert re.search(
            rf"rank \d \(this container, \w+\) was killed for memory: over its container's limit of {limit} MiB",
            errors[0],
        ), errors[0]
        assert "parallel=zero2 or zero3" in errors[0] and "micro_batch than 64" in errors[0], errors[0]
        assert errors[0].endswith(": exit 1") and "Traceback" not in text, text[-3000:]
        assert "FINISHED" not in text


# The first world waits for every replica's launcher (LAUNCH_PEERS), so the spare enters the redundancy list as the
# world forms; it is refused after its grace (5 s, checked every 2 s: at most ~8 s). The job must outlast that:
# the trainers' start (import torch, seconds) and 600 steps of at least 20 ms (STEP_PACE_SECONDS) do, with room.
SPARE_STEPS = 600


@pytest.fixture(scope="module")
def spare_run() -> dict:
    # A world of at most 2 and 3 containers: one is a spare, one too many (the brief's 9th of 8, smaller).
    compose = small_project(
        "spare",
        MAX_WORKERS="2",
        LAUNCH_REDUNDANT_GRACE_SECONDS="5",
        DDP_STEPS=str(SPARE_STEPS),
        DDP_MIN_STEP_SECONDS=STEP_PACE_SECONDS,
        DDP_LOG_EVERY="200",
        DDP_CHECKPOINT_EVERY="200",
        DDP_METRICS_LINGER_SECONDS="0",
    )
    try:
        compose("up", "-d", "--no-build", "--scale", "worker=3", "worker", timeout=180)
        settled = wait_until_settled(compose, 3, RUN_DEADLINE_S)
        return {"settled": settled, "logs": {s["Id"]: container_logs(s["Id"]) for s in settled}}
    finally:
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180, check=False)
        remove_image(compose.project)


def test_one_container_too_many_is_refused_once_and_the_job_ends_once(spare_run):
    logs = spare_run["logs"]
    everything = "\n".join(logs.values())
    spares = [cid for cid, text in logs.items() if "one more than the world's maximum of 2" in text]
    assert len(spares) == 1, everything[-4000:]
    spare = next(s for s in spare_run["settled"] if s["Id"] == spares[0])
    assert (spare["RestartCount"], spare["State"]["ExitCode"]) == (0, 2), logs[spares[0]][-3000:]
    # One job, one ending: two FINISHED lines (ranks 0 and 1 of the world of 2), no world of 1 ever.
    finished = sorted((int(r), int(ws), int(s)) for r, ws, s, _ in FINISHED.findall(everything))
    assert finished == [(0, 2, SPARE_STEPS), (1, 2, SPARE_STEPS)], everything[-4000:]
    assert "joined a world of 1" not in everything and "AttributeError" not in everything, everything[-4000:]
    others = [s for s in spare_run["settled"] if s["Id"] != spares[0]]
    assert {(s["RestartCount"], s["State"]["ExitCode"]) for s in others} == {(0, 0)}


# The trainer is its launcher's child: forked from it (app.cluster.forked_trainer), its command line is the
# launcher's own; started as a new interpreter (LAUNCH_FORK=0, a CUDA build), `python -u -m app.train`.
TRAINER = "child of app.cluster.launch"
STORE = "app.cluster.rendezvous_store"


def kill_process(container: str, what: str, deadline_s: float = 120) -> None:
    """SIGKILL the store (``STORE``: the process whose command line holds it) or the trainer (``TRAINER``) inside
    ``container``: a crash, not `docker kill` (which Docker counts as a stop on request, and no restart policy
    undoes)."""
    code = (
        "import os, signal, sys\n"
        "def cmd(p):\n"
        "    try:\n"
        "        return open(f'/proc/{p}/cmdline', 'rb').read()\n"
        "    except OSError:\n"
        "        return b''  # gone, or PID 1's parent (0)\n"
        "def parent(p):\n"
        "    try:\n"
        "        return open(f'/proc/{p}/stat').read().rpartition(')')[2].split()[1]\n"
        "    except OSError:\n"
        "        return '0'\n"
        f"trainer, needle = {what == TRAINER}, {what.encode()!r}\n"
        "def launcher(p):  # python -m app.cluster.launch: not docker-init (PID 1, init: true), whose argv holds it\n"
        "    argv = cmd(p).split(b'\\0')\n"
        "    return argv[0].rsplit(b'/', 1)[-1].startswith(b'python') and b'app.cluster.launch' in argv\n"
        "killed = 0\n"
        "for p in filter(str.isdigit, os.listdir('/proc')):\n"
        "    mine = launcher(parent(p)) if trainer else needle in cmd(p)\n"
        "    if mine and int(p) != os.getpid():\n"
        "        os.kill(int(p), signal.SIGKILL)\n"
        "        killed += 1\n"
        "sys.exit(0 if killed else 3)\n"
    )
    deadline = time.monotonic() + deadline_s
    # A container that Docker is restarting refuses `exec` for a moment, and an agent between two worlds has no
    # trainer to kill: try again until it runs and kills one.
    while docker("exec", container, "python", "-c", code, check=False).returncode:
        assert time.monotonic() < deadline, f"cannot exec in {container[:12]} for {deadline_s} s"
        time.sleep(1)


def _restarted_and_healthy(state: dict) -> bool:
    return state["RestartCount"] >= 1 and state["State"].get("Health", {}).get("Status") == "healthy"


# Enough to train past the store's crash (at step 100) and a trainer's (once the world met again at the new store):
# each world resumes from the newest checkpoint (every 100 steps) and trains on to the end.
STORE_KILL_STEPS = 600


def joined_worlds(compose: Compose) -> list[str]:
    """The world sizes of every "joined a world" line of the project's workers, all containers."""
    return re.findall(r"joined a world of (\d+)", compose("logs", "--no-color", "worker").stdout)


@pytest.fixture(scope="module")
def store_kill_run() -> dict:
    # MAX_WORKERS=2: a world of both containers is full, so each re-formation forms as soon as both are in, not a
    # last call (RDZV_LAST_CALL_SECONDS, 15 s) later; the crashes and the meeting again are what is tested here.
    compose = small_project(
        "storekill",
        MAX_WORKERS="2",
        DDP_STEPS=str(STORE_KILL_STEPS),
        DDP_MIN_STEP_SECONDS=STEP_PACE_SECONDS,  # still training when the store crash is noticed
        DDP_LOG_EVERY="50",
        DDP_CHECKPOINT_EVERY="100",
        DDP_METRICS_LINGER_SECONDS="0",
    )
    try:
        compose("up", "-d", "--no-build", "--scale", "worker=2", "worker", timeout=180)
        store = next(c["ID"] for c in compose.containers() if c["Service"] == "rendezvous")
        deadline = time.monotonic() + RUN_DEADLINE_S
        while "INFO step 100/" not in compose("logs", "worker").stdout:
            assert time.monotonic() < deadline, "no training step in time"
            time.sleep(1)
        kill_process(store, STORE)
        # Restarted *and* healthy: until Docker has noticed the exit, the old state still reads "healthy" (under
        # load one CI-like run read it so, before the restart, and counted 0 restarts).
        while not _restarted_and_healthy(inspect(store)[0]):
            assert time.monotonic() < deadline, f"the store did not come back healthy: {inspect(store)[0]['State']}"
            time.sleep(1)
        store_restarts = inspect(store)[0]["RestartCount"]
        # The agents lose their store (RendezvousConnectionError): each launcher waits for it (no Docker restart)
        # and they meet again at the new, empty store, resuming from the checkpoint. Once both are in that world,
        # a worker crashes: the world must form again there too.
        while len(joined_worlds(compose)) < 4:
            assert time.monotonic() < deadline, f"no world at the new store: {joined_worlds(compose)}"
            time.sleep(1)
        victim = worker_rows(compose)[0]["ID"]
        kill_process(victim, TRAINER)  # its trainer, not its launcher: the agent restarts it (Docker restarts none)
        settled = wait_until_settled(compose, 2, RUN_DEADLINE_S)
        logs = compose("logs", "--no-color", "--timestamps", "worker").stdout
        return {"store_restarts": store_restarts, "settled": settled, "logs": logs}
    finally:
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180, check=False)
        remove_image(compose.project)


def test_the_store_comes_back_after_a_crash_and_the_workers_meet_there_again(store_kill_run):
    logs = store_kill_run["logs"]
    assert store_kill_run["store_restarts"] >= 1
    worlds = re.findall(r"joined a world of (\d+)", logs)
    # Each container three times: the first world, the one at the new store, the one after the trainer's crash.
    assert len(worlds) >= 6 and set(worlds) == {"2"}, logs[-4000:]
    finished = finished_lines(logs)
    ended = {(ws, s) for _, ws, s, _ in finished.values()}
    assert sorted(finished) == [0, 1] and ended == {(2, STORE_KILL_STEPS)}, logs[-4000:]
    assert {s["State"]["ExitCode"] for s in store_kill_run["settled"]} == {0}, logs[-4000:]


def test_the_first_world_forms_once_every_replica_is_in_not_a_last_call_later(cluster):
    # torch's rendezvous waits last_call_timeout (RDZV_LAST_CALL_SECONDS, 15 s) after its MIN-th member unless
    # the world is full at MAX; every replica ready means nobody else is coming (app/cluster/elastic.py): under
    # 15 s, which the last call alone would have taken. Every launcher waits for its peers' "ready" before it
    # joins, so the joins come within a moment of each other; measured from the *last* of the first world's joins,
    # a last call would show as ~15 s less that moment, and without one the world forms within seconds. 10 s
    # leaves room for the rendezvous rounds of four agents on a loaded 2-core machine (one CI-like run under
    # load took longer than 15 s from the *first* join, which is the start-up spread, not a last call).
    lines = cluster.logs.splitlines()
    joined = [stamp(line) for line in lines if f"INFO joined a world of {WORKERS} " in line]
    assert joined, cluster.logs[-4000:]
    joining = [stamp(line) for line in lines if "INFO joining a world of job" in line and stamp(line) <= min(joined)]
    assert len(joining) >= WORKERS, cluster.logs[-4000:]
    wait = min(joined) - max(joining)
    assert wait < 10, f"the first world formed {wait:.1f} s after the last of its containers joined"
