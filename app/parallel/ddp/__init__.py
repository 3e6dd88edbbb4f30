"""``DistributedDataParallel`` from scratch, a drop-in for PyTorch's: ``from app.parallel.ddp import
DistributedDataParallel as DDP``.

Read in this order: ``module.py`` (the ``nn.Module`` front: whether a backward synchronises), ``reducer.py`` (the
synchronising: hooks, buckets, the asynchronous all-reduce, unused parameters, static graph), ``comm_stats.py`` (what
went on the wire). The smaller parts they name: ``buckets.py`` (the flat buffers and the rule that fills them),
``comm_hooks.py`` (how a full bucket becomes averaged gradients), ``graph_walk.py`` (which parameters a forward
reached), ``join.py`` (uneven inputs), ``sparse.py`` (sparse embedding gradients), ``module_sync.py`` (module state
and forward inputs).
"""

from app.parallel.ddp.module import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
