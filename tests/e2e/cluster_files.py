"""Reading the cluster's files the way the tests need them: dashboard queries, compose services, scrape settings.

Shared by test_cluster_files.py (static checks, no Docker) and test_compose_cluster.py (the real run).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker/grafana/dashboards/ddp-cluster.json"
DATASOURCES = ROOT / "docker/grafana/provisioning/datasources/prometheus.yml"
PROMETHEUS_CONFIG = ROOT / "docker/prometheus/prometheus.yml"
COMPOSE = ROOT / "compose.yaml"
COMPOSE_LOCAL = ROOT / "compose.local.yaml"
SETUP_ENGINE = ROOT.parent / "shared/docker/setup-engine.sh"
LOCAL_BASE = "local/python:3.11-slim"


# The row whose panels read the ddp_pipeline_* series, which only a --parallel pipeline run exports.
PIPELINE_ROW = "Pipeline"
# Likewise the row of the ddp_zero_* series, exported only by a --parallel zero1|zero2|zero3 run.
ZERO_ROW = "ZeRO"


@dataclass(frozen=True)
class PanelQuery:
    panel: str  # the panel's title, as a user sees it
    ref: str  # the target's refId
    expr: str  # as written in the JSON, with Grafana variables
    row: str = ""  # the title of the row the panel sits in


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_queries(dash: dict | None = None, pipeline: bool = False, zero: bool = False) -> list[PanelQuery]:
    """Every target of every panel (rows' nested panels included).

    Args:
        dash: the dashboard (default: the compose dashboard's JSON).
        pipeline: also the panels of the row titled ``Pipeline…``, which show data only for a
            ``--parallel pipeline`` run; a data-parallel run leaves them empty.
        zero: also the panels of the row titled ``ZeRO…`` (``--parallel zero1|zero2|zero3`` runs only).

    Example::

        [q.expr for q in panel_queries() if q.row.startswith("Elastic")]
    """
    dash = dash or dashboard()
    out: list[PanelQuery] = []
    row = ""

    def walk(panels, row):
        for p in panels:
            if p.get("type") == "row":
                row = p.get("title", "")
            for t in p.get("targets", []):
                out.append(PanelQuery(p.get("title", "?"), t.get("refId", "?"), t["expr"], row))
            walk(p.get("panels", []), row)

    walk(dash["panels"], row)
    return [
        q for q in out if (pipeline or not q.row.startswith(PIPELINE_ROW)) and (zero or not q.row.startswith(ZERO_ROW))
    ]


def annotation_queries(dash: dict | None = None) -> list[str]:
    """The PromQL of the dashboard's annotations (world re-formations)."""
    dash = dash or dashboard()
    return [a["expr"] for a in dash.get("annotations", {}).get("list", []) if a.get("expr")]


def scrape_interval_seconds() -> float:
    text = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["global"]["scrape_interval"]
    value, unit = re.fullmatch(r"(\d+)(ms|s|m)", text).groups()
    return int(value) * {"ms": 0.001, "s": 1, "m": 60}[unit]


def substitute(expr: str, rate_interval_s: float) -> str:
    """What Grafana sends to Prometheus: $rank = All (.*), $__rate_interval at its floor (4 scrape intervals)."""
    expr = expr.replace("$__rate_interval", f"{int(rate_interval_s)}s").replace(
        "${__rate_interval}", f"{int(rate_interval_s)}s"
    )
    return re.sub(r"\$\{?rank\}?", ".*", expr)


# PromQL words that look like metric names in an expression but are not.
_PROMQL_WORDS = {
    "sum",
    "max",
    "min",
    "avg",
    "count",
    "quantile",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "rate",
    "irate",
    "increase",
    "histogram_quantile",
    "time",
    "and",
    "or",
    "unless",
    "clamp_min",
    "clamp_max",
    "vector",
    "scalar",
    "topk",
    "bottomk",
    "abs",
    "label_values",
    "le",
    "rank",
    "job",
    "instance",
    "offset",
    "bool",
    "max_over_time",
    "min_over_time",
    "avg_over_time",
    "last_over_time",
    "humanize",
    "changes",
    "timestamp",
}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads: identifiers not inside {...} or [...], not quoted, not PromQL words."""
    stripped = re.sub(r'"[^"]*"', "", expr)
    stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", stripped)
    stripped = re.sub(r"\bby\s*\([^)]*\)|\bon\s*\([^)]*\)|\bwithout\s*\([^)]*\)", " ", stripped)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", stripped))
    return {w for w in words if w not in _PROMQL_WORDS and not re.fullmatch(r"\d+[smhd]?", w)}


# The series Prometheus writes itself for every scrape target, beside what the target exposes
# (prometheus.io/docs/concepts/jobs_instances: "Automatically generated labels and time series").
SCRAPE_SERIES = frozenset(
    {
        "up",
        "scrape_duration_seconds",
        "scrape_samples_scraped",
        "scrape_samples_post_metric_relabeling",
        "scrape_series_added",
    }
)


def exported_metric_names() -> set[str]:
    """The sample names a worker really exposes (app.worker.metrics.TrainMetrics' registry), e.g. *_bucket, *_total."""
    from app.worker.metrics import TrainMetrics

    metrics = TrainMetrics(rank=0, local_rank=0, world_size=2, node="0", host="h")
    metrics.enable_pipeline()  # the ddp_pipeline_* series, registered by a --parallel pipeline run
    metrics.enable_zero(2)  # the ddp_zero_* series, registered by a --parallel zero1|zero2|zero3 run
    return {s.name for family in metrics.registry.collect() for s in family.samples}


def compose_services(*files: Path) -> dict[str, dict]:
    """Services of compose files merged shallowly per service key, as far as these tests look at them."""
    services: dict[str, dict] = {}
    for f in files or (COMPOSE,):
        for name, svc in (yaml.safe_load(f.read_text()).get("services") or {}).items():
            services.setdefault(name, {}).update(svc)
    return services
