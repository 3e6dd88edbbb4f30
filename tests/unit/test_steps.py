"""A step kind used as the step protocol says (app.worker.steps): built by ``build_step``, one ``train_step`` on a
world of one, and the line a run logs about its global batch. Whole runs of each kind are in tests/integration.

    .venv/bin/python -m pytest tests/unit/test_steps.py
"""

from __future__ import annotations

import math

import pytest
import torch

from app.worker.config import TrainConfig
from app.worker.dist import DistContext
from app.worker.metrics import NoMetrics
from app.worker.steps import build_step
from app.world import run_world


def test_a_step_taken_as_the_step_protocol_shows_it_trains_on_a_finite_loss():
    # app/worker/steps/ddp.py's example leaves inject_nan out: the failure drill must be asked for, never the default.
    cfg = TrainConfig(steps=1, wrapper="none", metrics_port=0)
    step = build_step(cfg, DistContext(0, 0, 1, torch.device("cpu"), "gloo"), 1, NoMetrics())
    before = [p.detach().clone() for p in step.model.parameters()]
    outcome = step.train_step(step.batches.next_micro_batches(), agree_nonfinite=lambda bad: bad)
    assert math.isfinite(outcome.loss) and not outcome.skipped and outcome.samples == cfg.micro_batch
    assert all(torch.isfinite(p).all() for p in step.model.parameters())
    assert any(not torch.equal(b, p) for b, p in zip(before, step.model.parameters()))


def test_the_log_names_the_smallest_and_largest_share_of_an_uneven_global_batch():
    # What the start of a run logs when effective_batch does not divide by the world size: 50 over 3 is 16, 17, 17.
    cfg = TrainConfig(steps=1, wrapper="none", metrics_port=0, effective_batch=50, micro_batch=8, dataset_size=200)
    step = build_step(cfg, DistContext(0, 0, 3, torch.device("cpu"), "gloo"), 3, NoMetrics())
    assert step.describe_batch() == (
        "global batch split over world_size 3 (16-17 per rank), grad_accum_steps 3 of micro_batch <= 8"
    )


def protocol_step(rank: int, world: int, parallel: str) -> tuple[float, bool, float | None]:
    cfg = TrainConfig(steps=1, parallel=parallel, metrics_port=0, micro_batch=8)
    step = build_step(cfg, DistContext(rank, rank, world, torch.device("cpu"), "gloo"), 1, NoMetrics())
    outcome = step.train_step(step.batches.next_micro_batches(), agree_nonfinite=lambda bad: bad)
    return outcome.loss, outcome.skipped, outcome.exposed_seconds


@pytest.mark.parametrize("parallel", ["ddp", "zero1", "zero2", "zero3", "pipeline"])
def test_every_step_kind_taken_as_the_protocol_shows_trains_on_a_finite_loss(parallel):
    # Each kind's train_step has its own inject_nan default: the NaN drill must be off unless asked for, in all. The
    # communication it waited for (ddp_exposed_comm_duration_seconds) is a duration, not the bytes sent beside it.
    for loss, skipped, exposed in run_world(protocol_step, 2, parallel):
        assert math.isfinite(loss) and not skipped, (parallel, loss, skipped)
        assert exposed is None or 0 <= exposed < 60, (parallel, exposed)


def gradient_bytes_around_a_save(rank: int, world: int, parallel: str) -> tuple[int, int]:
    cfg = TrainConfig(steps=1, parallel=parallel, metrics_port=0, micro_batch=8)
    step = build_step(cfg, DistContext(rank, rank, world, torch.device("cpu"), "gloo"), 1, NoMetrics())
    step.train_step(step.batches.next_micro_batches(), agree_nonfinite=lambda bad: bad)
    after_step = step.memory_bytes()[1]
    step.before_save()
    return after_step, step.memory_bytes()[1]


