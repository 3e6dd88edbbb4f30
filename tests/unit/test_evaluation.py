"""The validation split and its metric: the held-out samples are the data set's last ones and never trained on;
a stream cannot be split; ``ddp_validation_loss`` appears at the first validation and holds its value."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest

from app.worker.config import ConfigError, TrainConfig
from app.worker.metrics import TrainMetrics
from app.worker.workload import build_splits
from app.world.ranks import run_world


def test_eval_fraction_holds_out_the_last_samples():
    cfg = TrainConfig(dataset_size=400, eval_fraction=0.25, eval_every=5)
    train, held = build_splits(cfg)
    whole, _ = build_splits(TrainConfig(dataset_size=400))
    assert (len(train), len(held)) == (300, 100)
    assert torch.equal(held.inputs, whole.inputs[300:]) and torch.equal(train.inputs, whole.inputs[:300])


def test_a_stream_cannot_be_split(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"x" * 500)
    cfg = TrainConfig(
        model="tiny_transformer",
        data="token_stream",
        data_kwargs={"paths": str(tmp_path / "a.txt"), "seq_len": 8},
        eval_fraction=0.1,
        eval_every=5,
    )
    with pytest.raises(ConfigError, match=r"^eval_fraction=0.1: data='token_stream' is a stream"):
        build_splits(cfg)


def test_the_validation_loss_gauge_appears_with_the_first_validation():
    metrics = TrainMetrics(rank=0, local_rank=0, world_size=1, node="0", host="test")
    assert b"ddp_validation_loss" not in generate_latest(metrics.registry)
    metrics.observe_validation(1.25)
    assert b'ddp_validation_loss{rank="0"} 1.25' in generate_latest(metrics.registry)


def _validate(rank: int, world: int, training: bool) -> dict:
    from app.worker.data import Dataset
    from app.worker.dist import DistContext
    from app.worker.evaluation import Validator
    from app.worker.models import MiniMLP

    torch.manual_seed(0)
    held = Dataset(torch.randn(10, 32), torch.randint(0, 8, (10,)))
    model = MiniMLP().train(training)
    ctx = DistContext(rank, rank, world, torch.device("cpu"), "gloo")
    sizes = []

    def loss_fn(out, y):
        sizes.append(len(y))
        return torch.nn.functional.cross_entropy(out, y)

    loss = Validator(held, loss_fn, ctx, micro_batch=4, dtype=torch.float32).evaluate(model)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(held.inputs), held.targets, reduction="sum").item() / 10
    return {"loss": loss, "expected": expected, "sizes": sizes, "training": model.training}


def test_the_validation_loss_is_the_mean_over_every_held_out_sample_and_leaves_the_mode_as_it_was():
    for training in (True, False):
        out = run_world(_validate, 1, training, timeout=240)[0]
        assert out["sizes"] == [4, 3, 3]  # micro-batches of at most micro_batch, weighed by their samples
        assert out["loss"] == pytest.approx(out["expected"], rel=1e-6)
        assert out["training"] is training


def test_each_rank_takes_a_contiguous_share_of_the_held_out_samples():
    from app.worker.dist import DistContext
    from app.worker.evaluation import Validator

    def share(rank: int, world: int, size: int) -> tuple[int, list[int]]:
        v = Validator(list(range(size)), None, DistContext(rank, rank, world, torch.device("cpu"), "gloo"), 4, None)
        return v.start, v.sizes

    assert [share(r, 3, 10) for r in range(3)] == [(0, [4]), (4, [3]), (7, [3])]
    assert [share(r, 3, 2) for r in range(3)] == [(0, [1]), (1, [1]), (2, [])]  # fewer samples than ranks
