"""The project's collectives, recorded: ``torch.distributed``'s functions with the flight recorder around them.

Each takes the same arguments as its ``torch.distributed`` namesake plus ``source``, what issued it (``"bucket 3 of
our DDP"``, ``"zero3 unit layers.0"``, ``"step control"``): the doctor names it. A blocking call records its start
and end; an asynchronous one (``async_op=True``) returns a ``RecordedWork`` whose ``wait()`` stamps the end when the
work's wait returns (never from gloo's thread: a callback there would outlive the group at shutdown).

    from app.diagnostics import collectives as recorded
    recorded.all_reduce(flags, "step control", op=dist.ReduceOp.MAX)
    work = recorded.reduce_scatter_tensor(chunk, grad, "zero2 bucket 0", group=group, async_op=True)
    work.wait()
"""

from __future__ import annotations

import torch.distributed as dist

from app.diagnostics.recorder import RECORDER

start, end = RECORDER.start, RECORDER.end  # for a call site that issues the collective itself (a comm hook)


class RecordedWork:
    """A collective's ``Work`` and its flight recorder entry: ``wait()`` waits, then marks the entry done."""

    __slots__ = ("work", "entry")

    def __init__(self, work, entry):
        self.work, self.entry = work, entry

    def wait(self):
        result = self.work.wait()
        RECORDER.end(self.entry)
        return result

    def get_future(self):
        return self.work.get_future()

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _finish(work, entry, async_op: bool):
    if async_op:
        return RecordedWork(work, entry)
    RECORDER.end(entry)
    return work


def all_reduce(tensor, source: str, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    entry = RECORDER.start("all_reduce", group, tensor, source)
    return _finish(dist.all_reduce(tensor, op=op, group=group, async_op=async_op), entry, async_op)


def broadcast(tensor, source: str, src: int, group=None, async_op: bool = False):
    entry = RECORDER.start("broadcast", group, tensor, source)
    return _finish(dist.broadcast(tensor, src=src, group=group, async_op=async_op), entry, async_op)


def all_gather_into_tensor(output, input, source: str, group=None, async_op: bool = False):
    """Recorded by its input (the shard every rank sends): the same size on every rank."""
    entry = RECORDER.start("all_gather", group, input, source)
    return _finish(dist.all_gather_into_tensor(output, input, group=group, async_op=async_op), entry, async_op)


def reduce_scatter_tensor(output, input, source: str, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """Recorded by its input (the whole flat gradient each rank contributes)."""
    entry = RECORDER.start("reduce_scatter", group, input, source)
    work = dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
    return _finish(work, entry, async_op)
