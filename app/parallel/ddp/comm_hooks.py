"""Communication hooks: how a full gradient bucket is turned into averaged gradients.

A hook has PyTorch's signature, ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``, so the same
function works with ``app.parallel.ddp.DistributedDataParallel.register_comm_hook`` and with
``torch.nn.parallel.DistributedDataParallel.register_comm_hook``. ``state`` is the process group to use
(``None`` means the default group); ``bucket`` offers ``buffer()``, the flat tensor holding the bucket's
gradients. The future must resolve to a tensor of the bucket's shape and dtype holding the *average* over ranks:
the hook owns the division by the world size.

The compression hooks carry a ``wire_dtype``. Our wrapper reads it and hands them buckets already in that dtype
(the cast fused into the copy into the bucket, and the cast back into the copy out), not yet divided. On gloo the
hook then averages by exchange (``Exchange``): gloo's own all-reduce sums 16-bit types one element at a time,
slowly, and rounds at every step; here each rank is sent the others' share of its part of the bucket, averages
it in fp32 with PyTorch's vectorised kernels, rounds once and sends it back. PyTorch's DDP ignores the attribute
and hands a full-precision bucket, which the hook casts itself.

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
        world_size = dist.get_world_size(group)
        if getattr(bucket, "compressed", False):
            # Our wrapper's compressed bucket: each gradient in `dtype` already, not yet divided. It casts the
            # average back while copying it into p.grad.
            if bucket.buffer().device.type == "cpu":
                return Exchange(bucket, group)  # the wrapper finishes it at the end of backward (Exchange.wait)
            buffer = bucket.buffer().div_(world_size)  # as below: divided before the SUM, which cannot overflow
            fut = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])
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


class Exchange:
    """The average of one compressed bucket over ``group`` by direct exchange, started now, finished by ``wait()``.

    The bucket is cut into one part per rank. First each rank sends every other rank that rank's part of its
    bucket (``isend``/``irecv``, all at once) and receives everyone's copy of its own part; then (``wait``) it
    averages its part in fp32 and rounds once to the wire dtype, and sends the result to every other rank while
    receiving theirs. Each rank sends 2 (n - 1) / n of the bucket, as in a ring all-reduce.

    Our wrapper starts one per compressed bucket as the bucket fills and calls ``wait()`` at the end of backward,
    in bucket order on every rank: the second half's sends are posted in the same order everywhere, whatever
    finished first. Incoming parts land in a buffer kept on the bucket (a new one would page-fault every step).
    """

    def __init__(self, bucket, group):
        buffer = bucket.buffer()
        self._buffer, self._group = buffer, group
        n, me = dist.get_world_size(group), dist.get_rank(group)
        sizes = [buffer.numel() // n + (k < buffer.numel() % n) for k in range(n)]
        self._parts = list(buffer.split(sizes))
        self._mine = self._parts[me]
        self._peers = [k for k in range(n) if k != me]
        inbox = bucket.inbox
        if inbox is None or inbox.numel() != len(self._peers) * sizes[me]:
            inbox = bucket.inbox = buffer.new_empty(len(self._peers) * sizes[me])
        self._received = list(inbox.view(len(self._peers), sizes[me]).unbind())
        # Tags of their own, per bucket and half: no message can be taken for another bucket's, or a user's.
        self._tag = 2 * bucket.index() + 1
        self._works = self._post([(self._parts[k], k) for k in self._peers], zip(self._received, self._peers), 0)

    def _post(self, sends, receives, half: int) -> list:
        """isend/irecv each (tensor, peer), skipping empty parts (a bucket smaller than the world): both ends know
        every part's size, so both skip the same messages."""
        group, tag = self._group, self._tag + half
        works = [dist.isend(t, group=group, tag=tag, group_dst=k) for t, k in sends if t.numel()]
        return works + [dist.irecv(t, group=group, tag=tag, group_src=k) for t, k in receives if t.numel()]

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        mine, received = self._mine, self._received
        if len(received) == 1:
            torch.lerp(mine, received[0], 0.5, out=mine)  # (a + b) / 2, computed in fp32, rounded once
        elif received:
            total = mine.float()
            for part in received:
                total.add_(part)
            torch.mul(total, 1 / (len(received) + 1), out=mine)
        for work in self._post([(mine, k) for k in self._peers], [(self._parts[k], k) for k in self._peers], 1):
            work.wait()
        return self._buffer


fp16_compress_hook = _compress_hook(torch.float16)
bf16_compress_hook = _compress_hook(torch.bfloat16)

HOOKS = {"allreduce": allreduce_hook, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook}
