"""The cluster's files, checked without running them: what would break `--scale`, Grafana's wiring or the contract.

The real run is test_compose_cluster.py; these catch the mistakes that run cannot see here (Grafana does not run
here) or that only bite a user elsewhere (a published port on every interface, a floating image tag).

    .venv/bin/python -m pytest tests/e2e/test_cluster_files.py
"""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from tests.e2e.cluster_files import (
    COMPOSE,
    COMPOSE_LOCAL,
    DATASOURCES,
    PIPELINE_ROW,
    ROOT,
    SCRAPE_SERIES,
    ZERO_ROW,
    annotation_queries,
    compose_services,
    dashboard,
    exported_metric_names,
    metric_names,
    panel_queries,
)


def test_every_panel_query_reads_only_metrics_the_worker_exports():
    exported = exported_metric_names() | SCRAPE_SERIES
    recording = yaml.safe_load((ROOT / "docker/prometheus/recording.yml").read_text())["groups"]
    exported |= {r["record"] for g in recording for r in g["rules"]}  # their own inputs: test_prometheus_rules
    queries = panel_queries(pipeline=True, zero=True)
    assert len(queries) >= 15
    unknown = {
        f"{q.panel} [{q.ref}]": sorted(metric_names(q.expr) - exported)
        for q in queries
        if metric_names(q.expr) - exported
    }
    assert not unknown, f"panels query metrics app/worker/metrics.py does not export: {unknown}"
    assert all(metric_names(q.expr) for q in queries), "a panel query names no metric at all"
    for expr in annotation_queries():
        assert metric_names(expr) and metric_names(expr) <= exported, expr


def test_pipeline_panels_sit_in_their_own_row_and_the_rest_in_others():
    everything, data_parallel = panel_queries(pipeline=True), panel_queries()
    pipeline = [q for q in everything if q not in data_parallel]
    assert pipeline and all(q.row.startswith(PIPELINE_ROW) for q in pipeline)
    assert all("ddp_pipeline_" in q.expr for q in pipeline), "a pipeline-row panel on data-parallel metrics"
    assert not [q for q in data_parallel if "ddp_pipeline_" in q.expr], "pipeline metrics outside the Pipeline row"


def test_zero_panels_sit_in_their_own_row_and_the_rest_in_others():
    everything, data_parallel = panel_queries(zero=True), panel_queries()
    zero = [q for q in everything if q not in data_parallel]
    assert zero and all(q.row.startswith(ZERO_ROW) for q in zero)
    assert all("ddp_zero_" in q.expr for q in zero), "a ZeRO-row panel on other metrics"
    assert not [q for q in data_parallel if "ddp_zero_" in q.expr], "ZeRO metrics outside the ZeRO row"
    shown = " ".join(q.expr for q in zero)
    for metric in ("ddp_zero_parameter_bytes", "ddp_zero_gradient_bytes", "ddp_zero_optimizer_state_bytes"):
        assert metric in shown, f"the ZeRO row does not show {metric}"


def test_dashboard_shows_the_elastic_world_and_annotates_its_changes():
    elastic = " ".join(q.expr for q in panel_queries() if q.row.startswith("Elastic"))
    for metric in ("ddp_world_size", "ddp_min_world_size", "ddp_world_generation", "ddp_reformation_seconds"):
        assert metric in elastic, f"the Elastic row does not show {metric}"
    assert any("ddp_world_generation" in e for e in annotation_queries()), "no annotation for a re-formed world"
    counts = [q.expr for q in panel_queries() if q.panel == "Ranks up"]
    assert counts == ["count(ddp_rank_info)"], "ranks, not scrape targets (one pod may hold 8 ranks)"


def test_every_alert_reads_only_metrics_the_worker_exports():
    exported = exported_metric_names() | SCRAPE_SERIES
    rules = yaml.safe_load((ROOT / "docker/prometheus/alerts.yml").read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} >= {
        "DDPRankDown",
        "DDPTrainingStalled",
        "DDPStraggler",
        "DDPWorldShrank",
        "DDPWorldBelowMinimum",
        "DDPRestartStorm",
    }
    unknown = {
        r["alert"]: sorted(metric_names(r["expr"]) - exported) for r in rules if metric_names(r["expr"]) - exported
    }
    assert not unknown, f"alerts on metrics app/worker/metrics.py does not export: {unknown}"


