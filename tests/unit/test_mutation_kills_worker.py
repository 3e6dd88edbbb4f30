"""Worker cases that generated mutants showed missing (`make mutants`, tools/mutation_triage.yaml).

.venv/bin/python -m pytest tests/unit/test_mutation_kills_worker.py
"""

from __future__ import annotations

import math

import pytest
import torch


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


def test_a_step_taken_as_the_step_protocol_shows_it_trains_on_a_finite_loss():
    # app/worker/steps/ddp.py's example leaves inject_nan out: the failure drill must be asked for, never the default.
    from app.worker.config import TrainConfig
    from app.worker.dist import DistContext
    from app.worker.metrics import NoMetrics
    from app.worker.steps import build_step

    cfg = TrainConfig(steps=1, wrapper="none", metrics_port=0)
    step = build_step(cfg, DistContext(0, 0, 1, torch.device("cpu"), "gloo"), 1, NoMetrics())
    before = [p.detach().clone() for p in step.model.parameters()]
    outcome = step.train_step(step.batches.next_micro_batches(), agree_nonfinite=lambda bad: bad)
    assert math.isfinite(outcome.loss) and not outcome.skipped and outcome.samples == cfg.micro_batch
    assert all(torch.isfinite(p).all() for p in step.model.parameters())
    assert any(not torch.equal(b, p) for b, p in zip(before, step.model.parameters()))


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


def test_the_log_names_the_smallest_and_largest_share_of_an_uneven_global_batch():
    # What the start of a run logs when effective_batch does not divide by the world size: 50 over 3 is 16, 17, 17.
    from app.worker.config import TrainConfig
    from app.worker.dist import DistContext
    from app.worker.metrics import NoMetrics
    from app.worker.steps import build_step

    cfg = TrainConfig(steps=1, wrapper="none", metrics_port=0, effective_batch=50, micro_batch=8, dataset_size=200)
    step = build_step(cfg, DistContext(0, 0, 3, torch.device("cpu"), "gloo"), 3, NoMetrics())
    assert step.describe_batch() == (
        "global batch split over world_size 3 (16-17 per rank), grad_accum_steps 3 of micro_batch <= 8"
    )


def test_a_progress_line_averages_its_window_of_steps_to_the_hundredth_of_a_millisecond(caplog):
    """The step line a person reads: loss, samples/s, step and communication milliseconds averaged over the steps
    since the last line (three here), the exposed figure only over the steps that measured it."""
    import logging

    from app.worker.progress import ProgressLog, StepRecord

    progress = ProgressLog(steps=3, log_every=3, first_step=0)
    with caplog.at_level(logging.INFO, logger="app.train"):
        for i, (seconds, comm, exposed, loss) in enumerate([(0.1, 0.01, 0.004, 3.0), (0.2, 0.02, None, 2.0),
                                                            (0.3, 0.03, 0.002, 1.0)], start=1):  # fmt: skip
            progress.record(StepRecord(i, seconds, comm, exposed, loss, samples=64))
    assert caplog.messages[-1] == (
        "step 3/3 | loss 2.0000 | 320 samples/s | step 200.0 ms | comm 20.00 ms (exposed 3.00 ms)"
    )


def test_comm_stats_read_before_any_step_say_nothing_was_sent():
    """What the metrics read from a wrapper that has not synchronised yet (the first scrape can come before the
    first step): zeros and no buckets, not a sentinel that a rate or a bandwidth would turn negative."""
    from app.parallel.ddp.comm_stats import CommStats

    stats = CommStats()
    assert (stats.sync_calls, stats.buckets_reduced, stats.bytes_reduced) == (0, 0, 0)
    assert stats.last_bucket_seconds == [] and stats.last_bucket_bytes == []
    assert (stats.allreduce_seconds, stats.wait_seconds) == (0.0, 0.0)
    assert (stats.last_wait_seconds, stats.last_comm_span_seconds) == (0.0, 0.0)


def test_a_plain_run_takes_a_free_port_and_a_given_one_is_kept(monkeypatch):
    """Two plain ``python -m app.train`` runs at once must not both dial 29500 (the integration test
    test_two_plain_runs_at_once_do_not_clash shows it end to end); under torchrun its port is the one used."""
    from app.worker.dist import _default_master

    for name in ("WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    addr, port = _default_master(None)
    assert addr == "127.0.0.1" and port != 29500 and 0 < port < 65536
    monkeypatch.setenv("MASTER_PORT", "29777")
    assert _default_master(None) == ("127.0.0.1", 29777)


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
