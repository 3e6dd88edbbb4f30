"""Prometheus metrics: the contract's names and labels, promtool-clean, and scraped by a real Prometheus.

The end-to-end test (``-m e2e``) needs the ``prometheus`` and ``promtool`` binaries (Debian's ``prometheus``
package; ``.ci/run`` installs it when missing). It starts its own Prometheus on loopback with a 1 s scrape interval,
runs 2 real ranks, and asks Prometheus's HTTP API for each rank's step time and all-reduce latency.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import torch
from prometheus_client import generate_latest

from app.parallel.ddp import DistributedDataParallel
from app.parallel.probes import CommSample, OursCommProbe, TorchCommProbe
from app.worker.metrics import TrainMetrics
from app.worker.models import MiniMLP
from app.world import run_world
from tests.trainer_run import finish, free_port, start_ranks, start_torchrun, wait_for_lines, worker_args

CONTRACT = {  # name in the exposition -> type
    "ddp_step_duration_seconds": "histogram",
    "ddp_forward_duration_seconds": "histogram",
    "ddp_backward_duration_seconds": "histogram",
    "ddp_optimizer_duration_seconds": "histogram",
    "ddp_allreduce_duration_seconds": "histogram",
    "ddp_exposed_comm_duration_seconds": "histogram",
    "ddp_allreduce_bytes_total": "counter",
    "ddp_allreduce_bus_bandwidth_bytes_per_second": "gauge",
    "ddp_samples_total": "counter",
    "ddp_optimizer_steps_total": "counter",
    "ddp_gradient_syncs_total": "counter",
    "ddp_loss": "gauge",
    "ddp_learning_rate": "gauge",
    "ddp_world_size": "gauge",
    "ddp_last_step_timestamp_seconds": "gauge",
    "ddp_checkpoint_duration_seconds": "histogram",
    "ddp_last_checkpoint_step": "gauge",
    "ddp_rank_info": "gauge",
    "ddp_step": "gauge",
    "ddp_target_steps": "gauge",
    # elastic: every rank of every world
    "ddp_min_world_size": "gauge",
    "ddp_max_world_size": "gauge",
    "ddp_elastic_restarts": "gauge",
    "ddp_world_generation": "gauge",
    "ddp_reformation_seconds": "gauge",
    "ddp_steps_redone_total": "counter",
}
PIPELINE = {  # only once a pipeline stage reports
    "ddp_pipeline_stage": "gauge",
    "ddp_pipeline_compute_seconds": "histogram",
    "ddp_pipeline_send_recv_seconds": "histogram",
    "ddp_pipeline_bubble_ratio": "gauge",
    "ddp_pipeline_activation_bytes_total": "counter",
}
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")


def test_bus_bandwidth_is_nccl_tests_busbw_over_the_wall_time_span():
    # Two buckets of 0.25 s each that overlapped: the bytes took 0.3 s of wall time, not 0.5 s.
    sample = CommSample(bucket_seconds=[0.25, 0.25], bucket_bytes=[500, 500], span_seconds=0.3)
    assert sample.bus_bandwidth(4) == pytest.approx(1000 / 0.3 * 2 * 3 / 4)  # algbw × 2(n−1)/n
    assert sample.bus_bandwidth(1) == 0.0  # nothing crosses a wire in a world of one
    assert CommSample().bus_bandwidth(4) == 0.0  # a step without communication (no_sync, no wrapper): 0, never < 0
    assert CommSample([0.25, 0.25], [500, 500]).bus_bandwidth(4) == pytest.approx(1000 / 0.5 * 2 * 3 / 4)  # no span


def _one_step_per_probe(rank: int, world: int) -> dict:
    """Three synchronised backward passes under each wrapper with several small buckets; what each probe took from
    the last one, and the wall time of that backward (all of its communication happens inside it)."""
    torch.manual_seed(0)
    base = MiniMLP()
    torch_ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.01)
    ours = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.01)
    out = {"has_span": hasattr(ours.stats, "last_comm_span_seconds"), "n_buckets": len(ours.bucket_sizes)}
    out["grad_bytes"] = sum(p.numel() * p.element_size() for p in base.parameters())
    for name, model, probe in (("torch", torch_ddp, TorchCommProbe(torch_ddp)), ("ours", ours, OursCommProbe(ours))):
        waits = []
        for _ in range(3):
            loss = model(torch.randn(64, 32)).square().mean()
            t0 = time.perf_counter()
            loss.backward()
            backward = time.perf_counter() - t0
            sample = probe.take()
            waits.append(sample.wait_seconds)
        out[name] = {"sample": sample, "backward_seconds": backward, "busbw": sample.bus_bandwidth(world)}
    # The exposed wait of each step, as the metrics observe it: the wrapper's running total is their sum.
    out["ours"]["waits"], out["ours"]["wait_total"] = waits, ours.stats.wait_seconds
    return out


@pytest.fixture(scope="module")
def probes() -> list[dict]:
    return run_world(_one_step_per_probe, 2, timeout=120)


def _check_span(measured: dict, n_buckets: int, grad_bytes: int) -> None:
    sample = measured["sample"]
    assert n_buckets >= 2  # MiniMLP's ~19 KB in 10 KB buckets
    # This step's buckets, each once: nothing carried over from the two steps before, none counted twice.
    assert len(sample.bucket_seconds) == len(sample.bucket_bytes) == n_buckets, sample
    assert sample.nbytes == grad_bytes, sample
    if sample.wait_seconds is not None:  # ours: the exposed wait is part of this backward
        assert 0 <= sample.wait_seconds <= measured["backward_seconds"], measured
    # The span covers every bucket and lies inside the backward that ran them; the sum of the buckets' own times,
    # when they queue behind each other, does not.
    assert max(sample.bucket_seconds) <= sample.span_seconds <= measured["backward_seconds"], measured
    assert measured["busbw"] == pytest.approx(sample.nbytes / sample.span_seconds * 2 * (2 - 1) / 2)


def test_torch_ddp_bus_bandwidth_uses_first_launch_to_last_completion(probes):
    for rank in probes:
        _check_span(rank["torch"], rank["n_buckets"], rank["grad_bytes"])


def test_our_ddp_bus_bandwidth_uses_the_wrappers_comm_span(probes):
    if not probes[0]["has_span"]:
        pytest.skip("our CommStats has no last_comm_span_seconds yet: bus bandwidth falls back to the sum")
    for rank in probes:
        _check_span(rank["ours"], rank["n_buckets"], rank["grad_bytes"])
        assert sum(rank["ours"]["waits"]) == pytest.approx(rank["ours"]["wait_total"], rel=1e-9), rank["ours"]


def exposition(pipeline: bool = False) -> str:
    m = TrainMetrics(rank=3, local_rank=1, world_size=4, node="1", host="node-b")
    m.observe_step(
        step_seconds=0.02,
        forward_seconds=0.005,
        backward_seconds=0.01,
        optimizer_seconds=0.002,
        comm=CommSample([0.001, 0.002], [4096, 8192], 0.0005),
        samples=32,
        syncs=1,
        loss=1.5,
        lr=0.003,
    )
    m.observe_checkpoint(50, 0.04)
    m.observe_progress(51, 200)
    m.observe_world(world_size=3, min_world_size=2, max_world_size=4, restart_count=1, generation=2)
    m.observe_resume(steps_redone=7)
    m.observe_reformation(4.5)
    if pipeline:
        for _ in range(2):
            m.observe_pipeline(
                stage=1, compute_seconds=0.01, send_recv_seconds=0.002, bubble_ratio=0.25, activation_bytes=4096
            )
    return generate_latest(m.registry).decode()


def test_exposition_has_the_contracts_names_types_and_labels():
    text = exposition()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    for name, kind in CONTRACT.items():
        assert types.get(name) == kind, (name, types.get(name))
    for line in text.splitlines():
        if line.startswith("ddp_") and not line.startswith("ddp_rank_info"):
            labels = re.search(r"\{(.*)\}", line).group(1)
            assert re.fullmatch(r'(le="[^"]+",)?rank="3"', labels), line  # only rank (and a histogram's le)
    assert 'ddp_rank_info{host="node-b",local_rank="1",node="1",rank="3"} 1.0' in text
    assert 'ddp_allreduce_duration_seconds_count{rank="3"} 2.0' in text
    assert 'ddp_allreduce_bytes_total{rank="3"} 12288.0' in text
    assert 'ddp_step{rank="3"} 51.0' in text and 'ddp_target_steps{rank="3"} 200.0' in text
    assert "_created" not in text
    for line in (
        'ddp_world_size{rank="3"} 3.0',
        'ddp_min_world_size{rank="3"} 2.0',
        'ddp_max_world_size{rank="3"} 4.0',
        'ddp_elastic_restarts{rank="3"} 1.0',
        'ddp_world_generation{rank="3"} 2.0',
        'ddp_reformation_seconds{rank="3"} 4.5',
        'ddp_steps_redone_total{rank="3"} 7.0',
    ):
        assert line in text, line
    assert "ddp_pipeline" not in text  # a data-parallel run exposes no pipeline series


def test_pipeline_series_appear_once_a_stage_reports():
    text = exposition(pipeline=True)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    for name, kind in PIPELINE.items():
        assert types.get(name) == kind, (name, types.get(name))
    for line in (
        'ddp_pipeline_stage{rank="3"} 1.0',
        'ddp_pipeline_compute_seconds_count{rank="3"} 2.0',
        'ddp_pipeline_send_recv_seconds_sum{rank="3"} 0.004',
        'ddp_pipeline_bubble_ratio{rank="3"} 0.25',
        'ddp_pipeline_activation_bytes_total{rank="3"} 8192.0',
    ):
        assert line in text, line


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus; .ci/run does)")
def test_exposition_is_promtool_clean():
    check = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=exposition(pipeline=True), capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0 and check.stdout.strip() == "" and check.stderr.strip() == "", check


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def wait_for_finished(proc, ranks: int, timeout: float = 150) -> None:
    wait_for_lines(proc, proc.stdout, "FINISHED", count=ranks, timeout=timeout)


def scrape_at_the_end(port: int, read=None, ranks: int = 2, torchrun: bool = False, **settings) -> tuple[list, str]:
    """Run 2 ranks (``RUNS["scraped"]`` with ``settings``, /metrics on ``port`` + local rank), read every rank's
    endpoint with ``read(port)`` once all printed FINISHED, then end the linger: (what was read, every rank's stderr,
    rank 0's first). Plain ranks given torchrun's variables, or under ``torchrun`` where what it tells them is tested.
    """
    args = worker_args("scraped", metrics_port=port, **settings)
    procs = [start_torchrun(*args)] if torchrun else start_ranks(*args, world_size=ranks)
    try:
        for proc in procs:
            wait_for_finished(proc, ranks if torchrun else 1)
        values = [(read or scrape)(port + r) for r in range(ranks)]
    finally:
        for proc in procs:
            proc.terminate()  # ends the linger early (torchrun forwards it): the workers stop waiting
        err = "".join(err for _, err in finish(procs, timeout=60))
    return values, err


def test_torch_ddp_reports_allreduce_per_bucket():
    port = free_port(2)
    bodies, _ = scrape_at_the_end(
        port,
        read=lambda p: get(f"http://127.0.0.1:{p}/metrics"),
        wrapper="torch",
        steps=30,
        bucket_cap_mb=0.01,
        log_every=30,
    )
    for rank, body in enumerate(bodies):
        count = float(re.search(rf'ddp_allreduce_duration_seconds_count{{rank="{rank}"}} (\S+)', body).group(1))
        # MiniMLP's 6 tensors (~19 KB) in 10 KB buckets: several all-reduces per step, each observed on its own.
        assert count > 30, body
        assert re.search(rf'ddp_allreduce_bytes_total{{rank="{rank}"}} [1-9]', body)
        # Exposed communication happens inside PyTorch's C++ reducer: not reported for --wrapper torch.
        assert f'ddp_exposed_comm_duration_seconds_count{{rank="{rank}"}} 0.0' in body


def scrape(port: int) -> dict[str, float]:
    """One rank's /metrics as {series with labels: value}."""
    body = get(f"http://127.0.0.1:{port}/metrics")
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(ddp_\S+) (\S+)$", body, re.MULTILINE)}


def test_metric_values_after_known_steps():
    """What a dashboard shows after 12 steps of micro_batch 16 × grad_accum_steps 3 on 2 ranks: exact counts, the
    loss the log printed, the configured lr."""
    port, steps, micro, k, lr = free_port(2), 12, 16, 3, 0.0042
    # Under torchrun: the elastic range below is what torchrun's command line says, read by every rank.
    values, err = scrape_at_the_end(
        port, torchrun=True, steps=steps, micro_batch=micro, grad_accum_steps=k, lr=lr, log_every=1
    )
    logged = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+)/\d+ \| loss (\S+)", err)}
    for rank, v in enumerate(values):
        r = f'{{rank="{rank}"}}'
        assert v[f"ddp_samples_total{r}"] == steps * micro * k  # every sample of every micro-batch, once
        assert v[f"ddp_optimizer_steps_total{r}"] == steps
        assert v[f"ddp_gradient_syncs_total{r}"] == steps  # one sync per step: the last micro-batch's backward
        assert v[f"ddp_step_duration_seconds_count{r}"] == steps
        assert v[f"ddp_learning_rate{r}"] == pytest.approx(lr)
        assert (v[f"ddp_step{r}"], v[f"ddp_target_steps{r}"]) == (steps, steps)
        assert v[f"ddp_world_size{r}"] == 2
        assert (v[f"ddp_min_world_size{r}"], v[f"ddp_max_world_size{r}"]) == (2, 2)  # --standalone: 1 node of 2
        assert (v[f"ddp_world_generation{r}"], v[f"ddp_elastic_restarts{r}"]) == (1, 0)
        assert (v[f"ddp_reformation_seconds{r}"], v[f"ddp_steps_redone_total{r}"]) == (0, 0)
    # Rank 0's last progress line covers step 12 alone (log_every 1) and prints rank 0's loss to 4 decimals.
    assert values[0]['ddp_loss{rank="0"}'] == pytest.approx(logged[steps], abs=6e-5), (logged, values[0])
    assert values[0]['ddp_loss{rank="0"}'] != pytest.approx(values[0]['ddp_learning_rate{rank="0"}'])


