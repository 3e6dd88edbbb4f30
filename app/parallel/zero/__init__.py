"""ZeRO from scratch, one stage per file: each shards one more kind of training state over the ranks.

- ``stage1.py``: ``ZeroRedundancyOptimizer``: the optimizer state sharded (PyTorch's constructor);
- ``stage2.py``: ``ShardedGradDataParallel``: gradients reduce-scattered and sharded too;
- ``stage3.py``: ``FullyShardedDataParallel``: parameters sharded too, gathered one unit at a time;
- ``checkpoint.py``: ``save_sharded`` / ``load_sharded`` for all three, each rank writing its own shard, loadable on
  another world size.
"""

from app.parallel.zero.checkpoint import CheckpointError, load_sharded, save_sharded
from app.parallel.zero.stage1 import ZeroRedundancyOptimizer
from app.parallel.zero.stage2 import ShardedGradDataParallel
from app.parallel.zero.stage3 import FullyShardedDataParallel

__all__ = [
    "CheckpointError",
    "FullyShardedDataParallel",
    "ShardedGradDataParallel",
    "ZeroRedundancyOptimizer",
    "load_sharded",
    "save_sharded",
]
