"""The world-size alert against the world sizes the cluster files declare: ``DDPWorldBelowMinimum``
(docker/prometheus/alerts.yml, carried into k8s/monitoring/prometheusrule.yaml) run by promtool on a world of
exactly each declared minimum, of each maximum, and of one worker fewer than the minimum.

The ranges come from where a user sets them: compose.yaml's ``--nnodes=1:${MAX_WORKERS:-8}`` (and the Makefile's
``MAX_WORKERS``, which must agree) and the ``--nnodes`` of each Kubernetes Job render. One rank per worker (compose,
the CPU Job; the GPU Jobs' ``gpu`` processes per pod count as one here: each rank is its own scrape target either
way, so the count scales with them). A page for a job at its minimum wakes someone for nothing; no page below it
leaves a job that cannot form a world unseen.

And the waits the rules promise: a rank gone for less than DDPRankDown's ``for:`` pages nobody, a finished job is
not "below its minimum" for as long as its minimum is remembered, and re-formations older than DDPRestartStorm's
window do not count. Each case is a promtool unit test written to a temporary file beside the rules.

    .venv/bin/python -m pytest tests/unit/test_alerts.py     # needs promtool (Debian's prometheus)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit.test_k8s import ROOT, container, flags, kustomize

ALERT = "DDPWorldBelowMinimum"
RULES = ROOT / "docker" / "prometheus" / "alerts.yml"


def promtool_test(tmp_path: Path, cases: str) -> subprocess.CompletedProcess:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool not found: apt-get install -y --no-install-recommends prometheus"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    test = tmp_path / "cases.test.yml"
    test.write_text(f"rule_files:\n  - {RULES}\n\nevaluation_interval: 10s\n\ntests:{cases}")
    return subprocess.run([path, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)


def compose_range() -> tuple[int, int]:
    text = (ROOT / "compose.yaml").read_text()
    low, high = re.search(r"--nnodes=(\d+):\$\{MAX_WORKERS:-(\d+)\}", text).groups()
    make = re.search(r"^MAX_WORKERS \?= (\d+)", (ROOT / "Makefile").read_text(), re.M)
    assert make and make[1] == high, "the Makefile's MAX_WORKERS and compose.yaml's default must be the same"
    return int(low), int(high)


def k8s_range(name: str) -> tuple[int, int]:
    nnodes = flags(container(kustomize(name)[("Job", "ddp-train")])["args"])["nnodes"]
    low, _, high = nnodes.partition(":")
    return int(low), int(high or low)


def _description() -> str:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rule = next(r for g in groups for r in g["rules"] if r.get("alert") == ALERT)
    return rule["annotations"]["description"]


def world(workers: int, minimum: int, leaves: bool, step: int = 100, target: int = 1000) -> str:
    """A promtool case: a job at ``step`` of ``target`` with ``workers`` workers whose minimum is ``minimum``;
    ``leaves``: the last worker goes away at 60 s. Expected at 4 minutes: a page exactly when fewer than
    ``minimum`` run."""
    series = {}
    for i in range(workers):
        values = "1x5 stale" if leaves and i == workers - 1 else "1x40"
        series[f'up{{instance="w{i}:9400"}}'] = values
        series[f'ddp_rank_info{{instance="w{i}:9400", rank="{i}"}}'] = values
    series['ddp_min_world_size{rank="0"}'] = f"{minimum}x40"
    series['ddp_step{rank="0"}'] = f"{step}x40"
    series['ddp_target_steps{rank="0"}'] = f"{target}x40"
    running = workers - 1 if leaves else workers
    page = {
        "exp_labels": {"severity": "critical"},
        "exp_annotations": {
            "summary": f"{running} workers run, fewer than the world's minimum",
            "description": _description(),
        },
    }
    case = {
        "interval": "10s",
        "input_series": [{"series": k, "values": v} for k, v in series.items()],
        "alert_rule_test": [{"eval_time": "4m", "alertname": ALERT, "exp_alerts": [page] if running < minimum else []}],
    }
    return "\n" + yaml.safe_dump([case], sort_keys=False, width=1000)


RANGES = {"compose": compose_range, "k8s-cpu": lambda: k8s_range("cpu"), "k8s-elastic": lambda: k8s_range("elastic")}


@pytest.mark.parametrize("where", list(RANGES))
def test_no_page_at_the_minimum_or_the_maximum_and_a_page_one_below(tmp_path, where):
    low, high = RANGES[where]()
    assert 1 <= low <= high
    cases = world(low, low, leaves=False) + world(high, low, leaves=False) + world(low, low, leaves=True)
    result = promtool_test(tmp_path, cases)
    assert result.returncode == 0, f"{where} ({low}:{high}):\n{result.stdout}{result.stderr}"


# A worker leaves discovery for 20 s (a DNS blip: gone at 40 s, back at 60 s), within DDPRankDown's 20 s `for:`.
# Nobody is paged while it is gone: an absence shorter than the `for:` is no page.
RANK_GONE = """
  - interval: 10s
    input_series:
      - series: 'up{instance="a:9400"}'
        values: '1x12'
      - series: 'up{instance="b:9400"}'
        values: '1 1 1 1 stale _ 1x6'
      - series: 'ddp_rank_info{instance="a:9400", rank="0"}'
        values: '1x12'
      - series: 'ddp_rank_info{instance="b:9400", rank="1"}'
        values: '1 1 1 1 stale _ 1x6'
      - series: 'ddp_world_size{instance="a:9400", rank="0"}'
        values: '2x12'
      - series: 'ddp_world_size{instance="b:9400", rank="1"}'
        values: '2 2 2 2 stale _ 2x6'
    alert_rule_test:
      - eval_time: 50s
        alertname: DDPRankDown
        exp_alerts: []
      - eval_time: 100s
        alertname: DDPRankDown
        exp_alerts: []