def test_a_resumed_world_counts_its_generation_and_the_steps_it_redoes(tmp_path):
    """A world that died after logging step 8 (its newest checkpoint: step 5) is replaced by a new one: generation 2,
    3 steps redone, and the time from that checkpoint to the new world's first step."""
    common = {"checkpoint_dir": tmp_path, "checkpoint_every": 5, "log_every": 1}
    crashed = start_ranks(*worker_args("nan_drill", steps=20, inject_nan_at_step=9, **common))
    err = "".join(err for _, err in finish(crashed, timeout=150))
    assert all(p.returncode != 0 for p in crashed) and "loss became NaN/inf at step 9" in err, err[-3000:]
    scraped_at = []
    # Paced steps (7 after the resume, 1 s each): the new world's first step comes seconds before its last one.
    values, err = scrape_at_the_end(
        free_port(2),
        read=lambda port: (scraped_at.append(time.time()), scrape(port))[1],
        steps=12,
        min_step_seconds=1.0,
        **common,
    )
    assert "resumed from" in err and "step-00000005.pt" in err, err[-3000:]
    from app.worker.checkpoint.files import checkpoint_path, load_checkpoint

    written = load_checkpoint(checkpoint_path(tmp_path, 5))["wall_time"]
    for rank, v in enumerate(values):
        r = f'{{rank="{rank}"}}'
        assert v[f"ddp_world_generation{r}"] == 2
        assert v[f"ddp_steps_redone_total{r}"] == 8 - 5
        # From the checkpoint to the first step, not to a later one: at least the 6 paced steps after the first
        # lie between it and the scrape (3 s of margin for a loaded machine).
        assert 0 < v[f"ddp_reformation_seconds{r}"] < scraped_at[rank] - written - 3, (v, scraped_at, written)
        assert v[f"ddp_optimizer_steps_total{r}"] == 12 - 5
    # Rank 0 writes (and times) every checkpoint of the new world: steps 10 and 12 (checkpoint_every of the run).
    count, total = (values[0][f'ddp_checkpoint_duration_seconds_{s}{{rank="0"}}'] for s in ("count", "sum"))
    assert count >= 1 and 0 < total / count < 30, (count, total)


