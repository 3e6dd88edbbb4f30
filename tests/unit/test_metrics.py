"""The trainer's Prometheus series (app.worker.metrics), read back from the exposition Prometheus scrapes: the
``ddp_zero_*`` series of a ZeRO run, the histograms' bucket bounds, the endpoint's shutdown, and what a wrapper that
has not synchronised yet reports (app.parallel.ddp.comm_stats). Values after real training steps, and a real
Prometheus scraping them, are in tests/integration/test_metrics.py.

    .venv/bin/python -m pytest tests/unit/test_metrics.py
"""

from __future__ import annotations

import pytest


def test_a_zero_run_exports_its_stage_and_collectives_once_registered():
    """The ``ddp_zero_*`` series as a ZeRO step kind registers and fills them (app.worker.metrics), read back from
    the exposition Prometheus scrapes; registering twice keeps one set of series."""
    from prometheus_client import generate_latest

    from app.worker.metrics import TrainMetrics

    metrics = TrainMetrics(rank=0, local_rank=0, world_size=2, node="node-a")
    assert b"ddp_zero_" not in generate_latest(metrics.registry)
    first = metrics.enable_zero(2)
    assert metrics.enable_zero(2) is first
    metrics.observe_zero(
        collectives={"reduce_scatter": (4096, 0.001), "all_gather": (2048, 0.002)},
        parameter_bytes=100,
        gradient_bytes=50,
        optimizer_state_bytes=200,
    )
    text = generate_latest(metrics.registry).decode()
    for line in [
        'ddp_zero_stage{rank="0"} 2.0',
        'ddp_zero_reduce_scatter_bytes_total{rank="0"} 4096.0',
        'ddp_zero_all_gather_bytes_total{rank="0"} 2048.0',
        'ddp_zero_reduce_scatter_seconds_count{rank="0"} 1.0',
    ]:
        assert line in text.splitlines(), line


def test_a_zero_step_observed_before_any_stage_registered_exports_its_series_as_stage_0():
    # observe_zero registers the series itself when no step kind did (enable_zero is idempotent, not required).
    from prometheus_client import generate_latest

    from app.worker.metrics import TrainMetrics

    metrics = TrainMetrics(rank=1, local_rank=1, world_size=2, node="node-b")
    metrics.observe_zero(
        collectives={"all_gather": (512, 0.003)}, parameter_bytes=10, gradient_bytes=5, optimizer_state_bytes=20
    )
    lines = generate_latest(metrics.registry).decode().splitlines()
    for line in ['ddp_zero_all_gather_bytes_total{rank="1"} 512.0', 'ddp_zero_parameter_bytes{rank="1"} 10.0']:
        assert line in lines, line


def test_every_histogram_resolves_its_quantiles_within_a_factor_of_4_over_its_documented_range():
    """What a dashboard's ``histogram_quantile`` can tell apart: bucket bounds, read from the exposition, at most 4x
    apart, from a ~1 ms step (MiniMLP) and a ~50 us loopback all-reduce up to 10 s (app.worker.metrics' comment)."""
    import re

    from prometheus_client import generate_latest

    from app.worker.metrics import TrainMetrics

    metrics = TrainMetrics(rank=0, local_rank=0, world_size=2, node="node-a")
    metrics.enable_zero(2)
    text = generate_latest(metrics.registry).decode()
    bounds: dict[str, list[float]] = {}
    for name, le in re.findall(r'^(ddp_\w+)_bucket\{.*le="([^"]+)"', text, re.M):
        if le != "+Inf":
            bounds.setdefault(name, []).append(float(le))
    assert {"ddp_step_duration_seconds", "ddp_allreduce_duration_seconds", "ddp_checkpoint_duration_seconds"} <= set(
        bounds
    )
    for name, les in bounds.items():
        assert les == sorted(les) and all(b / a <= 4 for a, b in zip(les, les[1:])), (name, les)
        assert les[-1] >= 10, (name, les)
    assert bounds["ddp_step_duration_seconds"][0] <= 1e-3
    assert bounds["ddp_allreduce_duration_seconds"][0] <= 5e-5


def test_metrics_shutdown_closes_the_endpoint_and_is_harmless_when_nothing_was_served():
    import urllib.error
    import urllib.request

    from app.net import free_port
    from app.worker.metrics import TrainMetrics

    metrics = TrainMetrics(rank=0, local_rank=0, world_size=1, node="n")
    metrics.shutdown()  # metrics_port=0 serves nothing: shutting down must not fail either
    port = free_port()
    metrics.serve(port)
    assert b"ddp_" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    metrics.shutdown()
    with pytest.raises(urllib.error.URLError):  # refused: the port is free again for the next trainer
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_comm_stats_read_before_any_step_say_nothing_was_sent():
    """What the metrics read from a wrapper that has not synchronised yet (the first scrape can come before the
    first step): zeros and no buckets, not a sentinel that a rate or a bandwidth would turn negative."""
    from app.parallel.ddp.comm_stats import CommStats

    stats = CommStats()
    assert (stats.sync_calls, stats.buckets_reduced, stats.bytes_reduced) == (0, 0, 0)
    assert stats.last_bucket_seconds == [] and stats.last_bucket_bytes == []
    assert (stats.allreduce_seconds, stats.wait_seconds) == (0.0, 0.0)
    assert (stats.last_wait_seconds, stats.last_comm_span_seconds) == (0.0, 0.0)