def test_dashboard_names_the_provisioned_datasource_by_uid():
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    dash = dashboard()
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p.get("targets", [])}
    uids |= {p["datasource"]["uid"] for p in dash["panels"] if "datasource" in p}
    uids |= {v["datasource"]["uid"] for v in dash["templating"]["list"]}
    uids |= {a["datasource"]["uid"] for a in dash["annotations"]["list"]}
    assert uids == {source["uid"]} == {"prometheus"}
    assert source["url"] == "http://prometheus:9090"  # the compose service's name and port


def test_dashboard_answers_the_questions_it_is_opened_for():
    titles = " | ".join(q.panel for q in panel_queries()).lower()
    for needed in (
        "step time p50 / p95",
        "all-reduce latency per bucket",
        "exposed communication share",
        "bus bandwidth",
        "samples/s",
        "loss",
        "world size",
        "ranks up",
        "slowest",
        "median",
        "time since last step",
    ):
        assert needed in titles, f"no panel for {needed!r}"


def test_compose_scales_and_publishes_only_on_loopback():
    text = COMPOSE.read_text() + COMPOSE_LOCAL.read_text()
    assert "container_name" not in re.sub(r"#.*", "", text), "container_name blocks --scale"
    services = compose_services(COMPOSE)
    assert "hostname" not in services["worker"], "a fixed hostname makes every replica the same rendezvous node"
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond this machine"
    assert {n for n, s in services.items() if s.get("ports")} == {"prometheus", "alertmanager", "grafana"}
    command = " ".join(services["worker"]["command"])
    # Elastic: the world is whoever is there, from 1 to MAX_WORKERS, meeting at the store service.
    assert re.search(r"--nnodes=1:\$\{MAX_WORKERS:-\d+\}", command), command
    assert "--rdzv-backend=c10d" in command and "--rdzv-endpoint=rendezvous:29400" in command
    assert services["worker"]["deploy"]["replicas"] == "${WORKERS:-4}"  # what `up` starts without --scale


def test_compose_pins_third_party_images():
    services = compose_services(COMPOSE)
    for name in ("prometheus", "alertmanager", "grafana"):
        image = services[name]["image"]
        assert re.fullmatch(r"[a-z/]+:v?\d+\.\d+\.\d+", image), f"{name}: {image} is not pinned to a version"


@pytest.mark.parametrize("service", ["rendezvous", "worker"])
def test_workers_and_store_are_one_image_running_as_non_root(service):
    assert compose_services(COMPOSE)[service]["image"] == "${IMAGE_NAME:-${COMPOSE_PROJECT_NAME}}:${IMAGE_TAG:-latest}"
    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    final_stage = dockerfile.rsplit("\nFROM ", 1)[1]
    assert re.search(r"^USER 10001", final_stage, re.M), "the runtime stage must not run as root"
    assert "/tmp/wheels" not in final_stage, "the wheelhouse must stay in the build stage"


def test_grafana_admin_password_is_random_per_cluster_and_kept(tmp_path):
    """Grafana's entrypoint, run as compose would run it (with `env` standing in for Grafana's /run.sh)."""
    grafana = compose_services()["grafana"]
    assert not any(k.startswith("GF_SECURITY_ADMIN") for k in grafana.get("environment", {})), "a fixed password"
    sh, flag, script, name = grafana["entrypoint"]
    script = script.replace("$$", "$").replace("exec /run.sh", "exec env")  # compose's escaping undone

    def start() -> tuple[str, str]:
        env = {"PATH": "/usr/bin:/bin", "GF_PATHS_DATA": str(tmp_path)}
        result = subprocess.run([sh, flag, script, name], env=env, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        return (tmp_path / "admin-password").read_text(), result.stdout

    password, environ = start()
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password), password
    assert (tmp_path / "admin-password").stat().st_mode & 0o777 == 0o600  # Grafana's user only
    assert f"GF_SECURITY_ADMIN_PASSWORD__FILE={tmp_path}/admin-password" in environ.splitlines()
    assert start()[0] == password  # a restart keeps the password the admin account was made with
