"""Throughput, MFU, memory and collective progress per rank: the figures, and the dashboard's panels on them run by a
real Prometheus against 2 real ranks (the e2e part needs Debian's ``prometheus`` package, as tests/integration/
test_metrics.py does).

    .venv/bin/python -m pytest -q -n0 tests/integration/test_throughput_metrics.py
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse

import pytest
import torch
from prometheus_client import generate_latest
from torch import nn

from app.diagnostics.recorder import RECORDER
from app.diagnostics.throughput import PEAK_SECONDS, StepFlops, measure_matmul_peak, tokens_per_sample
from app.worker.metrics import TrainMetrics
from app.worker.throughput_metrics import PEAK_MEASUREMENTS
from tests.e2e.cluster_files import DASHBOARD
from tests.integration.test_metrics import PROMETHEUS, PROMTOOL, _wait_ready, get
from tests.trainer_run import finish, free_port, start_ranks, wait_for_lines, worker_args

THROUGHPUT_ROW = "Throughput, MFU and memory per rank; collective progress"


def test_the_flop_count_of_a_step_is_forward_and_backward_matmuls():
    model, x = nn.Linear(64, 32, bias=False), torch.randn(16, 64)
    flops = StepFlops()
    with flops.measure():
        model(x).sum().backward()
    # forward 2·16·64·32; backward: the weight's gradient (the input needs none) as many again.
    assert flops.per_step == 2 * (2 * 16 * 64 * 32)
    with flops.measure():  # counted once: the later steps are not measured again
        model(torch.randn(1024, 64)).sum().backward()
    assert flops.per_step == 2 * (2 * 16 * 64 * 32)


def test_the_figures_of_one_step():
    m = TrainMetrics(rank=1, local_rank=1, world_size=2, node="0", host="h")
    RECORDER.configure(capacity=16)
    for _ in range(3):
        RECORDER.end(RECORDER.start("all_reduce", None, torch.zeros(4), "test"))
    m.observe_throughput(samples=64, tokens_per_sample=32, seconds=0.5, flops=10**9, device=torch.device("cpu"))
    text = generate_latest(m.registry).decode()
    value = {k: float(v) for k, v in re.findall(r'^(ddp_\w+)\{rank="1"\} (\S+)$', text, re.M)}
    assert value["ddp_samples_per_second"] == 128 and value["ddp_tokens_per_second"] == 128 * 32
    assert value["ddp_model_flops_per_second"] == 2e9
    assert value["ddp_mfu_ratio"] == pytest.approx(2e9 / value["ddp_peak_flops_per_second"])
    assert value["ddp_last_collective_sequence"] == 3  # read from the flight recorder at the scrape
    assert (
        value["ddp_memory_rss_bytes"] > 10 * 2**20
        and value["ddp_memory_peak_rss_bytes"] >= value["ddp_memory_rss_bytes"]
    )
    assert tokens_per_sample(torch.zeros(8, 32, dtype=torch.long)) == 32 and tokens_per_sample(torch.zeros(8, 32)) == 1
    assert 1e7 < measure_matmul_peak() < 1e14  # any CPU from a phone's to a large server's
    if PROMTOOL:
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check


def _peak_after(m: TrainMetrics, *, flops: int) -> tuple[float, float]:
    """One step of ``flops`` in one second: (the seconds ``observe_throughput`` took, the peak gauge after it)."""
    start = time.perf_counter()
    m.observe_throughput(samples=1, tokens_per_sample=1, seconds=1.0, flops=flops, device=torch.device("cpu"))
    took = time.perf_counter() - start
    (peak,) = re.findall(r'^ddp_peak_flops_per_second\{rank="0"\} (\S+)$', generate_latest(m.registry).decode(), re.M)
    return took, float(peak)


def test_a_step_faster_than_the_timed_peak_times_it_again_a_bounded_number_of_times():
    # A peak timed while other processes held the cores reads low and MFU over it above 1 (CI saw 1.3): the rank
    # times it again when a step beats it, keeping the best; a model whose matmuls always beat it is timed 3 times.
    m = TrainMetrics(rank=0, local_rank=0, world_size=1, node="0", host="h")
    took, first = _peak_after(m, flops=10**6)  # far below any CPU's rate
    assert took >= PEAK_SECONDS and first > 10**6
    took, peak = _peak_after(m, flops=10**6)
    assert took < PEAK_SECONDS and peak == first, "a slower step does not time the peak again"
    timings = [_peak_after(m, flops=10**16) for _ in range(PEAK_MEASUREMENTS + 1)]
    assert [t >= PEAK_SECONDS for t, _ in timings] == [True] * (PEAK_MEASUREMENTS - 1) + [False, False]
    peaks = [first] + [p for _, p in timings]
    assert peaks == sorted(peaks), "the peak kept is the best timing"


def panel_queries() -> dict[str, str]:
    """The dashboard's throughput row: every panel's queries, ``$rank`` as "every rank"."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    start = next(i for i, p in enumerate(panels) if p.get("title") == THROUGHPUT_ROW)
    row = []
    for p in panels[start + 1 :]:
        if p["type"] == "row":
            break
        row.append(p)
    return {f"{p['title']}: {t['legendFormat']}": t["expr"].replace("$rank", ".*") for p in row for t in p["targets"]}


