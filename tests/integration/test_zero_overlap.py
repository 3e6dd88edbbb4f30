"""Stage 2's overlapped all-gather (``overlap_gather``) and stage 3's prefetch (``prefetch``,
``reshard_after_forward``) on real gloo ranks: the same parameters, bit for bit, as without them; nothing reads a
parameter whose all-gather is still in flight; at most ``prefetch`` + 1 units gathered at once.

The walks next to one process, our DDP and PyTorch's (``fully_shard`` too) are in test_zero.py and test_fsdp.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.parallel.activation_checkpointing import candidate_units, checkpoint_modules
from app.parallel.zero import load_sharded, save_sharded
from app.parallel.zero.stage2 import ShardedGradDataParallel
from app.parallel.zero.stage3 import FullyShardedDataParallel
from app.worker.models import TinyTransformer, parameter_checksum
from app.world import run_world
from tests.integration.test_zero import LR, PER_RANK, batch

WIDTH, DEPTH = 16, 5


def stack() -> nn.Sequential:
    """Five Linear(16, 16) with tanh between: at bucket_cap_mb=0.001 (1 KiB) each layer's weight closes a bucket."""
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def data(step: int, rank: int):
    x, y = batch(step, PER_RANK * 4)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return x[mine].repeat(1, 2), y[mine].repeat(1, 2)  # 16 features


def stage2(overlap: bool):
    wrapped = ShardedGradDataParallel(stack(), bucket_cap_mb=0.001, overlap_gather=overlap)
    return wrapped, wrapped.build_optimizer(torch.optim.AdamW, lr=LR)


def train_step(wrapped, opt, step: int, rank: int) -> None:
    opt.zero_grad()
    x, y = data(step, rank)
    F.mse_loss(wrapped(x), y).backward()
    opt.step()


# --------------------------------------------------------------------------------------------------------------------
# Stage 2: overlap_gather
# --------------------------------------------------------------------------------------------------------------------
def _stage2_waits(rank, world):
    """Each read right after a step, with and without overlap: the gathers in flight before and after it, its value."""
    out = {}
    for overlap in (False, True):
        wrapped, opt = stage2(overlap)
        seen = []  # gathers still in flight as each Linear's forward starts (our pre-hook has run before this one)
        for layer in wrapped.module:
            if isinstance(layer, nn.Linear):
                layer.register_forward_pre_hook(lambda *_, w=wrapped, s=seen: s.append(w.gathers_in_flight))
        reads = {}
        steps_began = []  # gathers in flight as a step begins (after our step pre-hook): it writes the shards
        opt.register_step_pre_hook(lambda *_, w=wrapped, s=steps_began: s.append(w.gathers_in_flight))
        for step, read in enumerate(("forward", "state_dict", "checksum", "eval", "step_again")):
            train_step(wrapped, opt, step, rank)
            before = wrapped.gathers_in_flight
            seen.clear()
            if read == "forward":  # the next training forward: each layer waits for its own bucket alone
                value = wrapped(data(9, rank)[0]).detach()
            elif read == "state_dict":
                value = {k: v.clone() for k, v in wrapped.state_dict().items()}
            elif read == "checksum":
                value = parameter_checksum(wrapped)
            elif read == "eval":
                with torch.no_grad():
                    value = wrapped.module(data(9, rank)[0])  # the bare model: its modules' hooks wait
            else:
                opt.step()  # a step straight after a step (the same gradients), no forward between
                wrapped.wait_parameters()
                value = parameter_checksum(wrapped.module)
            reads[read] = (before, wrapped.gathers_in_flight if read != "forward" else None, list(seen), value)
        out[overlap] = reads, steps_began
    return out


def test_stage2_overlap_defers_each_gather_to_its_layer_and_every_read_waits_for_it():
    results = run_world(_stage2_waits, 2, timeout=300)
    for rank_result in results:
        (plain, _), (overlapped, steps_began) = rank_result[False], rank_result[True]
        assert steps_began == [0] * 6, steps_began
        buckets = plain["forward"][0]
        assert buckets == 0, "without overlap the step waits for its gathers"
        for read, (before, after, _, value) in overlapped.items():
            assert before > 1, (read, before)  # the step left every bucket's gather in flight
            assert after in (0, None), (read, after)
            expected = plain[read][3]
            if isinstance(value, dict):
                assert value.keys() == expected.keys() and all(torch.equal(value[k], expected[k]) for k in value)
            elif isinstance(value, torch.Tensor):
                assert torch.equal(value, expected), read
            else:
                assert value == expected, read
        seen = overlapped["forward"][2]
        # The first layer ran with later layers' gathers still in flight; each layer waited for more of them.
        assert seen[0] > 0 and seen == sorted(seen, reverse=True) and seen[-1] == 0, seen