@pytest.mark.e2e
@pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus/promtool not installed (apt-get install prometheus; .ci/run does)",
)
def test_real_prometheus_scrapes_both_ranks(tmp_path):
    port, web = free_port(2), free_port()
    (tmp_path / "prometheus.yml").write_text(
        json.dumps(
            {  # JSON is YAML
                "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "ddp-worker",
                        "static_configs": [{"targets": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]}],
                    }
                ],
            }
        )
    )
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
    worker = None
    try:
        _wait_ready(f"http://127.0.0.1:{web}/-/ready", prometheus)
        steps = 150
        worker = start_torchrun(
            "--steps", str(steps), "--metrics-port", str(port), "--metrics-linger-seconds", "5", "--log-every", "50"
        )
        wait_for_finished(worker, 2)
        body = get(f"http://127.0.0.1:{port}/metrics")  # a real body, during the linger
        out, err = worker.communicate(timeout=60)
        assert worker.returncode == 0, err[-3000:]
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0 and not check.stderr.strip(), check

        def query(expr: str) -> dict[str, float]:
            url = f"http://127.0.0.1:{web}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
            data = json.loads(get(url))
            assert data["status"] == "success", data
            return {r["metric"].get("rank", ""): float(r["value"][1]) for r in data["data"]["result"]}

        # The worker has exited, so its series are stale now: ask for the last scraped value of each.
        def last(name: str) -> str:
            return f'last_over_time({name}{{job="ddp-worker"}}[10m])'

        step_count = query(last("ddp_step_duration_seconds_count"))
        assert step_count == {"0": steps, "1": steps}  # the final values: scraped during the linger
        step_mean = query(f"{last('ddp_step_duration_seconds_sum')} / {last('ddp_step_duration_seconds_count')}")
        allreduce_count = query(last("ddp_allreduce_duration_seconds_count"))
        allreduce_mean = query(
            f"{last('ddp_allreduce_duration_seconds_sum')} / {last('ddp_allreduce_duration_seconds_count')}"
        )
        p50 = query(f"histogram_quantile(0.5, sum by (rank, le) ({last('ddp_allreduce_duration_seconds_bucket')}))")
        for rank in ("0", "1"):
            assert 0 < step_mean[rank] < 5, step_mean
            assert allreduce_count[rank] >= steps, allreduce_count  # one bucket per step for MiniMLP
            assert 0 < allreduce_mean[rank] < step_mean[rank], allreduce_mean
            assert 0 < p50[rank] < 5, p50
        assert len(query(last("ddp_rank_info"))) == 2
        # What DDPJobEndedEarly compares once the workers are gone: a finished job's step reached its target.
        assert query(last("ddp_step")) == {"0": steps, "1": steps}
        assert query(last("ddp_target_steps")) == {"0": steps, "1": steps}
    finally:
        for proc in (worker, prometheus):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _wait_ready(url: str, proc, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            get(url)
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"prometheus not ready at {url} within {timeout}s")
