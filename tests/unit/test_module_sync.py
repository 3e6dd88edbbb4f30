"""``app.parallel.ddp.module_sync``: the broadcasts of module state (one flat collective per run of same-kind tensors
up to the cap) and the forward inputs moved to the wrapper's device, as PyTorch's DDP moves them."""

from __future__ import annotations

from collections import namedtuple

import torch
import torch.distributed as dist
from torch import nn

from app.parallel.ddp.module_sync import BROADCAST_CAP_BYTES, broadcast_coalesced, device_of, same_device, to_device
from app.world import run_world


def counted_broadcasts(fn) -> list[int]:
    """Run ``fn()`` and return the bytes of each ``dist.broadcast`` it issued (the real one runs)."""
    real, sizes = dist.broadcast, []

    def counting(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    dist.broadcast = counting
    try:
        fn()
    finally:
        dist.broadcast = real
    return sizes


def broadcast_kinds(rank: int, world: int) -> dict:
    """Rank 0's tensors (fp32, int64, fp64 interleaved) broadcast into every rank's, by the default cap and by a
    small one; and the broadcasts our DDP issues at construction for a model of many small tensors."""
    from app.parallel.ddp import DistributedDataParallel

    def tensors():
        g = torch.Generator().manual_seed(rank)
        return [
            torch.randn(3, 4, generator=g),
            torch.randint(0, 100, (5,), generator=g),
            torch.randn(6, generator=g),
            torch.randn(2, dtype=torch.float64, generator=g),
            torch.randint(0, 100, (2, 2), generator=g),
            torch.randn(1, 1, 7, generator=g),
        ]

    default = tensors()
    default_sizes = counted_broadcasts(lambda: broadcast_coalesced(default, 0, None))
    capped = tensors()
    # 64 bytes: the fp32 run (48 + 24 + 28 bytes) is cut where the next tensor would pass the cap.
    capped_sizes = counted_broadcasts(lambda: broadcast_coalesced(capped, 0, None, cap_bytes=64))
    exact = [torch.full((8,), float(rank)), torch.full((8,), float(rank + 1))]  # 32 + 32 bytes: the cap, exactly
    exact_sizes = counted_broadcasts(lambda: broadcast_coalesced(exact, 0, None, cap_bytes=64))
    torch.manual_seed(rank)  # a different model on every rank: construction makes them rank 0's
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(20)))
    for i in range(30):
        model.register_buffer(f"counter{i}", torch.full((3,), rank, dtype=torch.int64))
    built = counted_broadcasts(lambda: DistributedDataParallel(model))
    return {
        "default": default,
        "default_sizes": default_sizes,
        "capped": capped,
        "capped_sizes": capped_sizes,
        "exact": exact,
        "exact_sizes": exact_sizes,
        "construction": built,
        "model": [t.clone() for t in [*model.parameters(), *model.buffers()]],
    }


def test_a_broadcast_is_one_flat_collective_per_run_of_one_device_and_dtype_under_the_cap():
    ranks = run_world(broadcast_kinds, 2)
    for r in ranks:
        # Every rank ends with rank 0's values, each tensor in its shape and dtype.
        for name in ("default", "capped", "exact"):
            for mine, zeros in zip(r[name], ranks[0][name]):
                assert mine.dtype == zeros.dtype and torch.equal(mine, zeros), name
        assert all(torch.equal(a, b) for a, b in zip(r["model"], ranks[0]["model"]))
    for rank, r in enumerate(ranks):
        # Under the default cap: one broadcast per (device, dtype), whatever the order the tensors come in.
        assert sorted(r["default_sizes"]) == sorted([(12 + 6 + 7) * 4, (5 + 4) * 8, 2 * 8]), rank
        # Under a 64-byte cap: fp32 12 elements (48 B), then 6 + 7 (52 B); int64 5 + 4 (72 B) cut in two.
        assert sorted(r["capped_sizes"]) == sorted([48, (6 + 7) * 4, 5 * 8, 4 * 8, 2 * 8]), rank
        assert r["exact_sizes"] == [64], rank  # tensors that fill the cap exactly go out in one broadcast
        # A model of 40 parameters and 30 buffers, far under the default cap (25 MiB): two flat broadcasts at
        # construction, fp32 and int64, not one per tensor.
        assert sorted(r["construction"]) == [30 * 3 * 8, 20 * (16 + 4) * 4], rank
    assert BROADCAST_CAP_BYTES == 25 * 2**20  # DDP's default bucket size


def test_device_ids_entries_are_read_as_pytorch_reads_them():
    assert device_of(1) == torch.device("cuda", 1)  # an int is a CUDA index
    assert device_of("cpu") == torch.device("cpu")
    assert device_of(torch.device("meta")) == torch.device("meta")
    assert same_device(torch.device("cpu"), torch.device("cpu"))
    assert not same_device(torch.device("cpu"), torch.device("meta"))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert same_device(torch.device("cuda", 1), torch.device("cuda", 1))


def test_every_tensor_of_a_nested_forward_input_moves_and_the_rest_stays_as_it_was():
    Pair = namedtuple("Pair", "x y")
    cpu = torch.ones(2)
    moved = to_device({"a": [cpu, (cpu, 3)], "b": Pair(cpu, "label"), "c": None}, torch.device("meta"))
    assert moved["a"][0].device == torch.device("meta") and isinstance(moved["a"], list)
    assert isinstance(moved["a"][1], tuple) and moved["a"][1][0].device == torch.device("meta")
    assert moved["a"][1][1] == 3
    assert isinstance(moved["b"], Pair) and moved["b"].x.device == torch.device("meta") and moved["b"].y == "label"
    assert moved["c"] is None
    assert to_device(cpu, torch.device("cpu")) is cpu  # already there: the same tensor, no copy
