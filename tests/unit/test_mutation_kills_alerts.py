"""Alert-rule cases that generated mutants showed missing (`make mutants`, tools/mutation_triage.yaml): each is a
promtool unit test of docker/prometheus/alerts.yml, written to a temporary file beside the rules.

.venv/bin/python -m pytest tests/unit/test_mutation_kills_alerts.py     # needs promtool (Debian's prometheus)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[2] / "docker" / "prometheus" / "alerts.yml"

# A worker leaves discovery for 20 s (a DNS blip: gone at 40 s, back at 60 s), within DDPRankDown's 20 s `for:`.
# Nobody is paged while it is gone (an absence shorter than the `for:` is no page). Kills the mutant that drops the
# `for:`.
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
# minimum world size is remembered (10 minutes), not only while its last step is. Kills a shorter step look-back.
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

# Re-formations older than the rule's 15 minutes do not count: two early ones, twenty quiet minutes, one more.
# Kills a look-back that reaches further back than the one the alert's summary states.
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


@pytest.mark.parametrize(
    "cases", [RANK_GONE, FINISHED, OLD_RESTARTS], ids=["rank-gone-within-for", "finished-job", "old-restarts"]
)
def test_the_alert_waits_as_documented(tmp_path, cases):
    result = promtool_test(tmp_path, cases)
    assert result.returncode == 0, result.stdout + result.stderr
