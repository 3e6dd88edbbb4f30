"""The one local-world launcher: processes on this machine for the demos, ``app.check``, the benches and the tests.

    from app.world import spawn_world, run_world, start_module
    spawn_world(fn, 2, cfg)                       # fn(rank, 2, cfg) on 2 fresh ranks in one process group
    run_world(fn, 2, cfg)                         # the same on a world kept for the next call (the tests)
    start_module("app.train", *flags, env=env)    # `python -m app.train ...`, a Popen-like process

- ``template``: ``start_module``: ``python -m MODULE`` forked from a template that has imported torch once
  (``LAUNCH_FORK=0``: a new interpreter each), the one way every process here is started;
- ``ranks``: ``spawn_world`` / ``run_world`` / ``World``: a function on N ranks, each started by ``start_module``.

The container's launcher forks its trainer another way, torchrun's own (app/cluster/forked_trainer.py), under the
same ``LAUNCH_FORK`` switch. ``make bench-startup`` measures what each start-up trick saves.
"""

from app.world.ranks import World, WorldFailed, close_all, run_world, spawn_world
from app.world.template import ForkedWorker, fork_enabled, start_module

__all__ = [
    "ForkedWorker",
    "World",
    "WorldFailed",
    "close_all",
    "fork_enabled",
    "run_world",
    "spawn_world",
    "start_module",
]
