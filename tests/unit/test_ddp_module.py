"""``app.parallel.ddp.module``'s front on 2 real gloo ranks, what tests/integration/test_ddp_api.py leaves out: the
one-line refusals at construction, the bucket caps by PyTorch's rules, when a forward starts by syncing buffers,
and ``_set_static_graph``."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from app.parallel.ddp.module import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_BYTES, DistributedDataParallel
from app.world import run_world


class TwoDevices(nn.Module):
    def __init__(self):
        super().__init__()
        self.here, self.there = nn.Linear(2, 2), nn.Linear(2, 2, device="meta")


def refusal(build) -> str:
    try:
        build()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def front(rank: int, world: int) -> dict:
    frozen = nn.Linear(2, 2).requires_grad_(False)
    out: dict = {
        "no_trainable": refusal(lambda: DistributedDataParallel(frozen)),
        "two_devices": refusal(lambda: DistributedDataParallel(TwoDevices())),
        "zero_cap": refusal(lambda: DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=0)),
    }
    default = DistributedDataParallel(nn.Linear(2, 2))
    explicit = DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=2)
    out["caps"] = [
        (default.bucket_cap_bytes, default.first_bucket_cap_bytes, default.bucket_bytes_cap),
        (explicit.bucket_cap_bytes, explicit.first_bucket_cap_bytes, explicit.bucket_bytes_cap),
    ]
    # A forward starts by syncing buffers before the first forward and after each synchronising one, as PyTorch's.
    bn = DistributedDataParallel(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    x = torch.randn(4, 2)
    syncs = [bn.will_sync_module_buffers()]
    with bn.no_sync():
        bn(x)
    syncs.append(bn.will_sync_module_buffers())
    bn(x).sum().backward()
    syncs.append(bn.will_sync_module_buffers())
    out["syncs"] = syncs
    out["no_buffers"] = DistributedDataParallel(nn.Linear(2, 2)).will_sync_module_buffers()
    off = DistributedDataParallel(nn.BatchNorm1d(2), forward_sync_buffers=False)
    out["off"] = (off.will_sync_module_buffers(), off.broadcast_buffers)
    off.broadcast_buffers = True  # the deprecated name sets the same switch
    out["off"] += (off.forward_sync_buffers,)
    # device_ids names the one device the module lives on (a GPU; "meta" stands in for one here, init_sync off:
    # nothing on it can be sent). Another device is refused, naming the fix.
    meta = nn.Linear(2, 2, device="meta")
    on_it = DistributedDataParallel(meta, device_ids=["meta"], init_sync=False)
    out["device_ids"] = (on_it.device_ids, on_it.output_device, on_it.device)
    with torch.no_grad():  # a forward's inputs are moved to that device first, as PyTorch's DDP moves them
        out["moved"] = on_it(torch.ones(1, 2)).device
    out["elsewhere"] = refusal(lambda: DistributedDataParallel(meta, device_ids=["cpu"], init_sync=False))
    # Ranks that wrap different models (rank 1's layer one output wider): one line on every rank, with this rank's
    # parameter count, elements and the fingerprint of its shapes and dtypes that was compared.
    out["different"] = refusal(lambda: DistributedDataParallel(nn.Linear(2, 2 + rank)))
    late = DistributedDataParallel(nn.Linear(2, 2))
    late._set_static_graph()
    joined_group = late.join_process_group is late.process_group
    out["static"] = (late.static_graph, late.reducer.static_graph, late.join_device, joined_group)
    return out


def test_the_wrappers_front_refuses_caps_and_syncs_buffers_as_pytorchs():
    for rank, r in enumerate(run_world(front, 2)):
        shapes = [((2 + rank, 2), "torch.float32"), ((2 + rank,), "torch.float32")]
        fingerprint = hashlib.sha256(repr(shapes).encode()).digest()[:7].hex()
        assert r["different"] == (
            f"RuntimeError: ranks wrap different models: 2 parameters, {(2 + rank) * 3} elements, layout fingerprint "
            f"{fingerprint} here, but the ranks disagree; build the same model on every rank"
        )
        assert r["no_trainable"] == (
            "ValueError: the module has no parameter that requires a gradient: there is nothing for "
            "DistributedDataParallel to synchronise; run it unwrapped"
        )
        assert r["two_devices"].startswith("ValueError: the module's parameters are on several devices (")
        assert r["two_devices"].endswith("): move it to one device")
        assert r["zero_cap"] == "ValueError: bucket_cap_mb must be > 0, got 0"
        # Default: 25 MiB, a first bucket of 1 MiB; an explicit cap applies to every bucket, the first too.
        assert r["caps"] == [(25 * 2**20, 2**20, 25 * 2**20), (2 * 2**20, 2 * 2**20, 2 * 2**20)]
        assert r["syncs"] == [True, False, True]
        assert r["no_buffers"] is False
        assert r["off"] == (False, False, True)
        assert r["device_ids"] == ([None], None, torch.device("meta"))
        assert r["moved"] == torch.device("meta")
        assert r["elsewhere"] == (
            "ValueError: device_ids=['cpu']: the module lives on meta; move it first (model.to(cpu)) or pass "
            "device_ids=[None]"
        )
        assert r["static"] == (True, True, torch.device("cpu"), True)  # (what torch's Join reads, as PyTorch's)
    assert (DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_BYTES) == (25, 2**20)
