"""What docs/parallelism.md says about DataParallel's loss on an uneven split, checked on CPU.

DataParallel cuts the batch with ``torch.chunk`` (its ``scatter``), so a batch that the device count does not divide
gives chunks of unequal size. The mean of the per-chunk mean losses then weights every chunk alike, which is not
the whole batch's mean; the sum of the per-sample losses divided by the whole batch is. No GPU is needed for the
arithmetic: the chunks are what the replicas would compute.

    .venv/bin/python -m pytest tests/unit/test_parallelism_notes.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

N_DEVICES = 4


def batch(n: int) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1), torch.randn(n, 3), torch.randn(n, 1)


def chunk_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str) -> list[torch.Tensor]:
    """Each replica's loss on its chunk, cut as DataParallel's scatter cuts the batch."""
    return [F.mse_loss(model(xc), yc, reduction=reduction) for xc, yc in zip(x.chunk(N_DEVICES), y.chunk(N_DEVICES))]


def grad_of(loss: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_ten_samples_on_four_devices_split_unevenly():
    _, x, _ = batch(10)
    assert [len(c) for c in x.chunk(N_DEVICES)] == [3, 3, 3, 1]


def test_the_mean_of_uneven_chunk_means_is_not_the_batch_mean():
    model, x, y = batch(10)
    whole = F.mse_loss(model(x), y)
    mean_of_means = torch.stack(chunk_losses(model, x, y, "mean")).mean()
    assert not torch.allclose(mean_of_means, whole, rtol=1e-3), "the uneven split should weight the last sample 3x"
    assert not torch.allclose(grad_of(mean_of_means, model), grad_of(whole, model), rtol=1e-3)


def test_the_sum_of_per_sample_losses_over_the_whole_batch_is_the_batch_mean():
    model, x, y = batch(10)
    whole = F.mse_loss(model(x), y)
    sum_over_n = torch.stack(chunk_losses(model, x, y, "sum")).sum() / len(x)
    torch.testing.assert_close(sum_over_n, whole)
    torch.testing.assert_close(grad_of(sum_over_n, model), grad_of(whole, model))


def test_on_an_even_split_both_agree():
    model, x, y = batch(12)  # 3 samples per device: equal chunks, so the mean of means is the batch mean
    whole = F.mse_loss(model(x), y)
    torch.testing.assert_close(torch.stack(chunk_losses(model, x, y, "mean")).mean(), whole)
