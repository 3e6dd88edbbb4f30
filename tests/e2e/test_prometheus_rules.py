"""The alert rules and the scrape config, checked by Prometheus' own promtool.

    promtool test rules docker/prometheus/alerts.test.yml      # the unit tests of each alert (series in, alerts out)
    promtool check config docker/prometheus/prometheus.yml     # the scrape config and the rule file it loads

promtool comes with Debian's `prometheus` package (.ci/run installs it). Outside CI a missing promtool skips these
tests, saying so; under CI=true it fails them.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.e2e.cluster_files import ROOT

pytestmark = pytest.mark.e2e
PROM_DIR = ROOT / "docker/prometheus"


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool not found: apt-get install -y --no-install-recommends prometheus"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=PROM_DIR, capture_output=True, text=True, timeout=60)


def test_alert_unit_tests_pass(promtool):
    result = _run(promtool, "test", "rules", "alerts.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_alert_unit_tests_can_fail(promtool, tmp_path):
    # The same tests against a straggler threshold of 3× must fail: they test the rule, not only its syntax.
    rules = (PROM_DIR / "alerts.yml").read_text()
    assert rules.count("1.5 * quantile(0.5,") == 1
    (tmp_path / "alerts.yml").write_text(rules.replace("1.5 * quantile(0.5,", "3 * quantile(0.5,"))
    shutil.copy(PROM_DIR / "alerts.test.yml", tmp_path)
    result = subprocess.run([promtool, "test", "rules", "alerts.test.yml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0 and "DDPStraggler" in result.stdout + result.stderr


def test_scrape_config_and_rules_are_valid(promtool):
    result = _run(promtool, "check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 rules found" in result.stdout + result.stderr