def _stage2_checkpoint(rank, world, directory):
    """Save with the gathers in flight; load into a model whose own gathers are in flight: none may overwrite."""
    saved, opt = stage2(True)
    for step in range(2):
        train_step(saved, opt, step, rank)
    in_flight = saved.gathers_in_flight
    save_sharded(directory, saved, opt)
    after_save = saved.gathers_in_flight
    loaded, loaded_opt = stage2(True)
    train_step(loaded, loaded_opt, 5, rank)  # other values, their all-gather in flight when the load begins
    load_sharded(directory, loaded, loaded_opt)
    same = parameter_checksum(loaded) == parameter_checksum(saved)
    for step in range(2, 4):  # and both continue alike
        train_step(saved, opt, step, rank)
        train_step(loaded, loaded_opt, step, rank)
    return in_flight, after_save, same, parameter_checksum(loaded) == parameter_checksum(saved)


def test_stage2_checkpoint_waits_for_the_gathers_in_flight(tmp_path):
    for in_flight, after_save, same, same_after in run_world(_stage2_checkpoint, 2, str(tmp_path), timeout=300):
        assert in_flight > 1 and after_save == 0
        assert same and same_after


# --------------------------------------------------------------------------------------------------------------------
# Stage 3: prefetch, reshard_after_forward
# --------------------------------------------------------------------------------------------------------------------
def _stage3_units(rank, world, prefetch, reshard):
    wrapped = FullyShardedDataParallel(stack(), prefetch=prefetch, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    peaks, left = [], []  # per step: the most units gathered at once in forward, in backward; gathered after
    for step in range(3):
        opt.zero_grad()
        x, y = data(step, rank)
        wrapped.max_units_gathered = 0
        loss = F.mse_loss(wrapped(x), y)
        forward_peak, wrapped.max_units_gathered = wrapped.max_units_gathered, wrapped.units_gathered
        loss.backward()
        peaks.append((forward_peak, wrapped.max_units_gathered))
        left.append(wrapped.units_gathered)
        opt.step()
    return peaks, left, wrapped.full_state_dict(), wrapped.comm_bytes["all_gather"]


@pytest.mark.parametrize(("prefetch", "reshard"), [(1, True), (2, True), (1, False)])
def test_stage3_prefetch_gathers_at_most_its_limit_and_changes_nothing(prefetch, reshard):
    plain_peaks, _, plain, plain_bytes = run_world(_stage3_units, 2, 0, True, timeout=300)[0]
    peaks, left, state, gathered_bytes = run_world(_stage3_units, 2, prefetch, reshard, timeout=300)[0]
    assert plain_peaks == [(1, 1)] * 3  # one unit at a time without prefetch
    # The first forward has no order to prefetch by (its backward has); then the limit, reached in both directions.
    # Not resharded: every unit whole from its forward to its backward.
    expected = (prefetch + 1, prefetch + 1) if reshard else (DEPTH, DEPTH)
    assert peaks[0] == (1 if reshard else DEPTH, expected[1]) and peaks[1:] == [expected] * 2, peaks
    assert left == [0, 0, 0]  # every unit freed by the end of backward
    assert all(torch.equal(state[k], plain[k]) for k in plain)
    if reshard:
        assert gathered_bytes == plain_bytes  # prefetched, not gathered twice
    else:
        assert gathered_bytes < plain_bytes  # gathered once a step, not twice


def _stage3_checkpointed(rank, world, prefetch):
    torch.manual_seed(0)
    model = TinyTransformer(layers=2)
    checkpoint_modules(candidate_units(model, []).values())  # the blocks, each holding two shard units
    wrapped = FullyShardedDataParallel(model, units=[nn.LayerNorm], prefetch=prefetch)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    for step in range(3):
        tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(10 * step + rank))
        F.cross_entropy(wrapped(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    return wrapped.full_state_dict()


def test_stage3_prefetch_with_activation_checkpointing_changes_nothing():
    plain = run_world(_stage3_checkpointed, 2, 0, timeout=300)[0]
    prefetched = run_world(_stage3_checkpointed, 2, 2, timeout=300)[0]
    assert plain.keys() == prefetched.keys() and all(torch.equal(plain[k], prefetched[k]) for k in plain)


def test_a_negative_prefetch_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"prefetch=-1: the number of units gathered ahead must be >= 0"):
        FullyShardedDataParallel(copy.deepcopy(stack()), prefetch=-1)


class Skipping(nn.Module):
    """The stack, with one layer skipped when asked: a forward whose path differs from the last one's."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(layer for layer in stack() if isinstance(layer, nn.Linear))
        self.skip = None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = x if i == self.skip else torch.tanh(layer(x))
        return x


def _stage3_other_path(rank, world, prefetch):
    wrapped = FullyShardedDataParallel(Skipping(), prefetch=prefetch)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    left_after_eval = []
    for step in range(3):
        train_step(wrapped, opt, step, rank)
        wrapped.module.skip = 2  # evaluation takes another path: layer 2's prefetch is never used
        with torch.no_grad():
            wrapped(data(9, rank)[0])
        left_after_eval.append(wrapped.units_gathered)
        wrapped.module.skip = None
    return left_after_eval, wrapped.full_state_dict()


def test_stage3_a_prefetch_the_forward_did_not_use_is_freed_at_its_end():
    plain_left, plain = run_world(_stage3_other_path, 2, 0, timeout=300)[0]
    left, state = run_world(_stage3_other_path, 2, 1, timeout=300)[0]
    assert plain_left == left == [0, 0, 0]
    assert all(torch.equal(state[k], plain[k]) for k in plain)


def _stage2_transformer(rank, world, overlap):
    """TinyTransformer: MultiheadAttention reads its out_proj's weight without out_proj's forward ever running."""
    torch.manual_seed(0)
    wrapped = ShardedGradDataParallel(TinyTransformer(layers=2), bucket_cap_mb=0.01, overlap_gather=overlap)
    opt = wrapped.build_optimizer(torch.optim.AdamW, lr=LR)
    stale = []  # per attention forward: is its out_proj's bucket still in flight when the attention starts?
    for block in wrapped.module.blocks:
        bucket = wrapped._slot[id(block.attn.out_proj.weight)][0]
        block.attn.register_forward_pre_hook(lambda *_, b=bucket: stale.append(b in wrapped._gathers))
    for step in range(3):  # nothing reads the parameters between the steps: only the forward's hooks wait
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(10 * step + rank))
        opt.zero_grad()
        F.cross_entropy(wrapped(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
    return parameter_checksum(wrapped), stale[2:], len(wrapped._buckets)  # the first forward had nothing in flight


def test_stage2_overlap_waits_for_a_parameter_its_module_never_runs_before_the_parent_reads_it():
    plain = run_world(_stage2_transformer, 2, False, timeout=300)
    overlapped = run_world(_stage2_transformer, 2, True, timeout=300)
    for (digest, _, _), (overlapped_digest, stale, buckets) in zip(plain, overlapped):
        assert buckets > 2 and digest == overlapped_digest
        assert stale and not any(stale), stale


def _stage2_gathers_at_launch(rank, world):
    """Gathers already in flight as each all-gather of a step is launched, without overlap and with it."""
    from app.diagnostics import collectives as recorded

    launch, seen = recorded.all_gather_into_tensor, []
    out = {}
    for overlap in (False, True):
        wrapped, opt = stage2(overlap)

        def counting(*args, w=wrapped, **kwargs):
            seen.append(w.gathers_in_flight)
            return launch(*args, **kwargs)

        recorded.all_gather_into_tensor = counting
        seen.clear()
        train_step(wrapped, opt, 0, rank)
        wrapped.wait_parameters()
        out[overlap] = list(seen)
        recorded.all_gather_into_tensor = launch
    return out


def test_stage2_without_overlap_keeps_at_most_two_gathers_and_their_shard_copies_in_flight():
    # Each gather in flight holds a copy of its bucket's shard: launched all at once they would be a second copy of
    # the rank's whole shard (what memory.json showed as zero2's excess over its formula).
    from app.parallel.zero.stage2 import GATHERS_IN_FLIGHT

    seen = run_world(_stage2_gathers_at_launch, 2, timeout=120)[0]
    assert len(seen[False]) == DEPTH > GATHERS_IN_FLIGHT  # a bucket per layer's weight
    assert max(seen[False]) == GATHERS_IN_FLIGHT, seen
    assert seen[True] == list(range(DEPTH)), seen  # overlap launches them all before the next forward
