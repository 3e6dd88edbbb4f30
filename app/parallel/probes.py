"""Communication probes: one step's all-reduce numbers, whichever DDP wrapper did them.

``comm_probe(wrapped)`` picks the probe for what ``wrap_model`` returned; the trainer calls ``probe.take()`` once per
optimizer step and hands the ``CommSample`` to the metrics.

- ours (``app.parallel.ddp.DistributedDataParallel``): its ``stats`` time each bucket from launch to the completion
  callback, and the wait at the end of backward ("exposed" communication, i.e. not hidden behind backward compute).
- torch (``torch.nn.parallel.DistributedDataParallel``): a comm hook wrapping PyTorch's own ``allreduce_hook`` times
  each bucket's future the same way. The wait at the end of backward happens inside PyTorch's C++ reducer, out of
  reach: exposed communication is not reported (``wait_seconds`` is None).

On CUDA both time with CUDA events, not host clocks: a NCCL collective's future completes when the collective is
enqueued, so host clocks would report the launch. The events are read in ``take()``, after the step has synchronised.
- no wrapper (one process): no communication, an empty sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from app.parallel.ddp import DistributedDataParallel
from app.parallel.ddp.comm_stats import Clock


@dataclass
class CommSample:
    bucket_seconds: list[float] = field(default_factory=list)  # launch -> done, per bucket
    bucket_bytes: list[int] = field(default_factory=list)
    wait_seconds: float | None = None  # exposed communication; None when the wrapper cannot tell
    span_seconds: float = 0.0  # first bucket's launch -> last bucket's completion; 0 when unknown

    @property
    def seconds(self) -> float:
        return sum(self.bucket_seconds)

    @property
    def nbytes(self) -> int:
        return sum(self.bucket_bytes)

    def bus_bandwidth(self, world_size: int) -> float:
        # The span, not the sum: overlapping buckets' times add up to more than the wall time the bytes took.
        seconds = self.span_seconds if self.span_seconds > 0 else self.seconds
        if seconds <= 0 or world_size < 2:
            return 0.0
        return self.nbytes / seconds * 2 * (world_size - 1) / world_size


class OursCommProbe:
    """Reads ``app.parallel.ddp.DistributedDataParallel.stats`` after each step."""

    def __init__(self, ddp_model: DistributedDataParallel):
        self.stats = ddp_model.stats
        self._seen = self.stats.sync_calls

    def take(self) -> CommSample:
        s = self.stats
        if s.sync_calls == self._seen:
            return CommSample()  # no synchronised backward since the last take
        self._seen = s.sync_calls
        # One synchronised backward per optimizer step (accumulation syncs only the last micro-batch), so the
        # last_* fields describe this step completely.
        return CommSample(
            list(s.last_bucket_seconds), list(s.last_bucket_bytes), s.last_wait_seconds, s.last_comm_span_seconds
        )


class TorchCommProbe:
    """Registers a comm hook on ``torch.nn.parallel.DistributedDataParallel`` that times PyTorch's allreduce_hook."""

    def __init__(self, ddp_model, process_group=None):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._clock = Clock(next(ddp_model.parameters()).device)
        self._marks: list[tuple] = []  # per bucket: (launch, done) timestamps (floats, or CUDA events)
        self._bytes: list[int] = []
        self._first_launch = None

        def timed_allreduce(state, bucket):
            nbytes = bucket.buffer().numel() * bucket.buffer().element_size()
            launched = self._clock.now()
            if self._first_launch is None:
                self._first_launch = launched
            fut = allreduce_hook(state, bucket)

            def record(f):
                # Runs when the reduction completes (gloo: on its thread; CUDA: on a stream synchronised with the
                # collective): launch -> done, as for ours.
                self._marks.append((launched, self._clock.now()))
                self._bytes.append(nbytes)
                return f.value()

            return fut.then(record)

        ddp_model.register_comm_hook(process_group, timed_allreduce)

    def take(self) -> CommSample:
        # One synchronised backward per step (see OursCommProbe), so the span is that backward's.
        clock, marks = self._clock, self._marks
        seconds = [clock.seconds(start, end) for start, end in marks]
        span = max((clock.seconds(self._first_launch, end) for _, end in marks), default=0.0)
        sample = CommSample(seconds, self._bytes, None, span)
        self._marks, self._bytes, self._first_launch = [], [], None
        return sample


class NoCommProbe:
    def take(self) -> CommSample:
        return CommSample()


def comm_probe(wrapped: torch.nn.Module):
    """The probe that fits what ``app.parallel.wrap_model`` returned.

    Args:
        wrapped: our ``DistributedDataParallel``, PyTorch's, or a bare module (no communication).

    Example::

        probe = comm_probe(model)
        loss.backward()
        sample = probe.take()  # this step's buckets: seconds, bytes, exposed wait
    """
    if isinstance(wrapped, DistributedDataParallel):
        return OursCommProbe(wrapped)
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        return TorchCommProbe(wrapped)
    return NoCommProbe()
