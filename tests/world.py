"""The tests' multi-rank harness is the project's one local-world launcher, ``app.world``: ``run_world(fn, n, *args)``
runs ``fn(rank, n, *args)`` on a kept world of ``n`` real gloo ranks on loopback (see ``app/world/ranks.py``).

Imported from here by the tests that predate ``app.world``; new tests import ``from app.world import run_world``.
"""

from app.world import close_all, run_world

__all__ = ["close_all", "run_world"]
