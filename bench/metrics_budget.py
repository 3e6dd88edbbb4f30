"""How many Prometheus series a training job costs at 1,000 ranks: one real rank's /metrics, counted and multiplied.

    .venv/bin/python -m bench.metrics_budget                   # 1 rank, 30 steps, x1,000 ranks (~30 s here)
    .venv/bin/python -m bench.metrics_budget --ranks 256 --out runs/budget-256.json

What it does:

    scrape      runs the real worker (``python -m app.train``, one rank, MiniMLP) with its /metrics endpoint on a
                free port, and reads /metrics once the run has finished (during metrics_linger_seconds, so every
                series has its final shape). The ``ddp_pipeline_*`` families exist only in a ``--parallel
                pipeline`` run: they come from a second scrape, of a ``TrainMetrics`` that registered them.
    count       one exposition line is one series; per metric family (a histogram's ``_bucket``, ``_sum`` and
                ``_count`` lines together, the buckets shown apart). Every ``ddp_*`` series carries one ``rank``
                label and nothing else varies per rank, so a job of N ranks has N times one rank's series. Each
                target adds Prometheus' own 5 (``up``, ``scrape_duration_seconds``, ``scrape_samples_scraped``,
                ``scrape_samples_post_metric_relabeling``, ``scrape_series_added``).
    recording   the series docker/prometheus/recording.yml adds (``rank:`` rules one per rank, ``job:`` rules one),
                and for each the series its expression reads at N ranks: what a dashboard refresh would read
                without it.

Writes ``bench/results/metrics-budget.json`` (schema ``metrics-budget.v1``, with provenance: ``tools/provenance.py``)
when every flag is at its default, otherwise ``runs/metrics-budget.json``; ``--out`` chooses. Prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import yaml

from app.net import free_port
from tools.provenance import describe_output, load_average, output_path, provenance

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "metrics-budget.v1"
RECORDING = REPO / "docker/prometheus/recording.yml"
PER_TARGET = 5  # the series Prometheus itself adds for every scrape target (see the docstring)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def scrape_finished_worker(steps: int, timeout_s: float) -> str:
    """/metrics of a real 1-rank training run, read after its last step (ddp_step = ddp_target_steps)."""
    port = free_port()
    cmd = [sys.executable, "-m", "app.train", "--steps", str(steps), "--metrics-port", str(port)]
    cmd += ["--metrics-linger-seconds", "60", "--log-every", str(steps)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    worker = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if worker.poll() is not None:
                raise SystemExit(
                    f"error: the worker exited ({worker.returncode}) before it finished: {worker.stderr.read()}"
                )
            try:
                text = scrape(port)
            except OSError:  # not serving yet
                text = ""
            if re.search(rf'^ddp_step\{{rank="0"\}} {float(steps)}$', text, re.M):
                return text
            time.sleep(0.5)
        raise SystemExit(f"error: the worker did not finish {steps} steps within {timeout_s:g} s; try --timeout-s")
    finally:
        worker.terminate()  # SIGTERM cuts the linger short
        worker.wait(timeout=60)


def scrape_pipeline_metrics() -> str:
    """/metrics of a TrainMetrics that registered the pipeline families (what a pipeline rank adds)."""
    from app.worker.metrics import TrainMetrics

    metrics = TrainMetrics(rank=0, local_rank=0, world_size=2, node="0", host="h")
    metrics.enable_pipeline()
    port = free_port()
    metrics.serve(port)
    try:
        return scrape(port)
    finally:
        metrics.shutdown()


def count_series(text: str) -> dict[str, dict]:
    """{family: {"type", "series", "buckets"}} of one exposition; a family's samples share its name as a prefix."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    families: dict[str, dict] = {name: {"type": kind, "series": 0, "buckets": 0} for name, kind in types.items()}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group(0)
        family = max((f for f in families if sample == f or sample.startswith(f + "_")), key=len)
        families[family]["series"] += 1
        families[family]["buckets"] += sample.endswith("_bucket")
    return families


def sample_series(text: str) -> Counter:
    """Series per sample name (ddp_step_duration_seconds_bucket: one per bucket) in one exposition."""
    return Counter(
        re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group(0)
        for line in text.splitlines()
        if line and not line.startswith("#")
    )


