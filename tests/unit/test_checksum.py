"""``app.parallel.checksum``: the one parameter hash, sha256 over each tensor's raw bytes in order (the FINISHED
line's checksum, equal on two ranks only for bit-identical models)."""

from __future__ import annotations

import hashlib

import torch

from app.parallel.checksum import tensors_checksum, update


def test_the_checksum_is_sha256_of_the_raw_bytes_in_order_in_any_dtype_and_layout():
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)  # (no numpy dtype: hashed through a uint8 view)
    expected = hashlib.sha256(a.numpy().tobytes() + b.view(torch.int16).numpy().tobytes()).hexdigest()
    assert tensors_checksum([a, b]) == expected
    assert tensors_checksum([b, a]) != expected  # the order is part of it
    assert tensors_checksum([a.t().contiguous().t()]) == tensors_checksum([a])  # the values, not the layout
    assert tensors_checksum([a.t()]) != tensors_checksum([a])  # ... as they lie in order: another matrix
    nudged = a.clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(1.0))  # one ulp: another model
    assert tensors_checksum([nudged]) != tensors_checksum([a])
    h = hashlib.sha256()
    update(h, torch.nn.Parameter(a.clone()))  # a parameter (requires grad) hashes as its data
    assert h.hexdigest() == tensors_checksum([a])
