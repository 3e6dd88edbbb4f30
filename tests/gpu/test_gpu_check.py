"""The GPU path on ONE GPU, as tests (tests/gpu/gpu_check.py): `make gpu-check` runs them, writes
bench/results/gpu-check.json and prints a verdict per check. Without CUDA each skips with one line.

    make gpu-check                                          # = pytest -m gpu tests/gpu -s
    make gpu-check GPU_CHECK_ARGS="--steps 30 --out /tmp/gpu.json"
"""

from __future__ import annotations

import os
import shlex

import pytest
import torch

from tests.gpu import gpu_check

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]
if not torch.cuda.is_available():  # the module, not each test: `make gpu-check` says it in one line
    pytest.skip("no CUDA device visible to torch: run it on a machine with a GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def report() -> dict:
    """Every check once (one NCCL group, then the trainer), written and printed before any verdict is asserted."""
    args = gpu_check.build_parser().parse_args(shlex.split(os.environ.get("GPU_CHECK_ARGS", "")))
    report = gpu_check.run(args)
    print("\n" + gpu_check.table(report, gpu_check.write(report, args.out)))
    return report


def test_our_ddp_trains_the_same_parameters_as_torchs_on_nccl(report):
    assert report["checks"]["equivalent"], report["equivalence_and_overhead"]


def test_a_known_gpu_delay_shows_in_the_reported_all_reduce_latency(report):
    assert report["checks"]["timing"], report["timing"]


def test_the_fp16_and_bf16_hooks_stay_within_their_error_bounds_on_cuda(report):
    assert report["checks"]["hooks"], report["hooks"]


def test_the_trainer_trains_and_resumes_on_cuda(report):
    assert report["checks"]["trainer"], report["trainer"]


def test_the_cuda_memory_gauges_read_what_this_ranks_gpu_holds():
    # On a CPU-only build every path reads 0, so only a GPU tells a gauge that reads the GPU from one that never does.
    import re

    from prometheus_client import generate_latest

    from app.worker.metrics import TrainMetrics

    held = torch.empty(2**20, device="cuda")  # 4 MiB
    text = generate_latest(TrainMetrics(0, torch.cuda.current_device(), 1, "node").registry).decode()
    for name in ("ddp_cuda_memory_allocated_bytes", "ddp_cuda_memory_reserved_bytes"):
        value = float(re.search(rf'^{name}{{rank="0"}} (\S+)$', text, re.MULTILINE).group(1))
        assert value >= held.numel() * held.element_size(), (name, value)