@pytest.mark.e2e
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus; .ci/run does)")
def test_the_dashboard_shows_mfu_throughput_and_memory_per_rank_from_a_real_scrape(tmp_path):
    port, web = free_port(2), free_port()
    targets = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}}
    config["scrape_configs"] = [{"job_name": "ddp-worker", "static_configs": [{"targets": targets}]}]
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    prometheus = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    # A token model (tokens/s differs from samples/s), paced so the run spans scrapes; lingers to be scraped.
    args = worker_args(
        "scraped", model="tiny_transformer", steps=40, min_step_seconds=0.1, metrics_port=port, log_every=40
    )
    procs = []
    try:
        _wait_ready(f"http://127.0.0.1:{web}/-/ready", prometheus)
        procs = start_ranks(*args)
        for proc in procs:
            wait_for_lines(proc, proc.stdout, "FINISHED", timeout=240)
        results = _query_until_every_rank_answers(web, panel_queries())
    finally:
        for proc in procs:
            proc.terminate()
        finish(procs, timeout=60)
        prometheus.terminate()
        prometheus.wait(timeout=20)
    for name, by_rank in results.items():
        assert set(by_rank) == {"0", "1"}, (name, by_rank)
        if "CUDA" in name:
            assert by_rank == {"0": 0, "1": 0}, (name, by_rank)  # CPU ranks: no GPU memory
        elif "behind" not in name:
            assert all(v > 0 for v in by_rank.values()), (name, by_rank)
    mfu = results["MFU per rank: rank {{rank}}"]
    assert all(0 < v < 1 for v in mfu.values()), mfu
    samples = results["Samples/s and tokens/s per rank: rank {{rank}} samples/s"]
    tokens = results["Samples/s and tokens/s per rank: rank {{rank}} tokens/s"]
    assert tokens == {r: pytest.approx(v * 32) for r, v in samples.items()}  # seq_len 32
    assert all(v < 1e9 for v in results["Memory per rank: rank {{rank}} RSS"].values())
    assert results["Collectives behind the most advanced rank: rank {{rank}}"] == {"0": 0, "1": 0}  # both finished


def _query_until_every_rank_answers(web: int, queries: dict[str, str], timeout: float = 30) -> dict:
    """Each query's value per rank, once a scrape after the last step has reached Prometheus for both ranks."""
    deadline = time.monotonic() + timeout
    while True:
        results = {name: _query(web, expr) for name, expr in queries.items()}
        seq = results["Collectives behind the most advanced rank: rank {{rank}}"]
        if set(seq) == {"0", "1"} and not any(seq.values()) or time.monotonic() > deadline:
            return results
        time.sleep(1)


def _query(web: int, expr: str) -> dict[str, float]:
    data = json.loads(get(f"http://127.0.0.1:{web}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert data["status"] == "success", data
    return {r["metric"].get("rank", ""): float(r["value"][1]) for r in data["data"]["result"]}
