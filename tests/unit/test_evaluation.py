"""The validation split and its metric: the held-out samples are the data set's last ones and never trained on;
a stream cannot be split; ``ddp_validation_loss`` appears at the first validation and holds its value."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest

from app.worker.config import ConfigError, TrainConfig
from app.worker.metrics import TrainMetrics
from app.worker.workload import build_splits


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
