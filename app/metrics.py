"""Prometheus metrics of one training process, and the probes that measure its communication.

Each process serves ``/metrics`` on ``0.0.0.0:<metrics_port + LOCAL_RANK>`` (several ranks share a host under
torchrun, so each gets its own port). Every ``ddp_*`` series carries exactly one label, ``rank`` (global rank),
except ``ddp_rank_info``, which maps a rank to its local rank, node (torchrun's GROUP_RANK) and host, so a
dashboard can answer "which rank is slow, and where does it run?".

Where the communication numbers come from:

- ``--ddp scratch`` (ours): ``app.ddp.DistributedDataParallel.stats`` times each bucket from launch to the
  completion callback, and the wait at the end of backward ("exposed" communication, i.e. not hidden behind
  backward compute).
- ``--ddp torch``: a comm hook wrapping PyTorch's own ``allreduce_hook`` times each bucket's future the same way.
  The wait at the end of backward happens inside PyTorch's C++ reducer, out of reach: exposed communication is
  not reported (the histogram stays empty).
- ``--ddp none``: no communication, no comm observations.

Bus bandwidth follows nccl-tests: ``algbw = bytes / seconds``, ``busbw = algbw × 2(n−1)/n``, the per-link traffic
of a ring all-reduce, comparable across world sizes. The seconds are the wall time from the first bucket's launch to
the last bucket's completion in the step, not the sum of the buckets' own times: buckets overlap and queue behind
each other, so summing would count the same seconds more than once. Check the exposition with
``curl -s localhost:9400/metrics | promtool check metrics``.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import torch
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               disable_created_metrics, start_http_server)

# Seconds. Steps of these models take ~1 ms (MiniMLP) to ~1 s (TinyTransformer on a busy CPU); a GPU step of a
# real model is 10 ms to seconds. All-reduces of one bucket: ~50 µs on loopback up to seconds over a slow network.
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COMM_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                2.5, 10.0)
CHECKPOINT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# ----------------------------------------------------------------------------------------------------------------
# Communication probes: one step's all-reduce numbers, whichever wrapper did them
# ----------------------------------------------------------------------------------------------------------------
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
        # Only an older app.ddp without the span falls back to the sum (and under-reports the bandwidth).
        seconds = self.span_seconds if self.span_seconds > 0 else self.seconds
        if seconds <= 0 or world_size < 2:
            return 0.0
        return self.nbytes / seconds * 2 * (world_size - 1) / world_size


class ScratchCommProbe:
    """Reads ``app.ddp.DistributedDataParallel.stats`` after each step."""

    def __init__(self, ddp_model):
        self.stats = ddp_model.stats
        self._seen = self.stats.sync_calls

    def take(self) -> CommSample:
        s = self.stats
        if s.sync_calls == self._seen:
            return CommSample()  # no synchronised backward since the last take
        self._seen = s.sync_calls
        # One synchronised backward per optimizer step (accumulation syncs only the last micro-batch), so the
        # last_* fields describe this step completely.
        return CommSample(list(s.last_bucket_seconds), list(s.last_bucket_bytes), s.last_wait_seconds,
                          getattr(s, "last_comm_span_seconds", 0.0))


class TorchCommProbe:
    """Registers a comm hook on ``torch.nn.parallel.DistributedDataParallel`` that times PyTorch's allreduce_hook."""

    def __init__(self, ddp_model, process_group=None):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._seconds: list[float] = []
        self._bytes: list[int] = []
        self._first_launch = self._last_done = None

        def timed_allreduce(state, bucket):
            nbytes = bucket.buffer().numel() * bucket.buffer().element_size()
            launched = time.perf_counter()
            if self._first_launch is None:
                self._first_launch = launched
            fut = allreduce_hook(state, bucket)

            def record(f):
                # Runs when the reduction completes (on the comm thread): launch -> done, as for ours.
                done = time.perf_counter()
                self._seconds.append(done - launched)
                self._bytes.append(nbytes)
                self._last_done = done if self._last_done is None else max(self._last_done, done)
                return f.value()

            return fut.then(record)

        ddp_model.register_comm_hook(process_group, timed_allreduce)

    def take(self) -> CommSample:
        # One synchronised backward per step (see ScratchCommProbe), so the span is that backward's.
        span = self._last_done - self._first_launch if self._seconds else 0.0
        sample = CommSample(self._seconds, self._bytes, None, span)
        self._seconds, self._bytes = [], []
        self._first_launch = self._last_done = None
        return sample


class NoCommProbe:
    def take(self) -> CommSample:
        return CommSample()


