"""Activation checkpointing in every step kind, run for real on 2 gloo ranks: the same training as without it.

- The worker (``python -m app.train``) with ``activation_checkpointing`` units or every:2 ends each kind's run with
  the FINISHED checksum of the same run without it, bit for bit: the recomputed forward runs the same ops on the
  same values. ddp, zero1 and zero2 in float64, zero3 and pipeline in float32 (what they support); tiny_transformer
  (its blocks are the units), the pipeline on mini_mlp (the only built-in model it cuts; its layers are the units).
  Rank 0 logs which modules it checkpoints, once.
- zero3 with its shard units *inside* the checkpointed blocks (``units=[nn.LayerNorm]``: each block's two norms):
  the recomputation in backward runs a unit's forward hooks again, which gather it (backward needs it anyway) and
  must not free it (stage3 ``_after_unit_forward``): parameters after 3 steps equal the plain run's, and
  so do the bytes all-gathered (a free there would cost one more all-gather per unit and micro-batch).

Run: ``python -m pytest tests/integration/test_activation_checkpointing.py`` (minutes on 2 cores: 10 worker runs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.parallel.activation_checkpointing import candidate_units, checkpoint_modules
from app.parallel.zero.stage3 import FullyShardedDataParallel
from app.worker.models import TinyTransformer
from app.world import run_world
from tests.trainer_run import describe, finished, run_ranks, worker_args

pytestmark = pytest.mark.timeout(1800)
# 3 steps of 2 micro-batches of 8 sequences per rank: enough for a wrong gradient to move the checksum.
TRANSFORMER = {"model": "tiny_transformer", "seq_len": 16, "micro_batch": 8, "grad_accum_steps": 2}
SMALL = {"dataset_size": 256, "steps": 3, "log_every": 1}
KINDS = {
    "ddp": {**TRANSFORMER, "parallel": "ddp", "dtype": "float64"},
    "zero1": {**TRANSFORMER, "parallel": "zero1", "dtype": "float64"},
    "zero2": {**TRANSFORMER, "parallel": "zero2", "dtype": "float64"},
    "zero3": {**TRANSFORMER, "parallel": "zero3"},
    "pipeline": {"model": "mini_mlp", "parallel": "pipeline", "micro_batch": 16},
}


def _checksum(settings: dict) -> tuple[str, str]:
    """The run's one FINISHED checksum (every rank's the same) and its stderr."""
    result = run_ranks(*worker_args("one_process", wrapper="ours", **SMALL, **settings), world_size=2)
    assert result.returncode == 0, describe(result)
    done = finished(result.stdout)
    assert len(done) == 2 and len({d["checksum"] for d in done.values()}) == 1, describe(result)
    return done[0]["checksum"], result.stderr


@pytest.mark.parametrize(
    ("kind", "setting", "logged"),
    [
        ("ddp", "units", "6 modules, blocks.0, blocks.1, blocks.2, blocks.3, blocks.4, blocks.5"),
        ("ddp", "every:2", "3 modules, blocks.1, blocks.3, blocks.5"),
        ("zero1", "units", "6 modules"),
        ("zero2", "every:2", "3 modules"),
        ("zero3", "every:2", "3 modules"),
        ("pipeline", "units", "5 modules, net.0, net.1, net.2, net.3, net.4"),
    ],
)
def test_a_run_with_checkpointing_ends_where_the_run_without_it_ends(kind, setting, logged):
    plain, _ = _checksum(KINDS[kind])
    checkpointed, log = _checksum({**KINDS[kind], "activation_checkpointing": setting})
    assert checkpointed == plain
    assert log.count(f"activation checkpointing ({setting}): {logged}") == 1, log


def _train_zero3(rank: int, world_size: int, checkpointed: bool) -> tuple[dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    model = TinyTransformer(layers=2)
    if checkpointed:
        checkpoint_modules(candidate_units(model, []).values())  # the blocks, each holding two shard units
    wrapped = FullyShardedDataParallel(model, units=[nn.LayerNorm])
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    for step in range(3):
        tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(10 * step + rank))
        logits = wrapped(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return wrapped.full_state_dict(), wrapped.comm_bytes["all_gather"]


def test_zero3_units_inside_checkpointed_blocks_stay_gathered_for_their_recomputed_backward():
    plain, plain_bytes = run_world(_train_zero3, 2, False)[0]
    checkpointed, gathered_bytes = run_world(_train_zero3, 2, True)[0]
    assert gathered_bytes == plain_bytes
    assert plain.keys() == checkpointed.keys()
    assert all(torch.equal(plain[k], checkpointed[k]) for k in plain), {
        k: (plain[k] - checkpointed[k]).abs().max().item() for k in plain
    }
