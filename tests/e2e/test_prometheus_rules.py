"""The alert and recording rules, the scrape config and the alert routing, checked by Prometheus' own tools.

    promtool test rules docker/prometheus/alerts.test.yml      # the unit tests of each alert (series in, alerts out)
    promtool check config docker/prometheus/prometheus.yml     # the scrape config and the rule files it loads
    amtool check-config docker/alertmanager/alertmanager.yml   # Alertmanager's routing to the alert-log receiver

promtool comes with Debian's `prometheus` package (.ci/run installs it), amtool with `prometheus-alertmanager`.
Outside CI a missing tool skips its tests, saying so; under CI=true it fails them. The receiver
(docker/alertmanager/alert_log.py) is tested for real: a server on a free port, sent what Alertmanager sends.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.e2e.cluster_files import ROOT

pytestmark = pytest.mark.e2e
PROM_DIR = ROOT / "docker/prometheus"


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} not found: apt-get install -y --no-install-recommends {package}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def promtool() -> str:
    return _tool("promtool", "prometheus")


@pytest.fixture(scope="module")
def amtool() -> str:
    return _tool("amtool", "prometheus-alertmanager")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=PROM_DIR, capture_output=True, text=True, timeout=60)


def test_alert_unit_tests_pass(promtool):
    result = _run(promtool, "test", "rules", "alerts.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# The stall rule's threshold: 10x the median step time, at least 30 s.
_STALL_THRESHOLD = """
            > on() clamp_min(
                10 * (quantile(0.5,
                        (rate(ddp_step_duration_seconds_sum[5m]) / rate(ddp_step_duration_seconds_count[5m])) > 0)
                      or on() vector(0)),
                30)
"""

_WORKERS_RUN_1H = "count(up and on(instance) max by (instance) (last_over_time(ddp_rank_info[1h])))"
_WORKERS_RUN_10M = "count(up and on(instance) max by (instance) (last_over_time(ddp_rank_info[10m])))"
_STORM_FROM_PROCESSES = """          max(
            changes(process_start_time_seconds[15m])
              and on(instance) max by (instance) (last_over_time(ddp_rank_info[15m]))
          ) >= 3
            or on()
