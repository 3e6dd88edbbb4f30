"""``app.parallel.accum`` in one process: the recipe's parts (``StepRecipe``: autocast, loss scaling, clipping,
a skipped step) and what ``accumulation_step`` reports. The claims across ranks: tests/integration/test_accum.py
and test_recipe.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.parallel.accum import (
    StepRecipe,
    accumulation_step,
    effective_batch_size,
    grad_accum_steps_for,
    micro_batch_sizes,
    split_global_batch,
)


def model_and_grads(grad: float) -> tuple[nn.Linear, torch.optim.SGD]:
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    model.weight.grad = torch.full((1, 2), grad)
    return model, torch.optim.SGD(model.parameters(), lr=1.0)


def test_without_a_recipe_the_step_is_the_optimizers_and_nothing_is_clipped_or_scaled():
    recipe = StepRecipe()
    loss = torch.tensor(3.0)
    assert recipe.scale(loss) is loss
    with recipe.autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")
    model, opt = model_and_grads(3.0)
    assert recipe.step(model, opt) == (None, False)
    assert torch.equal(model.weight, torch.full((1, 2), -2.0))  # 1 - lr × 3: the gradient as it was


def test_clipping_returns_the_norm_before_it_and_leaves_the_gradient_at_the_limit():
    model, opt = model_and_grads(3.0)  # norm sqrt(18)
    norm, skipped = StepRecipe(grad_clip_norm=1.0).step(model, opt)
    assert norm == pytest.approx(18**0.5) and not skipped
    assert model.weight.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    # A wrapper whose gradient is sharded clips by its own norm over every shard (ZeRO-2/3, as FSDP).
    model, opt = model_and_grads(3.0)
    model.clip_grad_norm_ = lambda max_norm: torch.tensor(7.0 + max_norm)
    assert StepRecipe(grad_clip_norm=0.5).step(model, opt) == (7.5, False)


def test_an_fp16_scaler_skips_a_step_whose_gradient_overflowed_and_halves_its_scale():
    recipe = StepRecipe(torch.float16, torch.amp.GradScaler("cpu", init_scale=4.0))
    with recipe.autocast("cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    assert recipe.scale(torch.tensor(3.0)).item() == 12.0
    model, opt = model_and_grads(float("inf"))
    assert recipe.step(model, opt) == (None, True)
    assert torch.equal(model.weight, torch.ones(1, 2)) and recipe.scaler.get_scale() == 2.0
    model, opt = model_and_grads(4.0)  # a finite gradient, scaled by 2: unscaled to 2 before the step
    assert recipe.step(model, opt) == (None, False)
    assert torch.equal(model.weight, torch.full((1, 2), -1.0))


def test_a_step_reports_its_samples_mean_loss_and_no_sync_for_a_bare_module():
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # Losses 1 (3 samples) and 4 (1 sample): the mean over the step's samples is 7 / 4, not (1 + 4) / 2.
    micro = [(torch.zeros(3, 2), torch.ones(3, 1)), (torch.zeros(1, 2), torch.full((1, 1), 2.0))]
    result = accumulation_step(model, opt, micro, F.mse_loss)
    assert (result.loss, result.samples, result.syncs, result.skipped, result.grad_norm) == (1.75, 4, 0, False, None)
    assert result.forward_seconds >= 0 and result.backward_seconds >= 0 and result.optimizer_seconds >= 0
    # grad_scale weighs every micro-batch's loss: the gradient doubles (the rank's share of an uneven global batch).
    x = torch.ones(2, 2)
    grads = []
    for scale in (1.0, 2.0):
        accumulation_step(model, opt, [(x, torch.ones(2, 1))], F.mse_loss, grad_scale=scale)
        grads.append(model.weight.grad.clone())
    assert torch.equal(grads[1], 2 * grads[0])
    with pytest.raises(ValueError, match="at least one micro-batch"):
        accumulation_step(model, opt, [], F.mse_loss)


def test_the_accumulation_steps_of_a_fixed_global_batch_are_the_largest_shares():
    # 65 samples over 2 ranks: shares 33 and 32; in micro-batches of at most 32 rank 0 needs 2, rank 1 one. The
    # count is the largest share's (rank 0's), as its docstring says.
    assert [split_global_batch(65, 2, r) for r in range(2)] == [(0, 33), (33, 32)]
    assert [micro_batch_sizes(n, 32) for n in (33, 32)] == [[17, 16], [32]]
    assert grad_accum_steps_for(65, 2, 32) == 2
    assert grad_accum_steps_for(64, 2, 32) == 1
    assert effective_batch_size(micro_batch=8, grad_accum_steps=3, world_size=2) == 48
