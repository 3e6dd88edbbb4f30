"""The worker's ``compile`` setting and the ZeRO overlap settings (``overlap_gather``, ``prefetch``,
``reshard_after_forward``), run for real: 2 plain ranks, ``fixed_global_batch``, a few steps each.

- zero2 with ``overlap_gather=1`` and zero3 with ``prefetch=1 reshard_after_forward=0`` finish with the FINISHED
  checksum of the same run with them off: they move communication, not arithmetic (zero2's last all-gathers are still
  in flight at the end: the checksum waits for them, app.worker.steps.zero).
- ``compile=aot_eager`` (mini_mlp compiled whole, its graph cut at our DDP's buckets, app.parallel.compile)
  finishes with the checksum of the eager zero2 run: mini_mlp's compiled graph does the same float operations in the
  same order, and zero2 is bit for bit ddp (test_train_sharded.py); zero1's compiled run, zero1's eager checksum.
  That run has the real torch._dynamo (app.worker.startup), and its log says the model was compiled: the checksum
  alone could not tell a compiled run from an eager one (the first step's FLOP count once kept dynamo out of them).

    .venv/bin/python -m pytest -q tests/integration/test_train_compile.py
"""

from __future__ import annotations

import pytest

from tests.trainer_run import describe, finished, run_ranks, worker_args

pytestmark = pytest.mark.timeout(1200)
STEPS = 3  # overlap_gather overlaps from the second step on (the first forward teaches it which module reads what)


def checksum(**settings) -> tuple[str, str]:
    """The run's FINISHED checksum (the same on both ranks) and its log."""
    result = run_ranks(*worker_args("fixed_global_batch", steps=STEPS, checkpoint_every=100, **settings), world_size=2)
    assert result.returncode == 0, describe(result)
    sums = {d["checksum"] for d in finished(result.stdout).values()}
    assert len(finished(result.stdout)) == 2 and len(sums) == 1, describe(result)
    return sums.pop(), result.stderr


@pytest.fixture(scope="module")
def zero2_off() -> str:
    return checksum(parallel="zero2")[0]


def test_zero2_overlap_gather_finishes_with_the_checksum_of_off(zero2_off):
    on, log = checksum(parallel="zero2", overlap_gather=1)
    assert "zero2: overlap_gather on" in log, log[-3000:]
    assert on == zero2_off


def test_zero3_prefetch_and_units_kept_whole_finish_with_the_checksum_of_off():
    on, log = checksum(parallel="zero3", prefetch=1, reshard_after_forward=0)
    assert "zero3: prefetch 1, reshard_after_forward off" in log, log[-3000:]
    assert on == checksum(parallel="zero3")[0]


def test_a_compiled_ddp_run_trains_as_the_eager_one(zero2_off):
    compiled, log = checksum(parallel="ddp", compile="aot_eager")
    assert "compile (aot_eager): the model whole, cut at our DDP's buckets into 1 graphs" in log, log[-3000:]
    assert compiled == zero2_off


def test_a_compiled_zero1_run_trains_as_the_eager_one():
    # zero1's DDP keeps gradients in its buckets (gradient_as_bucket_view): the cut graph must accumulate there too.
    compiled, log = checksum(parallel="zero1", compile="aot_eager")
    assert "compile (aot_eager): the model whole, cut at our DDP's buckets into 1 graphs" in log, log[-3000:]
    assert compiled == checksum(parallel="zero1")[0]