"""

# Each a weaker rule that the unit tests must reject: they test the rules, not only their syntax.
MUTATIONS = {
    "straggler at 3x the median": ("DDPStraggler", "1.5 * quantile(0.5,", "3 * quantile(0.5,"),
    # The 30 s floor alone: a job whose steps take over 30 s (one slow rank among four) would page at every step.
    "stall without the median": ("DDPTrainingStalled", _STALL_THRESHOLD, " > 30\n"),
    "stall at 100x the median": ("DDPTrainingStalled", "10 * (quantile(0.5,", "100 * (quantile(0.5,"),
    # A trainer waiting for its first world exports 0: a slow first rendezvous would read as a stall.
    "stall before the first step": (
        "DDPTrainingStalled",
        "max(ddp_last_step_timestamp_seconds > 0)",
        "max(ddp_last_step_timestamp_seconds)",
    ),
    # Without "no worker runs", every running job below its target would page.
    "job ended without the workers check": ("DDPJobEndedEarly", f"unless on() {_WORKERS_RUN_1H} > 0", ""),
    # Trainers that answer instead of workers that run: a long re-formation would page.
    "job ended when no rank answers": ("DDPJobEndedEarly", _WORKERS_RUN_1H, "count(ddp_rank_info)"),
    # At or below the target: a job that finished would page once its workers are gone.
    "job ended at the target": ("DDPJobEndedEarly", "ddp_step[1h])) <", "ddp_step[1h])) <="),
    # Any rank seen lately, not only those of a world of today's size: a planned scale-down would page.
    # Every rank silent (no `up` check): the survivors, whose trainers restart in a re-formation, would page.
    "rank down for survivors that restart": (
        "DDPRankDown",
        "unless on(instance) up)",
        "unless on(instance) ddp_rank_info)",
    ),
    # Without "stop requested", a scale-down or `docker compose stop` would page for the rank that left on purpose.
    "rank down for a planned departure": (
        "DDPRankDown",
        "\n            unless on(instance) (max by (instance) (last_over_time(ddp_stop_requested[10m])) == 1)",
        "",
    ),
    # Without "finished", ranks that leave a finished job one by one would page.
    "rank down after the end": (
        "DDPRankDown",
        "\n            unless on() (max(last_over_time(ddp_target_steps[10m])) > 0)"
        " <= on() max(last_over_time(ddp_step[10m]))",
        "",
    ),
    # 0 of 0 steps is no finish: ranks waiting in their first rendezvous would hide a rank that is gone.
    "rank down hidden by ranks not yet started": (
        "DDPRankDown",
        "(max(last_over_time(ddp_target_steps[10m])) > 0) <=",
        "max(last_over_time(ddp_target_steps[10m])) <=",
    ),
    # Without "their world is whole", a survivor still restarting while the others answer would page.
    "rank down for a survivor still joining": (
        "DDPRankDown",
        "\n                and on() count(ddp_rank_info) >= on() max(ddp_world_size)",
        "",
    ),
    # Without the silent-target branch, a paused or hung worker (still discovered) never pages.
    "rank down blind to a hung worker": ("DDPRankDown", "max_over_time(up[1m])) == 0", "max_over_time(up[1m])) < 0"),
    # Without the timed-out-scrapes branch, a SIGSTOPped trainer whose peers re-form with it never pages.
    "rank down blind to a stopped trainer": (
        "DDPRankDown",
        "min_over_time(scrape_duration_seconds[20s])) >= 4",
        "min_over_time(scrape_duration_seconds[20s])) >= 40",
    ),
    # Any failed scrape, not only a timed-out one: every survivor restarting its trainer (refused) would page.
    "rank down for refused scrapes": (
        "DDPRankDown",
        "min_over_time(scrape_duration_seconds[20s])) >= 4",
        "min_over_time(scrape_duration_seconds[20s])) >= 0",
    ),
    # 90 s: a killed rank would page later than a minute.
    "rank down after 90 s": ("DDPRankDown", "for: 20s", "for: 90s"),
    # Any rank it ever held: a worker renumbered by a re-formation would page twice, once under a rank now another's.
    "rank down names every rank it held": (
        "DDPRankDown",
        "\n                == on(instance) group_left()\n"
        "              max by (instance) (max_over_time(timestamp(ddp_rank_info)[10m:5s]))\n",
        "\n",
    ),
    # At or below: a steady world would page.
    "world shrank on a steady world": ("DDPWorldShrank", "max(ddp_world_size) <", "max(ddp_world_size) <="),
    # Without "finished", every job would page once its workers exit at the end.
    "below minimum after the end": (
        "DDPWorldBelowMinimum",
        "unless on() max(last_over_time(ddp_step[10m])) >= on() (max(last_over_time(ddp_target_steps[10m])) > 0)",
        "",
    ),
    # Trainers that answer instead of workers that run: a long re-formation would page.
    "below minimum when no rank answers": ("DDPWorldBelowMinimum", _WORKERS_RUN_10M, "count(ddp_rank_info)"),
    # The checkpoint's generation alone: a restart loop that reloads one checkpoint never pages.
    "storm from the checkpoint only": ("DDPRestartStorm", _STORM_FROM_PROCESSES, ""),
    # Every process, Prometheus' own included: a scrape of anything that restarts would count.
    "storm from any process": (
        "DDPRestartStorm",
        "\n              and on(instance) max by (instance) (last_over_time(ddp_rank_info[15m]))",
        "",
    ),
    # Four restarts instead of three: a storm would be noticed one failure later.
    "storm at four restarts": ("DDPRestartStorm", "          ) >= 3\n", "          ) >= 4\n"),
    "storm at four generations": (
        "DDPRestartStorm",
        "ddp_world_generation[15m])) >= 3",
        "ddp_world_generation[15m])) >= 4",
    ),
}


def only_the_alert(alert: str, rules: dict, tests: dict) -> tuple[dict, dict]:
    """The rule of this alert alone, and its own unit tests alone (in the groups that hold them, with their series).

    Every test group evaluates every rule: the whole file costs seconds of promtool per run (DDPRankDown's
    subqueries), so a mutation of one alert is checked against that alert's tests, which must catch it anyway."""
    kept = [rule for group in rules["groups"] for rule in group["rules"] if rule.get("alert") == alert]
    groups = []
    for group in tests["tests"]:
        own = [case for case in group.get("alert_rule_test", []) if case["alertname"] == alert]
        if own:
            groups.append({**group, "alert_rule_test": own})
    assert len(kept) == 1 and groups, f"{alert}: no rule or no unit test of its own"
    return {"groups": [{"name": alert, "rules": kept}]}, {**tests, "tests": groups}