def test_a_world_healed_in_place_is_the_world_size_the_alerts_read_and_the_rank_label_stays():
    """heal=in_place keeps the process up: ``ddp_world_size`` must follow the healed world (DDPWorldShrank compares
    it with its 10-minute maximum), and the series keep the rank label the process started with."""
    from prometheus_client import generate_latest

    from app.worker.metrics import NoMetrics, TrainMetrics

    metrics = TrainMetrics(rank=2, local_rank=0, world_size=3, node="0")
    metrics.observe_world(world_size=3, min_world_size=1, max_world_size=8, restart_count=0, generation=1)
    metrics.observe_healed_world(2)  # rank 0 lost: this process is rank 1 of 2 now
    lines = generate_latest(metrics.registry).decode().splitlines()
    assert 'ddp_world_size{rank="2"} 2.0' in lines
    assert 'ddp_max_world_size{rank="2"} 8.0' in lines and 'ddp_min_world_size{rank="2"} 1.0' in lines
    NoMetrics().observe_healed_world(2)  # metrics_port=0: the heal calls it all the same


def exposition(metrics) -> dict[str, float]:
    """``{series with labels: value}`` of the ``ddp_*`` lines, as Prometheus scrapes them."""
    from prometheus_client import generate_latest

    lines = generate_latest(metrics.registry).decode().splitlines()
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in lines if line.startswith("ddp_"))}


def test_a_new_process_exports_its_place_and_a_world_of_its_own_size_in_its_first_generation():
    from app.worker.metrics import TrainMetrics

    series = exposition(TrainMetrics(rank=3, local_rank=1, world_size=4, node="2", host="box"))
    assert series['ddp_rank_info{host="box",local_rank="1",node="2",rank="3"}'] == 1
    for name, value in [("world_size", 4), ("min_world_size", 4), ("max_world_size", 4), ("world_generation", 1)]:
        assert series[f'ddp_{name}{{rank="3"}}'] == value, name
    assert not [s for s in series if s.startswith(("ddp_pipeline_", "ddp_zero_", "ddp_validation_"))]


def test_a_step_sets_every_step_series_to_what_it_measured():
    import time

    from app.parallel.probes import CommSample
    from app.worker.metrics import TrainMetrics

    metrics = TrainMetrics(rank=1, local_rank=1, world_size=4, node="0")
    comm = CommSample([0.002, 0.004], [1000, 3000], wait_seconds=0.001, span_seconds=0.005)
    before = time.time()
    for _ in range(2):
        metrics.observe_step(
            step_seconds=0.25,
            forward_seconds=0.05,
            backward_seconds=0.125,
            optimizer_seconds=0.0625,
            comm=comm,
            samples=16,
            syncs=1,
            loss=1.5,
            lr=0.003,
        )
    s = exposition(metrics)
    r = '{rank="1"}'
    for name, total in [("step", 0.5), ("forward", 0.1), ("backward", 0.25), ("optimizer", 0.125)]:
        assert (s[f"ddp_{name}_duration_seconds_count{r}"], s[f"ddp_{name}_duration_seconds_sum{r}"]) == (2, total)
    assert s[f"ddp_allreduce_duration_seconds_count{r}"] == 4  # one observation per bucket
    assert s[f"ddp_allreduce_duration_seconds_sum{r}"] == pytest.approx(0.012)
    assert s[f"ddp_exposed_comm_duration_seconds_count{r}"] == 2
    assert s[f"ddp_allreduce_bytes_total{r}"] == 8000
    assert s[f"ddp_allreduce_bus_bandwidth_bytes_per_second{r}"] == pytest.approx(4000 / 0.005 * 2 * 3 / 4)
    assert (s[f"ddp_samples_total{r}"], s[f"ddp_optimizer_steps_total{r}"], s[f"ddp_gradient_syncs_total{r}"]) == (
        32,
        2,
        2,
    )
    assert (s[f"ddp_loss{r}"], s[f"ddp_learning_rate{r}"]) == (1.5, 0.003)
    assert before <= s[f"ddp_last_step_timestamp_seconds{r}"] <= time.time()


def test_a_step_without_communication_counts_no_bytes_no_sync_and_no_exposed_wait():
    from app.parallel.probes import CommSample
    from app.worker.metrics import TrainMetrics

    metrics = TrainMetrics(rank=0, local_rank=0, world_size=1, node="0")
    step = {"forward_seconds": 0.1, "backward_seconds": 0.1, "optimizer_seconds": 0.1, "loss": 2.0, "lr": 0.1}
    metrics.observe_step(step_seconds=0.3, comm=CommSample(), samples=8, syncs=0, **step)
    s = exposition(metrics)
    r = '{rank="0"}'
    assert s[f"ddp_allreduce_bytes_total{r}"] == 0 and s[f"ddp_gradient_syncs_total{r}"] == 0
    assert s[f"ddp_allreduce_bus_bandwidth_bytes_per_second{r}"] == 0
    assert s[f"ddp_exposed_comm_duration_seconds_count{r}"] == 0 and s[f"ddp_allreduce_duration_seconds_count{r}"] == 0
    assert s[f"ddp_samples_total{r}"] == 8 and s[f"ddp_optimizer_steps_total{r}"] == 1


