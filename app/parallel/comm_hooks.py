"""Communication hooks: how a full gradient bucket is turned into averaged gradients.

A hook has PyTorch's signature, ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``, so the same
function works with ``app.parallel.ddp.DistributedDataParallel.register_comm_hook`` and with
``torch.nn.parallel.DistributedDataParallel.register_comm_hook``. ``state`` is the process group to use
(``None`` means the default group); ``bucket`` offers ``buffer()``, the flat tensor holding the bucket's
gradients. The future must resolve to a tensor of the bucket's shape and dtype holding the *average* over ranks:
the hook owns the division by the world size.

The compression hooks carry a ``wire_dtype``. Our wrapper reads it and hands them buckets already in that dtype,
filled with ``grad / world_size`` (the cast and the division fused into the copy into the bucket, and the cast
back fused into the copy out): the hook then only all-reduces. PyTorch's DDP ignores the attribute and hands a
full-precision bucket, which the hook casts itself.

Run ``python -m pytest tests/integration/test_ddp.py -k hook`` to see them compared against uncompressed all-reduce.
"""

# No `from __future__ import annotations` here: PyTorch's DDP.register_comm_hook compares the return annotation with
# the type torch.futures.Future[torch.Tensor], and a postponed (string) annotation would make it refuse our hooks.
import torch
import torch.distributed as dist


def _group_or_world(process_group):
    return process_group if process_group is not None else dist.group.WORLD


def allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce with SUM, then divide by the world size: the plain, exact average (the default)."""
    group = _group_or_world(process_group)
    world_size = dist.get_world_size(group)
    tensor = bucket.buffer()
    fut = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()

    def average(fut: torch.futures.Future) -> torch.Tensor:
        # Dividing after the SUM (not before) keeps the result bit-for-bit what a reader would compute by hand;
        # in fp32 the sum of a few ranks' gradients cannot overflow.
        return fut.value()[0].div_(world_size)

    return fut.then(average)


def _compress_hook(dtype: torch.dtype):
    def hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
        group = _group_or_world(process_group)
        if getattr(bucket, "compressed", False):
            # Our wrapper's compressed bucket: already grad / world_size in `dtype`. SUM it in place; the wrapper
            # casts it back while copying it into p.grad.
            fut = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])
        world_size = dist.get_world_size(group)
        buffer = bucket.buffer()
        # Divide *before* the reduction: fp16 tops out at 65504, so summing undivided gradients of many ranks
        # could overflow; the division costs nothing extra since the cast makes a new tensor anyway.
        compressed = buffer.to(dtype).div_(world_size)
        fut = dist.all_reduce(compressed, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            # Write back into the bucket's own (full-precision) buffer so the wrapper can copy it out as usual.
            buffer.copy_(fut.value()[0])
            return buffer

        return fut.then(decompress)

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    hook.__doc__ = (
        f"Cast the bucket to {dtype} (half the bytes on the wire), divide by the world size, all-reduce "
        f"with SUM, cast back. Rounding error: relative ~1e-3 (fp16) / ~1e-2 (bf16) per element."
    )
    hook.wire_dtype = dtype  # read by our wrapper: compressed buckets, cast fused into the copies (see above)
    return hook


fp16_compress_hook = _compress_hook(torch.float16)
bf16_compress_hook = _compress_hook(torch.bfloat16)

HOOKS = {"allreduce": allreduce_hook, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook}
