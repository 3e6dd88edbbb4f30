"""The ZeRO step kinds (app/worker/steps/zero.py) on a world of 2: what each step reports to its metrics (this
step's collectives, the bytes a rank holds), the synchronised micro-batches it counts, and ``fsdp_units``. Whole
runs of each kind are in tests/integration/test_train_sharded.py.

    .venv/bin/python -m pytest tests/unit/test_zero.py
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from app.worker.config import ConfigError, TrainConfig
from app.worker.dist import DistContext
from app.worker.metrics import NoMetrics
from app.worker.steps import build_step
from app.worker.steps.zero import optimizer_state_bytes, resolve_fsdp_units, tensor_bytes
from app.world import run_world


class Recorded(NoMetrics):
    """The metrics a step feeds, kept: each ``observe_zero`` call's arguments, and the stage enabled."""

    def __init__(self):
        self.zero: list[dict] = []
        self.stage = None

    def enable_zero(self, stage: int) -> None:
        self.stage = stage

    def observe_zero(self, **kwargs) -> None:
        self.zero.append(kwargs)


def steps_observed(rank, world, parallel, accum):
    cfg = TrainConfig(steps=2, parallel=parallel, metrics_port=0, micro_batch=4, effective_batch=8 * accum)
    metrics = Recorded()
    step = build_step(cfg, DistContext(rank, rank, world, torch.device("cpu"), "gloo"), 1, metrics)
    outcomes, walls = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        outcomes.append(step.train_step(step.batches.next_micro_batches(), agree_nonfinite=lambda bad: bad))
        walls.append(time.perf_counter() - t0)
    shards = list(step.optimizer.param_groups[0]["params"]) if parallel != "zero1" else []
    wrapped = step.wrapped if parallel != "zero1" else None
    totals = {k: wrapped.comm_bytes[k] for k in ("reduce_scatter", "all_gather")} if wrapped is not None else {}
    model_bytes = sum(p.numel() * 4 for p in step.model.parameters()) if parallel != "zero3" else None
    return {
        "stage": metrics.stage,
        "zero": metrics.zero,
        "outcomes": [(o.syncs, o.comm_seconds, o.exposed_seconds) for o in outcomes],
        "walls": walls,
        "totals": totals,
        "shard_bytes": sum(s.numel() * 4 for s in shards),
        "model_bytes": model_bytes,
        "state_bytes": optimizer_state_bytes(step.optimizer.optim if parallel == "zero1" else step.optimizer),
    }


@pytest.mark.parametrize("parallel", ["zero2", "zero3"])
def test_each_step_reports_its_own_collectives_and_the_bytes_the_rank_holds_after_it(parallel):
    for r in run_world(steps_observed, 2, parallel, 1):
        assert r["stage"] == int(parallel[-1])
        first, second = r["zero"]
        # Each step's bytes, not the run's so far: two equal steps send as much; together, the wrapper's totals.
        assert first["collectives"].keys() == {"reduce_scatter", "all_gather"}
        for name in ("reduce_scatter", "all_gather"):
            assert first["collectives"][name][0] == second["collectives"][name][0] > 0, (name, r["zero"])
            assert first["collectives"][name][0] + second["collectives"][name][0] <= r["totals"][name]
            # ... and the seconds this step waited on them: within the step's own wall time.
            assert all(0 <= z["collectives"][name][1] <= wall for z, wall in zip(r["zero"], r["walls"])), r
        assert second["gradient_bytes"] == r["shard_bytes"] > 0  # this rank's shard of the gradient only
        # AdamW: exp_avg and exp_avg_sq of each shard, and a 0-dim step.
        assert second["optimizer_state_bytes"] == r["state_bytes"] > 2 * r["shard_bytes"]
        for syncs, comm_seconds, exposed in r["outcomes"]:
            assert syncs == 1 and comm_seconds >= exposed >= 0
        # The exposed part is this step's wait for its reduce-scatters, one of the collectives it reports.
        assert [o[2] for o in r["outcomes"]] == [z["collectives"]["reduce_scatter"][1] for z in r["zero"]]
        if parallel == "zero2":
            assert second["parameter_bytes"] == r["model_bytes"]  # the parameters whole on every rank
        else:
            assert second["parameter_bytes"] == r["shard_bytes"]  # 1/N of them


def test_a_zero1_step_reports_no_collectives_of_its_own_and_the_whole_gradient_with_its_share_of_the_state():
    for r in run_world(steps_observed, 2, "zero1", 1):
        assert r["stage"] == 1
        for z in r["zero"]:
            assert z["collectives"] == {}  # our DDP's buckets report its all-reduce
            assert z["parameter_bytes"] == z["gradient_bytes"] == r["model_bytes"]
            assert 0 < z["optimizer_state_bytes"] == r["state_bytes"] < 2 * r["model_bytes"]


@pytest.mark.parametrize(("parallel", "syncs"), [("zero2", 1), ("zero3", 2)])
def test_with_two_micro_batches_zero3_synchronises_each_and_zero2_only_the_last(parallel, syncs):
    # zero3 has no no_sync: every micro-batch's backward reduce-scatters (the step counts both).
    for r in run_world(steps_observed, 2, parallel, 2):
        assert [o[0] for o in r["outcomes"]] == [syncs, syncs], r["outcomes"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(2, 1)


def test_fsdp_units_names_module_classes_and_empty_means_each_child():
    assert resolve_fsdp_units(Net(), "") is None
    assert resolve_fsdp_units(Net(), " , ") is None
    assert resolve_fsdp_units(Net(), "Block") == [Block]
    assert resolve_fsdp_units(Net(), " Block , Linear") == [Block, nn.Linear]


def test_fsdp_units_naming_no_class_of_the_model_is_a_config_error_naming_those_it_has():
    with pytest.raises(ConfigError) as info:
        resolve_fsdp_units(Net(), "Block,Conv2d")
    assert str(info.value) == (
        "fsdp_units='Block,Conv2d': Conv2d names no module class of Net (it has Block, Linear, ModuleList); "
        "name those, or leave fsdp_units empty"
    )


def test_the_bytes_counted_are_every_tensor_an_optimizer_keeps_and_none_counts_nothing():
    assert tensor_bytes([torch.zeros(3), None, torch.zeros(2, dtype=torch.float64)]) == 3 * 4 + 2 * 8
    p = nn.Parameter(torch.zeros(5))
    opt = torch.optim.AdamW([p], lr=0.1)
    assert optimizer_state_bytes(opt) == 0  # nothing before the first step
    p.grad = torch.ones(5)
    opt.step()
    opt.state[p]["count"] = 3  # a plain number is no tensor
    assert optimizer_state_bytes(opt) == 5 * 4 * 2 + opt.state[p]["step"].element_size()