def recording_budget(per_rank: Counter, ranks: int) -> list[dict]:
    """Each recording rule: the series it writes at ``ranks`` ranks, and the raw series that the same query would
    read without any recording rule (a rule over an earlier rule's output counts that rule's raw reads)."""
    rules = [r for g in yaml.safe_load(RECORDING.read_text())["groups"] for r in g["rules"]]
    out, raw_reads = [], {}
    for rule in rules:
        names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", rule["expr"]))
        reads = sum(per_rank[n] * ranks for n in names if n in per_rank)
        reads += sum(raw_reads[n] for n in names if n in raw_reads)
        raw_reads[rule["record"]] = reads
        writes = ranks if rule["record"].startswith("rank:") else 1
        out.append({"record": rule["record"], "writes_series": writes, "raw_series_read_without_it": reads})
    return out


def table(doc: dict) -> str:
    n = doc["ranks"]
    rows = [f"{'family':<52} {'type':<9} {'per rank':>8} {f'at {n:,} ranks':>14}"]
    for name, fam in sorted(doc["families"].items(), key=lambda kv: -kv[1]["series"]):
        note = f" ({fam['buckets']} buckets)" if fam["buckets"] else ""
        scope = " [pipeline runs]" if fam["pipeline_only"] else ""
        rows.append(f"{name + scope:<52} {fam['type']:<9} {fam['series']:>8} {fam['series'] * n:>14,}{note}")
    t = doc["totals"]
    rows += [
        f"{'data-parallel rank, with Prometheus per-target 5':<62} {t['per_rank']:>8} {t['job']:>14,}",
        f"{'pipeline rank (adds ddp_pipeline_*)':<62} {t['per_rank_pipeline']:>8} {t['job_pipeline']:>14,}",
        f"{'recording rules (docker/prometheus/recording.yml)':<62} {'':>8} {t['recording']:>14,}",
        f"histogram series (buckets, _sum, _count) of a data-parallel rank: {t['histogram_share']:.0%}",
        f"samples ingested per second at a {doc['scrape_interval_s']:g} s scrape: {t['samples_per_second']:,.0f}",
        "",
        f"{'recorded series':<52} {'writes':>8} {'raw series read without it':>27}",
    ]
    rows += [
        f"{r['record']:<52} {r['writes_series']:>8,} {r['raw_series_read_without_it']:>27,}" for r in doc["recording"]
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1000, help="ranks of the job to size (default 1000)")
    parser.add_argument("--steps", type=int, default=30, help="steps of the real run that is scraped (default 30)")
    parser.add_argument("--scrape-interval", type=float, default=5.0, help="seconds (compose's prometheus.yml: 5)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="give up on the run after this long")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON (default: see the docstring)")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.steps < 1 or args.scrape_interval <= 0:
        print("error: --ranks and --steps must be >= 1 and --scrape-interval > 0", file=sys.stderr)
        return 2

    before = load_average()
    worker_text = scrape_finished_worker(args.steps, args.timeout_s)
    pipeline_text = scrape_pipeline_metrics()
    families = {name: {**fam, "pipeline_only": False} for name, fam in count_series(worker_text).items()}
    for name, fam in count_series(pipeline_text).items():
        families.setdefault(name, {**fam, "pipeline_only": True})
    per_rank = sum(f["series"] for f in families.values() if not f["pipeline_only"]) + PER_TARGET
    pipeline = sum(f["series"] for f in families.values() if f["pipeline_only"])
    histograms = sum(f["series"] for f in families.values() if f["type"] == "histogram" and not f["pipeline_only"])
    recording = recording_budget(sample_series(worker_text), args.ranks)
    recorded = sum(r["writes_series"] for r in recording)
    doc = {
        "schema": SCHEMA,
        **provenance(args, load_before=before),
        "ranks": args.ranks,
        "scrape_interval_s": args.scrape_interval,
        "method": "one finished rank's /metrics scraped; one exposition line = one series; x ranks (every ddp_* "
        "series has one rank label); + 5 Prometheus series per target",
        "families": families,
        "totals": {
            "per_rank": per_rank,
            "job": per_rank * args.ranks,
            "per_rank_pipeline": per_rank + pipeline,
            "job_pipeline": (per_rank + pipeline) * args.ranks,
            "recording": recorded,
            "histogram_share": round(histograms / per_rank, 3),
            "samples_per_second": (per_rank * args.ranks + recorded) / args.scrape_interval,
        },
        "recording": recording,
    }
    path = output_path(parser, args, "metrics-budget")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(doc))
    print(describe_output(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
