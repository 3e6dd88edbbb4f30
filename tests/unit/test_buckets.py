"""``app.parallel.ddp.buckets``: which parameters share a bucket (PyTorch's rule: one dtype and device per bucket,
closed once it holds its cap, the first one capped apart) and the ``GradBucket`` a comm hook is handed."""

from __future__ import annotations

import torch
from torch import nn

from app.parallel.ddp.buckets import GradBucket, assign_buckets


def params(*specs) -> list[nn.Parameter]:
    """Parameters of ``(numel, dtype)``."""
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in specs]


def test_a_bucket_closes_once_it_holds_its_cap_and_the_first_has_its_own():
    ps = params(*[(10, torch.float32)] * 6)  # 40 bytes each
    # Bucket 0 closes at >= 40 bytes (one parameter), the others at >= 100 (three), in the order given.
    assert assign_buckets(ps, [5, 4, 3, 2, 1, 0], first_cap=40, bucket_cap=100) == [[5], [4, 3, 2], [1, 0]]
    assert assign_buckets(ps, [0, 1, 2, 3, 4, 5], first_cap=80, bucket_cap=80) == [[0, 1], [2, 3], [4, 5]]
    # A cap no parameter reaches: one bucket; a cap below any parameter: a bucket each.
    assert assign_buckets(ps, [2, 1, 0], first_cap=10**6, bucket_cap=10**6) == [[2, 1, 0]]
    assert assign_buckets(ps, [2, 1, 0], first_cap=1, bucket_cap=1) == [[2], [1], [0]]


def test_a_bucket_holds_one_dtype_a_change_of_dtype_starts_the_next():
    ps = params((4, torch.float32), (4, torch.float32), (4, torch.float64), (4, torch.float32))
    assert assign_buckets(ps, [0, 1, 2, 3], first_cap=10**6, bucket_cap=10**6) == [[0, 1], [2], [3]]


def test_a_grad_bucket_lays_its_parameters_out_flat_with_pytorchs_accessors():
    ps = params((3, torch.float32), (2, torch.float32))
    ps[0].data = torch.zeros(3, 1)  # a view takes its parameter's shape
    bucket = GradBucket(4, ps, [7, 2], is_last=True)
    assert bucket.index() == 4 and bucket.is_last() and not GradBucket(0, ps, [7, 2], is_last=False).is_last()
    assert bucket.param_indices == [7, 2] and bucket.parameters() == ps
    assert bucket.offsets == [0, 3] and bucket.nbytes == 5 * 4 and not bucket.compressed
    assert [v.shape for v in bucket.gradients()] == [torch.Size([3, 1]), torch.Size([2])]
    bucket.set_buffer(torch.arange(5.0))  # a comm hook's result, copied in: the views see it
    assert torch.equal(bucket.gradients()[1], torch.tensor([3.0, 4.0]))
    assert bucket.gradients()[0].data_ptr() == bucket.buffer().data_ptr()
    compressed = GradBucket(0, ps, [0, 1], is_last=True, wire_dtype=torch.bfloat16)
    assert compressed.compressed and compressed.buffer().dtype == torch.bfloat16 and compressed.nbytes == 5 * 2


def test_a_bucket_knows_when_someone_else_holds_its_memory_and_renews_it_without_touching_theirs():
    bucket = GradBucket(0, params((3, torch.float32), (2, torch.float32)), [0, 1], is_last=True)
    assert not bucket.shared_elsewhere(lent=0)
    lent = bucket.views[0].detach()  # a slot handed to p.grad: counted by the caller
    assert not bucket.shared_elsewhere(lent=1)
    assert bucket.shared_elsewhere(lent=0)  # ... and, uncounted, a tensor a user kept
    bucket.set_buffer(torch.arange(5.0))
    kept = lent
    bucket.renew()
    assert kept.data_ptr() != bucket.buffer().data_ptr() and not bucket.shared_elsewhere(lent=0)
    assert bucket.views[1].data_ptr() == bucket.buffer().data_ptr() + 3 * 4
    bucket.set_buffer(torch.zeros(5))
    assert torch.equal(kept, torch.tensor([0.0, 1.0, 2.0]).view(3))  # the old memory stays with whoever held it
