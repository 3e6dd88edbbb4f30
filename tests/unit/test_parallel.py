"""``app.parallel``: the wrappers importable from the package itself, and ``wrap_model``'s choices that need no
process group (the others: tests/integration/test_ddp_api.py)."""

from __future__ import annotations

import pytest
from torch import nn

import app.parallel
from app.parallel import WRAPPERS, wrap_model


def test_the_wrappers_and_sharded_checkpoints_are_importable_from_the_package():
    from app.parallel.ddp import DistributedDataParallel
    from app.parallel.zero import FullyShardedDataParallel, ShardedGradDataParallel, ZeroRedundancyOptimizer

    assert app.parallel.DistributedDataParallel is DistributedDataParallel
    assert app.parallel.ZeroRedundancyOptimizer is ZeroRedundancyOptimizer
    assert app.parallel.ShardedGradDataParallel is ShardedGradDataParallel
    assert app.parallel.FullyShardedDataParallel is FullyShardedDataParallel
    from app.parallel.zero import CheckpointError, load_sharded, save_sharded

    assert (app.parallel.save_sharded, app.parallel.load_sharded) == (save_sharded, load_sharded)
    assert app.parallel.CheckpointError is CheckpointError
    with pytest.raises(AttributeError, match=r"^module 'app.parallel' has no attribute 'DataParallel'$"):
        app.parallel.DataParallel  # noqa: B018 (the access is the test)


def test_wrapper_none_is_the_model_itself_and_an_unknown_name_is_refused_naming_the_three():
    model = nn.Linear(2, 2)
    assert wrap_model(model, "none") is model
    assert WRAPPERS == ("ours", "torch", "none")
    with pytest.raises(ValueError, match=r"^wrapper='fsdp': choose one of ours, torch, none$"):
        wrap_model(model, "fsdp")
