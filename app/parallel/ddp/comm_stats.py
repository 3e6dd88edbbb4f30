"""What our DistributedDataParallel did on the wire, and the clock it was timed with.

Third and last file of the wrapper (read ``module.py``, then ``reducer.py``, then this): the reducer stamps each
bucket's launch and completion with a ``Clock`` and hands one backward's timestamps to ``CommStats``, which the
trainer's probe (``app/parallel/probes.py``) turns into Prometheus metrics. Nothing here talks to other ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class Clock:
    """Timestamps for one synchronised backward: ``perf_counter`` on CPU, CUDA events on a GPU.

    On CUDA a collective's future completes when the collective is *enqueued*, and ``fut.wait()`` only makes the
    current stream wait; host clocks would time the launch, not the communication. CUDA events recorded on the
    streams that the collective's completion is synchronised with time the real thing; they are read (a host sync
    per event, already complete by then) only when the stats are read, after the step's own synchronisation.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: in a future's callback, one synchronised with the collective
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class BackwardTimes:
    """The timestamps of one synchronised backward: each bucket's launch and completion, and the waits at its end."""

    def __init__(self, clock: Clock, n_buckets: int):
        self.clock = clock
        self.launches: list = [None] * n_buckets
        self.dones: list = [None] * n_buckets  # set from the collective's completion callback
        self.waits: list[tuple] = []  # (before, after) each wait at the end of backward

    def seconds(self) -> tuple[list[float], float, float]:
        """(launch -> done per bucket, total wait, first launch -> last completion), in seconds."""
        clock = self.clock
        per_bucket = [clock.seconds(start, end) for start, end in zip(self.launches, self.dones)]
        waited = sum(clock.seconds(start, end) for start, end in self.waits)
        span = max((clock.seconds(self.launches[0], end) for end in self.dones), default=0.0)  # bucket 0 first
        return per_bucket, waited, span


class CommStats:
    """What the wrapper did on the wire; the trainer turns these into Prometheus metrics.

    Counters are cumulative since construction; ``last_*`` fields describe the most recent synchronised backward.
    On CUDA the times are computed from CUDA events the first time a time field is read (after the step has
    synchronised, reading costs nothing; before, it waits for the step's communication).
    """

    def __init__(self):
        self.sync_calls = 0  # backward passes that synchronised gradients (no_sync() passes are not counted)
        self.buckets_reduced = 0  # buckets handed to the comm hook
        self.bytes_reduced = 0  # bytes of bucket buffers handed to the comm hook (before any compression)
        self.last_bucket_bytes: list[int] = []
        self._allreduce_seconds = 0.0  # sum over buckets of launch -> result ready
        self._wait_seconds = 0.0  # time the end of backward blocked on communication ("exposed" comm)
        self._last_bucket_seconds: list[float] = []  # per bucket, in launch order
        self._last_wait_seconds = 0.0
        # First bucket's launch -> last bucket's completion: the wall time the reduction took. Buckets overlap and
        # queue behind each other, so the sum of last_bucket_seconds double-counts; bandwidth uses this span.
        self._last_comm_span_seconds = 0.0
        self._pending: Callable[[], tuple[list[float], float, float]] | None = None

    def record(self, bucket_bytes: list[int], times: BackwardTimes) -> None:
        """One synchronised backward: its buckets' sizes (full precision) and its timestamps.

        On CUDA the times are computed later (``resolve``): reading an event before the step synchronised would
        block on its communication. Host clocks are final at once.
        """
        self.resolve()  # the previous step's times, if nobody read them
        self.sync_calls += 1
        self.buckets_reduced += len(bucket_bytes)
        self.bytes_reduced += sum(bucket_bytes)
        self.last_bucket_bytes = bucket_bytes
        self._pending = times.seconds
        if not times.clock.cuda:
            self.resolve()

    def resolve(self) -> None:
        """Turn the last backward's timestamps into seconds."""
        if self._pending is None:
            return
        bucket_seconds, wait, span = self._pending()
        self._pending = None
        self._allreduce_seconds += sum(bucket_seconds)
        self._wait_seconds += wait
        self._last_bucket_seconds, self._last_wait_seconds, self._last_comm_span_seconds = bucket_seconds, wait, span

    def __getstate__(self):  # CUDA events do not pickle: resolve them first
        self.resolve()
        return self.__dict__

    def _resolved(name: str):  # noqa: N805 (a property factory used in the class body, not a method)
        return property(lambda self: (self.resolve(), getattr(self, name))[1])

    allreduce_seconds = _resolved("_allreduce_seconds")
    wait_seconds = _resolved("_wait_seconds")
    last_bucket_seconds = _resolved("_last_bucket_seconds")
    last_wait_seconds = _resolved("_last_wait_seconds")
    last_comm_span_seconds = _resolved("_last_comm_span_seconds")
    del _resolved
