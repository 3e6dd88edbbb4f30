"""Run as ``python -m tests.integration.world_main_probe``: a function of a ``__main__`` module on a local world, as
``python -m bench.accum`` or ``python -m app.demos.pipeline_demo`` run theirs (tests/integration/test_world.py)."""

from app.world import spawn_world


def rank_and_size(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size


if __name__ == "__main__":
    print(spawn_world(rank_and_size, 2))