"""

# A job that finished at step 200 of 200 and whose workers left: no DDPWorldBelowMinimum for as long as its
# minimum world size is remembered (10 minutes), not only while its last step is.
FINISHED = """
  - interval: 10s
    input_series:
      - series: 'ddp_rank_info{instance="a:9400", rank="0"}'
        values: '1x5 stale'
      - series: 'ddp_min_world_size{rank="0"}'
        values: '1x5 stale'
      - series: 'ddp_step{rank="0"}'
        values: '150 160 170 180 200 200 stale'
      - series: 'ddp_target_steps{rank="0"}'
        values: '200x5 stale'
    alert_rule_test:
      - eval_time: 7m
        alertname: DDPWorldBelowMinimum
        exp_alerts: []
      - eval_time: 9m
        alertname: DDPWorldBelowMinimum
        exp_alerts: []
"""

# Re-formations older than the rule's 15 minutes (the window its summary states) do not count: two early ones,
# twenty quiet minutes, one more.
OLD_RESTARTS = """
  - interval: 1m
    input_series:
      - series: 'ddp_world_generation{rank="0"}'
        values: '1 2 3 3x20 4 4'
    alert_rule_test:
      - eval_time: 24m
        alertname: DDPRestartStorm
        exp_alerts: []
"""


@pytest.mark.parametrize(
    "cases", [RANK_GONE, FINISHED, OLD_RESTARTS], ids=["rank-gone-within-for", "finished-job", "old-restarts"]
)
def test_the_alert_waits_as_documented(tmp_path, cases):
    result = promtool_test(tmp_path, cases)
    assert result.returncode == 0, result.stdout + result.stderr


# Worker b is told to stop (SIGTERM) at 20 s and leaves at 40 s; a trains on. A stop on request is remembered as
# long as a gone rank is (10 minutes): no DDPRankDown for b at 8 minutes either.
STOPPED_ON_REQUEST = """
  - interval: 10s
    input_series:
      - series: 'up{instance="a:9400"}'
        values: '1x72'
      - series: 'up{instance="b:9400"}'
        values: '1 1 1 1 stale'
      - series: 'ddp_rank_info{instance="a:9400", rank="0"}'
        values: '1x72'
      - series: 'ddp_rank_info{instance="b:9400", rank="1"}'
        values: '1 1 1 1 stale'
      - series: 'ddp_stop_requested{instance="a:9400", rank="0"}'
        values: '0x72'
      - series: 'ddp_stop_requested{instance="b:9400", rank="1"}'
        values: '0 0 1 1 stale'
      - series: 'ddp_world_size{instance="a:9400", rank="0"}'
        values: '2 2 2 2 2 1x67'
      - series: 'ddp_world_size{instance="b:9400", rank="1"}'
        values: '2 2 2 2 stale'
      - series: 'ddp_step{instance="a:9400", rank="0"}'
        values: '100+1x72'
      - series: 'ddp_target_steps{instance="a:9400", rank="0"}'
        values: '1000x72'
    alert_rule_test:
      - eval_time: 8m
        alertname: DDPRankDown
        exp_alerts: []
"""


def everyone_gone(minimum: int) -> str:
    """Every worker of a job short of its target leaves at 60 s: still paged at 8 minutes, since the job's minimum
    is remembered for 10 (no world can form until workers come back, however long they stay away)."""
    series = {}
    for i in range(minimum):
        series[f'up{{instance="w{i}:9400"}}'] = "1x5 stale"
        series[f'ddp_rank_info{{instance="w{i}:9400", rank="{i}"}}'] = "1x5 stale"
    series['ddp_min_world_size{rank="0"}'] = f"{minimum}x5 stale"
    series['ddp_step{rank="0"}'] = "100x5 stale"
    series['ddp_target_steps{rank="0"}'] = "1000x5 stale"
    page = {
        "exp_labels": {"severity": "critical"},
        "exp_annotations": {"summary": "0 workers run, fewer than the world's minimum", "description": _description()},
    }
    case = {
        "interval": "10s",
        "input_series": [{"series": k, "values": v} for k, v in series.items()],
        "alert_rule_test": [{"eval_time": "8m", "alertname": ALERT, "exp_alerts": [page]}],
    }
    return "\n" + yaml.safe_dump([case], sort_keys=False, width=1000)


@pytest.mark.parametrize("case", ["stopped-on-request", "everyone-gone"])
def test_a_worker_gone_is_remembered_as_long_as_its_stop_and_the_jobs_minimum(tmp_path, case):
    result = promtool_test(tmp_path, STOPPED_ON_REQUEST if case == "stopped-on-request" else everyone_gone(2))
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_job_short_of_its_minimum_before_its_first_step_is_paged(tmp_path):
    # Before a trainer's first step its ddp_step and ddp_target_steps gauges read 0: that is a job starting (or stuck
    # starting), not one that reached its target, so one worker of a minimum of two is paged as any other time.
    result = promtool_test(tmp_path, world(1, 2, leaves=False, step=0, target=0))
    assert result.returncode == 0, result.stdout + result.stderr