def test_progress_checkpoints_the_world_resumes_and_a_stop_are_exported_as_observed():
    from app.worker.metrics import TrainMetrics

    metrics = TrainMetrics(rank=0, local_rank=0, world_size=2, node="0")
    r = '{rank="0"}'
    metrics.observe_progress(7, 200)
    metrics.observe_checkpoint(5, 0.5)
    metrics.observe_checkpoint(6, None)  # a step whose write was not timed: the step is still the last one
    metrics.observe_world(world_size=3, min_world_size=2, max_world_size=5, restart_count=4, generation=6)
    metrics.observe_resume(steps_redone=3)
    metrics.observe_resume(steps_redone=0)
    metrics.observe_resume(steps_redone=-2)  # a checkpoint newer than the lost step: nothing redone
    metrics.observe_reformation(-1.0)  # a clock skewed between hosts: never a negative time lost
    s = exposition(metrics)
    assert (s[f"ddp_step{r}"], s[f"ddp_target_steps{r}"]) == (7, 200)
    assert s[f"ddp_checkpoint_duration_seconds_count{r}"] == 1 and s[f"ddp_checkpoint_duration_seconds_sum{r}"] == 0.5
    assert s[f"ddp_last_checkpoint_step{r}"] == 6
    world = [s[f"ddp_{n}{r}"] for n in ("world_size", "min_world_size", "max_world_size", "elastic_restarts")]
    assert world == [3, 2, 5, 4] and s[f"ddp_world_generation{r}"] == 6
    assert s[f"ddp_steps_redone_total{r}"] == 3 and s[f"ddp_reformation_seconds{r}"] == 0
    assert s[f"ddp_stop_requested{r}"] == 0
    metrics.observe_reformation(2.5)
    metrics.observe_stop_requested()
    s = exposition(metrics)
    assert s[f"ddp_reformation_seconds{r}"] == 2.5 and s[f"ddp_stop_requested{r}"] == 1


def test_a_pipeline_stage_exports_its_series_once_it_reports():
    from app.worker.metrics import TrainMetrics

    metrics = TrainMetrics(rank=2, local_rank=0, world_size=4, node="1")
    first = metrics.enable_pipeline()
    assert metrics.enable_pipeline() is first  # idempotent: one set of series
    for sent in (65536, 0):
        metrics.observe_pipeline(
            stage=1, compute_seconds=0.012, send_recv_seconds=0.003, bubble_ratio=0.25, activation_bytes=sent
        )
    s = exposition(metrics)
    r = '{rank="2"}'
    assert (s[f"ddp_pipeline_stage{r}"], s[f"ddp_pipeline_bubble_ratio{r}"]) == (1, 0.25)
    assert s[f"ddp_pipeline_compute_seconds_count{r}"] == 2
    assert s[f"ddp_pipeline_compute_seconds_sum{r}"] == pytest.approx(0.024)
    assert s[f"ddp_pipeline_send_recv_seconds_sum{r}"] == pytest.approx(0.006)
    assert s[f"ddp_pipeline_activation_bytes_total{r}"] == 65536


def test_no_metrics_takes_every_call_the_training_loop_makes_of_train_metrics():
    import inspect

    from app.worker.metrics import NoMetrics, TrainMetrics

    public = {n for n, f in inspect.getmembers(TrainMetrics, inspect.isfunction) if not n.startswith("_")}
    assert public <= {n for n, _ in inspect.getmembers(NoMetrics, inspect.isfunction)}


def test_the_clock_is_read_after_cuda_synchronises_and_a_cpu_step_waits_for_nothing():
    import torch

    from app.worker.metrics import synchronize_for

    assert synchronize_for(torch.device("cpu"))() is None
    if torch.cuda.is_available():
        synchronize_for(torch.device("cuda", 0))()  # returns once the device's queued kernels are done
        return
    with pytest.raises((AssertionError, RuntimeError)):  # CUDA's own synchronize, which this build lacks
        synchronize_for(torch.device("cuda", 0))()


def test_a_steps_throughput_is_its_samples_and_tokens_over_its_seconds():
    import torch

    from app.worker.metrics import TrainMetrics

    metrics = TrainMetrics(rank=0, local_rank=0, world_size=1, node="0")
    metrics.observe_throughput(samples=64, tokens_per_sample=32, seconds=0.5, flops=None, device=torch.device("cpu"))
    s = exposition(metrics)
    assert (s['ddp_samples_per_second{rank="0"}'], s['ddp_tokens_per_second{rank="0"}']) == (128, 4096)