def promtool_on_the_alert(promtool: str, folder: Path, alert: str, rules_text: str) -> subprocess.CompletedProcess:
    """``promtool test rules`` on this alert's rule (out of ``rules_text``) and its own tests, written to ``folder``."""
    tests = yaml.safe_load((PROM_DIR / "alerts.test.yml").read_text())
    rule, own_tests = only_the_alert(alert, yaml.safe_load(rules_text), tests)
    (folder / "alerts.yml").write_text(yaml.safe_dump(rule, sort_keys=False))
    (folder / "alerts.test.yml").write_text(yaml.safe_dump(own_tests, sort_keys=False))
    return subprocess.run(
        [promtool, "test", "rules", "alerts.test.yml"], cwd=folder, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("alert", sorted({alert for alert, _, _ in MUTATIONS.values()}))
def test_each_alert_alone_passes_its_own_tests(promtool, tmp_path, alert):
    # What makes a failure below the mutation's doing, not the cut's.
    result = promtool_on_the_alert(promtool, tmp_path, alert, (PROM_DIR / "alerts.yml").read_text())
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("mutation", MUTATIONS, ids=list(MUTATIONS))
def test_alert_unit_tests_can_fail(promtool, tmp_path, mutation):
    alert, old, new = MUTATIONS[mutation]
    rules = (PROM_DIR / "alerts.yml").read_text()
    assert rules.count(old) == 1
    result = promtool_on_the_alert(promtool, tmp_path, alert, rules.replace(old, new))
    assert result.returncode != 0 and alert in result.stdout + result.stderr, result.stdout + result.stderr


def test_the_hung_rank_threshold_is_a_timed_out_scrape_wherever_the_rules_run():
    """A scrape that took >= the threshold timed out: it must sit below every scrape config's timeout (by default
    its interval, capped at 10 s) and well above a refused connection's milliseconds."""
    rules = yaml.safe_load((ROOT / "docker/prometheus/alerts.yml").read_text())
    (expr,) = [r["expr"] for g in rules["groups"] for r in g["rules"] if r.get("alert") == "DDPRankDown"]
    threshold = float(re.search(r"scrape_duration_seconds\[\w+\]\)\) >= ([\d.]+)", expr)[1])
    config = yaml.safe_load((ROOT / "docker/prometheus/prometheus.yml").read_text())
    podmonitor = yaml.safe_load((ROOT / "k8s/monitoring/podmonitor.yaml").read_text())
    intervals = [config["global"]["scrape_interval"]] + [
        e["interval"] for e in podmonitor["spec"]["podMetricsEndpoints"]
    ]
    for interval in intervals:
        timeout = min(float(interval.rstrip("s")), 10.0)
        assert 0.5 * timeout <= threshold < timeout, (interval, threshold)


def test_scrape_config_and_rules_are_valid(promtool):
    result = _run(promtool, "check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout + result.stderr
    counts = {
        name: sum(len(g["rules"]) for g in yaml.safe_load((ROOT / "docker/prometheus" / name).read_text())["groups"])
        for name in ("alerts.yml", "recording.yml")
    }
    for name, count in counts.items():  # every rule of each file loaded: none lost to a syntax slip
        assert f"{name}\n  SUCCESS: {count} rules found" in out, out


def test_recording_unit_tests_pass(promtool):
    result = _run(promtool, "test", "rules", "recording.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


# Each a wrong recording rule that recording.test.yml must reject.
RECORDING_MUTATIONS = {
    "median recorded as the max": (
        "quantile by (job) (0.5, rank:ddp_own_work_per_step_seconds:rate1m)",
        "max by (job) (rank:ddp_own_work_per_step_seconds:rate1m)",
    ),
    "own work without the exposed wait": (" - rate(ddp_exposed_comm_duration_seconds_sum[1m])", ""),
    "p50 of the wrong quantile": (
        "histogram_quantile(0.5, sum by (job, rank, le) (rate(ddp_step_duration_seconds_bucket",
        "histogram_quantile(0.9, sum by (job, rank, le) (rate(ddp_step_duration_seconds_bucket",
    ),
}


@pytest.mark.parametrize("mutation", RECORDING_MUTATIONS, ids=list(RECORDING_MUTATIONS))
def test_recording_unit_tests_can_fail(promtool, tmp_path, mutation):
    old, new = RECORDING_MUTATIONS[mutation]
    rules = (PROM_DIR / "recording.yml").read_text()
    assert rules.count(old) == 1
    (tmp_path / "recording.yml").write_text(rules.replace(old, new))
    shutil.copy(PROM_DIR / "recording.test.yml", tmp_path)
    result = subprocess.run(
        [promtool, "test", "rules", "recording.test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr, result.stdout + result.stderr


def test_recording_rules_read_only_what_the_worker_exports():
    # A rule over a metric nobody exports records nothing, silently: the dashboard panel on it stays empty.
    from tests.e2e.cluster_files import exported_metric_names, metric_names

    known = exported_metric_names()
    for group in yaml.safe_load((PROM_DIR / "recording.yml").read_text())["groups"]:
        for rule in group["rules"]:
            assert metric_names(rule["expr"]) <= known, (rule["record"], metric_names(rule["expr"]) - known)
            known.add(rule["record"])  # later rules may read it


def test_communication_share_is_a_dashboard_fact_not_a_page():
    # Over half of every healthy CPU-demo step is exposed communication: true, shown on the dashboard, no incident.
    rules = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"][0]["rules"]
    exprs = " ".join(r["expr"] for r in rules if r["alert"] != "DDPStraggler")
    assert "ddp_exposed_comm_duration_seconds" not in exprs, "an alert on the communication share pages healthy runs"


def test_alertmanager_routes_every_alert_to_the_log(amtool):
    result = subprocess.run(
        [amtool, "check-config", "alertmanager.yml"],
        cwd=ROOT / "docker/alertmanager",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((ROOT / "docker/alertmanager/alertmanager.yml").read_text())
    (receiver,) = config["receivers"]
    assert config["route"]["receiver"] == receiver["name"] and not config["route"].get("routes")
    assert receiver["webhook_configs"][0]["url"] == "http://alert-log:9095/"  # the compose service below
    prometheus = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    assert prometheus["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]


@pytest.fixture()
def alert_log():
    """docker/alertmanager/alert_log.py on a free port: (its URL, its process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = ROOT / "docker/alertmanager/alert_log.py"
    proc = subprocess.Popen(
        [sys.executable, "-u", str(script), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "listening" in proc.stdout.readline()
        yield f"http://127.0.0.1:{port}/", proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _post(url: str, body: bytes) -> int:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def test_alert_log_prints_each_alert_in_one_line(alert_log):
    url, proc = alert_log
    # Alertmanager's webhook body (version 4), trimmed to what the receiver reads: two ranks gone, one resolved.
    notification = {
        "version": "4",
        "status": "firing",
        "alerts": [
            {
                "status": "firing",
                "labels": {"alertname": "DDPRankDown", "severity": "critical", "rank": "3", "job": "ddp-worker"},
                "annotations": {"summary": "Rank 3 is gone; the world of 4 still expects it"},
            },
            {
                "status": "resolved",
                "labels": {"alertname": "DDPRankDown", "severity": "critical", "rank": "1"},
                "annotations": {"summary": "Rank 1 is gone; the world of 4 still expects it"},
            },
        ],
    }
    assert _post(url, json.dumps(notification).encode()) == 200
    lines = [proc.stdout.readline().rstrip("\n") for _ in range(2)]
    assert re.fullmatch(
        r"\S+Z FIRING critical DDPRankDown rank=3: Rank 3 is gone; the world of 4 still expects it", lines[0]
    )
    assert " RESOLVED critical DDPRankDown rank=1: " in lines[1]


def test_alert_log_rejects_what_is_not_a_notification(alert_log):
    url, proc = alert_log
    assert _post(url, b"not json") == 400
    assert _post(url, b'{"status": "firing"}') == 400
    proc.kill()
    out, err = proc.communicate(timeout=10)
    assert out == "", "nothing printed for a bad body"
    assert err.count("rejected a POST") == 2 and "not JSON" in err and 'no "alerts" list' in err