@pytest.mark.parametrize("parallel", ["zero1", "zero2", "zero3"])
def test_a_zero_step_drops_its_gradients_before_a_save_so_the_save_adds_nothing_to_the_peak(parallel):
    # The last step's gradients are read by nothing (the next step starts with zero_grad); kept as zeros they would
    # sit beside the save's own copies at the step's peak.
    for after_step, at_save in run_world(gradient_bytes_around_a_save, 2, parallel):
        assert after_step > 0 and at_save == 0, (parallel, after_step, at_save)


def _one_inf(g: torch.Tensor) -> torch.Tensor:
    return g.flatten().index_put((torch.tensor([0]),), torch.tensor(float("inf"))).view_as(g)


def overflow_in_one_shard(rank: int, world: int, parallel: str) -> list[bool]:
    # fp16 autocast (a GradScaler): the second step's gradient gets one inf, on rank 1, in one element, which after
    # the reduce-scatter sits in one rank's shard only.
    cfg = TrainConfig(steps=3, parallel=parallel, autocast="fp16", metrics_port=0, micro_batch=8)
    step = build_step(cfg, DistContext(rank, rank, world, torch.device("cpu"), "gloo"), 1, NoMetrics())
    skipped = []
    for i in range(3):
        hook = None
        if i == 1 and rank == 1:
            weight = next(step.model.parameters())
            hook = weight.register_hook(_one_inf)
        outcome = step.train_step(step.batches.next_micro_batches(), agree_nonfinite=lambda bad: bad)
        if hook is not None:
            hook.remove()
        skipped.append(outcome.skipped)
    return skipped


def test_an_fp16_overflow_in_one_ranks_shard_skips_that_step_on_every_rank():
    # Sharded gradients: only the rank holding the inf can see it. The step kind's scaler must agree over the world,
    # or that rank skips while the others step, and the ranks train different models from then on.
    assert run_world(overflow_in_one_shard, 2, "zero2") == [[False, True, False], [False, True, False]]


def test_the_failure_drills_loss_is_nan_and_what_a_kind_is_built_from_is_frozen():
    import dataclasses

    import torch.nn.functional as F

    from app.worker.steps.base import StepInputs, nan_loss

    out, y = torch.zeros(2, 3), torch.ones(2, 3)
    assert math.isnan(nan_loss(F.mse_loss)(out, y).item()) and F.mse_loss(out, y).item() == 1.0
    cfg = TrainConfig(steps=1, wrapper="none", metrics_port=0)
    inputs = StepInputs(cfg, DistContext(0, 0, 1, torch.device("cpu"), "gloo"), torch.nn.Linear(2, 2), F.mse_loss, 1)
    assert inputs.metrics is None  # the kinds that need metrics are given them
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.grad_accum_steps = 2  # shared by the step kind and the Trainer: nobody changes it after the build


def test_every_rank_builds_the_same_parameters_from_the_seed_and_another_seed_other_ones():
    from app.worker.models import parameter_checksum

    def built(seed: int, rank: int) -> str:
        cfg = TrainConfig(steps=1, wrapper="none", metrics_port=0, seed=seed)
        torch.manual_seed(1000 + rank)  # whatever each rank's generator held before
        return parameter_checksum(build_step(cfg, DistContext(rank, rank, 1, torch.device("cpu"), "gloo"), 1,
                                             NoMetrics()).model)  # fmt: skip

    assert built(3, 0) == built(3, 1) != built(4, 0)


def test_the_modules_activation_checkpointing_names_recompute_and_the_log_names_them(caplog):
    import logging

    from app.parallel.activation_checkpointing import is_checkpointed

    cfg = TrainConfig(steps=1, wrapper="none", metrics_port=0, activation_checkpointing="every:2")
    with caplog.at_level(logging.INFO, logger="app.train"):
        step = build_step(cfg, DistContext(0, 0, 1, torch.device("cpu"), "gloo"), 1, NoMetrics())
    assert "activation checkpointing (every:2): 2 modules, net.1, net.3" in caplog.messages  # every second unit
    assert [n for n, m in step.model.net.named_children() if is_checkpointed(m)] == ["1", "3"]