# ----------------------------------------------------------------------------------------------------------------
# The Prometheus side
# ----------------------------------------------------------------------------------------------------------------
class TrainMetrics:
    """All ``ddp_*`` metrics of this process, in their own registry (plus the standard ``process_*`` ones)."""

    def __init__(self, rank: int, local_rank: int, world_size: int, node: str, host: str | None = None):
        disable_created_metrics()  # no "_created" series: they double the series count and no dashboard reads them
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # CPU seconds and memory per rank: "which rank is starved?"
        r = self.registry
        label = ["rank"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, label, registry=r, buckets=buckets).labels(rank=str(rank))

        def gauge(name, doc):
            return Gauge(name, doc, label, registry=r).labels(rank=str(rank))

        def counter(name, doc):
            # prometheus-client appends "_total" to a counter's name in the exposition.
            return Counter(name.removesuffix("_total"), doc, label, registry=r).labels(rank=str(rank))

        self.step = hist("ddp_step_duration_seconds", "Wall time of one optimizer step (all micro-batches)",
                         STEP_BUCKETS)
        self.forward = hist("ddp_forward_duration_seconds", "Forward time per optimizer step", STEP_BUCKETS)
        self.backward = hist("ddp_backward_duration_seconds",
                             "Backward time per optimizer step, overlapped communication included", STEP_BUCKETS)
        self.optimizer = hist("ddp_optimizer_duration_seconds", "optimizer.step() time", STEP_BUCKETS)
        self.allreduce = hist("ddp_allreduce_duration_seconds",
                              "One gradient bucket's all-reduce, launch to completion", COMM_BUCKETS)
        self.exposed = hist("ddp_exposed_comm_duration_seconds",
                            "Per step, seconds the end of backward waited on communication", COMM_BUCKETS)
        self.allreduce_bytes = counter("ddp_allreduce_bytes_total", "Bytes of gradient buckets all-reduced")
        self.busbw = gauge("ddp_allreduce_bus_bandwidth_bytes_per_second",
                           "Last step's all-reduce bus bandwidth: algbw * 2(n-1)/n (nccl-tests' busbw), "
                           "algbw = bytes / (first bucket's launch to last bucket's completion)")
        self.samples = counter("ddp_samples_total", "Samples processed by this rank")
        self.optimizer_steps = counter("ddp_optimizer_steps_total", "Optimizer steps taken")
        self.syncs = counter("ddp_gradient_syncs_total", "Backward passes that synchronised gradients")
        self.loss = gauge("ddp_loss", "Last step's mean loss on this rank")
        self.lr = gauge("ddp_learning_rate", "Learning rate of the last step")
        self.world = gauge("ddp_world_size", "Processes in the training job")
        self.heartbeat = gauge("ddp_last_step_timestamp_seconds", "Unix time of the last finished step")
        self.checkpoint = hist("ddp_checkpoint_duration_seconds", "Time to write one checkpoint (rank 0)",
                               CHECKPOINT_BUCKETS)
        self.last_checkpoint = gauge("ddp_last_checkpoint_step", "Optimizer step of the last checkpoint")
        # The global step (checkpointed steps included) next to its target: once every worker is gone, their last
        # values tell a crashed job (step < target) from a finished one, which ddp_optimizer_steps_total cannot.
        self.global_step = gauge("ddp_step", "Global optimizer step reached, steps restored from a checkpoint included")
        self.target_steps = gauge("ddp_target_steps", "Configured number of optimizer steps (the steps field)")
        Gauge("ddp_rank_info", "Where this rank runs (value always 1)", ["rank", "local_rank", "node", "host"],
              registry=r).labels(rank=str(rank), local_rank=str(local_rank), node=str(node),
                                 host=host or socket.gethostname()).set(1)
        self.world.set(world_size)
        self.world_size = world_size
        self._server = None

    def serve(self, port: int) -> None:
        self._server, _ = start_http_server(port, addr="0.0.0.0", registry=self.registry)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def observe_step(self, *, step_seconds: float, forward_seconds: float, backward_seconds: float,
                     optimizer_seconds: float, comm: CommSample, samples: int, syncs: int, loss: float,
                     lr: float) -> None:
        self.step.observe(step_seconds)
        self.forward.observe(forward_seconds)
        self.backward.observe(backward_seconds)
        self.optimizer.observe(optimizer_seconds)
        for seconds in comm.bucket_seconds:
            self.allreduce.observe(seconds)
        if comm.bucket_bytes:
            self.allreduce_bytes.inc(comm.nbytes)
            self.busbw.set(comm.bus_bandwidth(self.world_size))
        if comm.wait_seconds is not None:
            self.exposed.observe(comm.wait_seconds)
        self.samples.inc(samples)
        self.optimizer_steps.inc()
        if syncs:
            self.syncs.inc(syncs)
        self.loss.set(loss)
        self.lr.set(lr)
        self.heartbeat.set(time.time())

    def observe_progress(self, step: int, target: int) -> None:
        self.global_step.set(step)
        self.target_steps.set(target)

    def observe_checkpoint(self, step: int, seconds: float | None) -> None:
        if seconds is not None:
            self.checkpoint.observe(seconds)
        self.last_checkpoint.set(step)


class NoMetrics:
    """Stands in for TrainMetrics when metrics_port is 0: the training loop does not branch on it."""

    def serve(self, port: int) -> None: ...
    def shutdown(self) -> None: ...
    def observe_step(self, **_) -> None: ...
    def observe_progress(self, step: int, target: int) -> None: ...
    def observe_checkpoint(self, step: int, seconds: float | None) -> None: ...


def synchronize_for(device: torch.device):
    """What to call before reading a clock, so GPU times are real (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
