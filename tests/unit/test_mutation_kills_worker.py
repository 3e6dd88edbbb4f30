"""Worker cases that generated mutants showed missing (`make mutants`, tools/mutation_triage.yaml).

.venv/bin/python -m pytest tests/unit/test_mutation_kills_worker.py
"""

from __future__ import annotations


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
