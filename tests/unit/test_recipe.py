"""The recipe's arithmetic (app.worker.recipe), no process group: the lr each step uses (warm-up, constant, cosine,
linear, the floor, past the horizon), the linear scaling rule, what autocast and clipping become, and the schedule's
state. That N ranks train as one process with it is tests/integration/test_recipe.py."""

from __future__ import annotations

import math

import pytest
import torch

from app.worker.config import TrainConfig
from app.worker.recipe import LRSchedule, build_step_recipe, lr_factor, peak_lr


def factors(schedule: str, steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0, upto: int | None = None):
    kw = {"schedule": schedule, "steps": steps, "warmup_steps": warmup_steps, "min_lr_ratio": min_lr_ratio}
    return [lr_factor(s, **kw) for s in range(steps if upto is None else upto)]


def test_the_docstrings_example_warms_up_then_falls_linearly_to_zero():
    assert factors("linear", 5, warmup_steps=2) == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0])


def test_warm_up_climbs_in_equal_steps_to_the_peak_and_constant_stays_there():
    assert factors("constant", 6, warmup_steps=4) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert factors("constant", 3) == [1.0, 1.0, 1.0]  # no warm-up: the peak from the first step


def test_cosine_falls_from_the_peak_to_its_floor_at_the_last_step_and_stays_there_past_it():
    got = factors("cosine", 5, min_lr_ratio=0.2, upto=8)
    expected = [0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert got == pytest.approx([*expected, 0.2, 0.2, 0.2])  # a resumed run trained past the old horizon
    assert got[0] == 1.0 and got[4] == pytest.approx(0.2)


def test_one_step_after_warm_up_trains_at_the_peak_and_a_step_past_the_horizon_at_the_floor():
    # steps - warmup_steps - 1 = 0 would divide by zero: the span counts as one step.
    assert factors("linear", 3, warmup_steps=2, min_lr_ratio=0.5, upto=4) == pytest.approx([0.5, 1.0, 1.0, 0.5])
    assert factors("linear", 4, warmup_steps=2, min_lr_ratio=0.5, upto=5) == pytest.approx([0.5, 1, 1, 0.5, 0.5])


def test_the_linear_scaling_rule_scales_lr_by_the_global_batch_over_the_reference():
    assert peak_lr(TrainConfig(lr=0.01), 256) == 0.01  # 0: lr as given
    assert peak_lr(TrainConfig(lr=0.01, lr_reference_batch=64), 256) == pytest.approx(0.04)
    assert peak_lr(TrainConfig(lr=0.01, lr_reference_batch=512), 256) == pytest.approx(0.005)


@pytest.mark.parametrize(("autocast", "dtype", "scaled"), [("none", None, False), ("bf16", torch.bfloat16, False),
                                                            ("fp16", torch.float16, True)])  # fmt: skip
def test_autocast_becomes_its_dtype_and_only_fp16_gets_a_grad_scaler(autocast, dtype, scaled):
    recipe = build_step_recipe(TrainConfig(autocast=autocast, grad_clip_norm=0.5), torch.device("cpu"))
    assert recipe.autocast_dtype is dtype
    assert (recipe.scaler is not None) is scaled
    assert recipe.grad_clip_norm == 0.5


def schedule_of(**settings) -> LRSchedule:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=123.0)
    return LRSchedule(optimizer, TrainConfig(**settings), global_batch=128)


def test_the_schedule_sets_each_steps_lr_from_the_configured_peak():
    sched = schedule_of(lr=0.1, steps=4, warmup_steps=2, lr_schedule="linear")
    seen = []
    for _ in range(4):
        seen.append(sched.lr)
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.0])
    assert sched.state_dict() == {"last_epoch": 4, "base_lr": 0.1}
    assert schedule_of(lr=0.1, lr_reference_batch=64).lr == pytest.approx(0.2)  # scaled by 128 / 64


def test_a_resumed_schedule_continues_with_the_lr_of_the_uninterrupted_run_and_the_configured_peak():
    straight = schedule_of(lr=0.1, steps=10, warmup_steps=3, lr_schedule="cosine", min_lr_ratio=0.1)
    for _ in range(6):
        straight.step()
    resumed = schedule_of(lr=0.1, steps=10, warmup_steps=3, lr_schedule="cosine", min_lr_ratio=0.1)
    resumed.load_state_dict({"last_epoch": 6, "base_lr": 999.0})  # the saved base lr is not restored
    assert resumed.lr == pytest.approx(straight.lr) and resumed.scheduler.get_last_lr() == [resumed.lr]
    straight.step(), resumed.step()
    assert resumed.lr == pytest.approx(straight.lr)
    rescaled = schedule_of(lr=0.2, steps=10, warmup_steps=3, lr_schedule="cosine", min_lr_ratio=0.1)
    rescaled.resume_at(6)
    assert rescaled.lr == pytest.approx(2 * lr_factor(6, schedule="cosine", steps=10, warmup_steps=3,
                                                      min_lr_ratio=0.1) * 0.1)  # fmt: skip
