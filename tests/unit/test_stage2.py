"""ZeRO stage 2's promises (app/parallel/zero/stage2.py) that a small world shows: the flat layout a sharded
checkpoint cuts along (``FlatShard``), the reduce-scatters kept in flight (``InFlight``), which parameters are
sharded, and when the parameters' all-gathers are still in flight under ``overlap_gather``. The walks against one
process, our DDP and PyTorch's ZeRO are in tests/integration/test_zero.py.

    .venv/bin/python -m pytest tests/unit/test_stage2.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.parallel.zero.stage2 import FlatShard, InFlight, ShardedGradDataParallel, trainable_named_parameters
from app.world import run_world


def test_a_flat_shard_pads_to_a_multiple_of_the_world_and_each_rank_owns_one_equal_chunk():
    params = [torch.arange(4.0).view(2, 2), torch.arange(10.0, 13.0)]  # 7 elements over 3 ranks: 3 each, 2 padding
    shards = [FlatShard(params, ["w", "b"], rank, 3) for rank in range(3)]
    s = shards[0]
    assert (s.offsets, s.numels, s.shapes, s.total) == ([0, 4], [4, 3], [(2, 2), (3,)], 7)
    assert (s.shard_numel, s.padded) == (3, 9)
    assert [x.start for x in shards] == [0, 3, 6]
    assert s.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 0.0, 0.0]
    assert s.flatten(torch.float64).dtype == torch.float64
    # (param index, lo, hi, offset in the chunk): rank 1's chunk [3, 6) is w's last element and b's first two.
    assert [x.pieces() for x in shards] == [[(0, 0, 3, 0)], [(0, 3, 4, 0), (1, 0, 2, 1)], [(1, 2, 3, 0)]]
    exact = FlatShard(params, ["w", "b"], 0, 7)  # no padding when the world divides the total
    assert (exact.shard_numel, exact.padded) == (1, 7)
    # A chunk that ends where a parameter starts holds nothing of it (no empty piece).
    pieces = [FlatShard(params, ["w", "b"], rank, 7).pieces() for rank in range(7)]
    assert pieces == [[(0, k, k + 1, 0)] for k in range(4)] + [[(1, k, k + 1, 0)] for k in range(3)]


class Work:
    """A collective in flight, as InFlight sees a gloo work: done or not, and whether a wait() blocked on it."""

    def __init__(self, done: bool = False):
        self.done, self.waited = done, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.waited, self.done = True, True


def test_in_flight_keeps_its_limit_waits_for_the_oldest_beyond_it_and_returns_what_each_left_in_order():
    works = [Work() for _ in range(4)]
    flight = InFlight(limit=2)
    flight.add(works[0], "a")
    flight.add(works[1], "b", done=str.upper)
    assert not any(w.waited for w in works)  # two alive: within the limit
    flight.add(works[2], "c")
    assert [w.waited for w in works] == [True, False, False, False]  # the oldest, beyond the limit
    works[1].done = True  # finished on its own: dropped at the next launch, its done() applied
    flight.add(works[3], "d")
    assert flight.results() == ["a", "B", "c", "d"]
    assert all(w.done for w in works) and flight.results() == []
    assert flight.seconds >= 0


def test_the_sharded_parameters_are_the_trainable_ones_each_once_in_module_order():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model[2].weight = model[0].weight  # tied: once, under its first name
    model[1].bias.requires_grad_(False)
    params, names = trainable_named_parameters(model)
    assert names == ["0.weight", "0.bias", "1.weight", "2.bias"]
    assert params[0] is model[0].weight


def stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def gathers_around_a_step(rank, world):
    """With overlap_gather, the all-gathers in flight: after a step before any forward, after a step once a
    forward was seen, and after the next forward; the parameters read through the wrapper equal on every rank."""
    wrapped = ShardedGradDataParallel(stack(), bucket_cap_mb=0.0001, overlap_gather=True)
    opt = wrapped.build_optimizer(torch.optim.AdamW, lr=0.01)
    seen = []
    opt.step()  # no gradient yet, and no forward seen: nothing knows which module needs which bucket
    seen.append(wrapped.gathers_in_flight)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        F.mse_loss(wrapped(x), x).backward()
        opt.step()
        opt.zero_grad()
        seen.append(wrapped.gathers_in_flight)
    wrapped(torch.zeros(1, 8))
    seen.append(wrapped.gathers_in_flight)
    return seen, len(wrapped.shard_parameters()), [p.detach().clone() for p in wrapped.parameters()]


def test_overlap_gather_leaves_the_gathers_in_flight_only_between_a_step_and_the_forward_that_waits_for_them():
    (seen, buckets, params0), (_, _, params1) = run_world(gathers_around_a_step, 2)
    assert buckets == 3  # 104-byte buckets: a layer's bias (32 bytes) and weight (256) close one
    assert seen == [0, buckets, buckets, 0], seen
    assert all(torch.equal(p, q) for p, q in zip(params0, params1))


def mixed_dtypes(rank, world):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    try:
        ShardedGradDataParallel(model)
    except ValueError as e:
        return str(e)
    return None


def test_trainable_parameters_of_two_dtypes_are_refused_in_one_line():
    for message in run_world(mixed_dtypes, 2):
        assert message == "ShardedGradDataParallel: trainable parameters must share one dtype (one flat buffer)"


class SlowWork:
    """A gloo work that reports itself done only once waited for: a network slower than the backward, so that what
    is in flight is what the wrapper keeps in flight, not what gloo happened to finish."""

    def __init__(self, work, alive: list):
        self.work, self.alive = work, alive
        alive.append(self)

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        self.work.wait()
        if self in self.alive:
            self.alive.remove(self)


def reduce_scatters_in_flight(rank, world, slow):
    from app.parallel.zero import stage2

    alive, most, plain = [], [], stage2.recorded.all_reduce
    if slow:

        def launch(*args, **kwargs):
            work = SlowWork(plain(*args, **kwargs), alive)
            most.append(len(alive))
            return work

        stage2.recorded.all_reduce = launch
    try:
        wrapped = ShardedGradDataParallel(stack(), bucket_cap_mb=0.0001)
        opt = wrapped.build_optimizer(torch.optim.AdamW, lr=0.01)
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            F.mse_loss(wrapped(x), x).backward()
            opt.step()
            opt.zero_grad()
    finally:
        stage2.recorded.all_reduce = plain
    return most, [p.detach().clone() for p in wrapped.parameters()]


def test_backward_keeps_one_reduce_scatter_in_flight_beside_the_bucket_filling():
    # Each reduce-scatter in flight holds a bucket's flat gradient: one at a time (REDUCE_SCATTERS_IN_FLIGHT) is
    # what keeps a rank's gradient memory at about two buckets beside its shard. When a bucket fills, the one before
    # it is still in flight, and is waited for first; the values are the same however slow the network.
    (most, params), _ = run_world(reduce_scatters_in_flight, 2, True)
    assert most == [1, 2, 2] * 2, most  # at each launch: the new one, and the one before it not yet waited for
    (_, fast), _ = run_world(reduce_scatters_in_flight, 2, False)
    assert all(torch.equal(p, q) for p, q in zip(params, fast))


READERS = {  # each given the wrapper and a state dict of its model taken before training
    "parameters": lambda w, saved: list(w.parameters()),
    "state_dict": lambda w, saved: w.state_dict(),
    "bare_state_dict": lambda w, saved: w.module.state_dict(),
    "flat_shards": lambda w, saved: w.flat_shards(),
    "load_state_dict": lambda w, saved: w.module.load_state_dict(saved),
}


def a_read_after_a_step(rank, world, reader):
    wrapped = ShardedGradDataParallel(stack(), bucket_cap_mb=0.0001, overlap_gather=True)
    opt = wrapped.build_optimizer(torch.optim.AdamW, lr=0.01)
    seen, saved = [], {k: v.clone() for k, v in wrapped.module.state_dict().items()}
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        F.mse_loss(wrapped(x), x).backward()
        opt.step()
        opt.zero_grad()
        before = wrapped.gathers_in_flight
        READERS[reader](wrapped, saved)
        seen.append((before, wrapped.gathers_in_flight))
    return seen


def test_a_read_through_the_wrapper_or_of_the_bare_models_state_waits_for_the_gathers_in_flight():
    for reader in READERS:
        for seen in run_world(a_read_after_a_step, 2, reader):
            assert seen == [(3, 0), (3, 0)], (reader, seen)


def bytes_of_a_step(rank, world, accumulate):
    wrapped = ShardedGradDataParallel(stack(), bucket_cap_mb=0.0001)
    opt = wrapped.build_optimizer(torch.optim.AdamW, lr=0.01)
    seen = []
    for step in range(2):
        before = dict(wrapped.comm_bytes)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        if accumulate:
            with wrapped.no_sync():  # the first micro-batch: nothing sent, p.grad accumulates
                F.mse_loss(wrapped(x), x).backward()
            seen.append(dict(wrapped.comm_bytes) == before)
        F.mse_loss(wrapped(x), x).backward()
        opt.step()
        opt.zero_grad()
        seen.append({k: wrapped.comm_bytes[k] - before[k] for k in before})
    return seen, wrapped.bucket_sizes, wrapped.require_backward_grad_sync


def test_a_step_reduce_scatters_and_gathers_every_bucket_once_and_no_sync_sends_nothing():
    for accumulate in (False, True):
        for seen, sizes, sync_after in run_world(bytes_of_a_step, 2, accumulate):
            assert sizes == [72 * 4] * 3  # a layer a bucket: 72 fp32 parameters, no padding on 2 ranks
            step = {"reduce_scatter": sum(sizes), "all_gather": sum(sizes)}
            assert seen == ([True, step] * 2 if accumulate else [step] * 2), seen
            assert sync_after  # no_sync() gives back what it found
