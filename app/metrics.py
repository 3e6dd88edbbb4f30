"""Prometheus metrics of one training process, and the probes that measure its communication.

Each process serves ``/metrics`` on ``0.0.0.0:<metrics_port + LOCAL_RANK>`` (several ranks share a host under
torchrun, so each gets its own port). Every ``ddp_*`` series carries exactly one label, ``rank`` (global rank),
except ``ddp_rank_info``, which maps a rank to its local rank, node (torchrun's GROUP_RANK) and host, so a
dashboard can answer "which rank is slow, and where does it run?".

The communication numbers come from ``app.parallel.probes`` (one ``CommSample`` per step).

Bus bandwidth follows nccl-tests: ``algbw = bytes / seconds``, ``busbw = algbw × 2(n−1)/n``, the per-link traffic
of a ring all-reduce, comparable across world sizes. The seconds are the wall time from the first bucket's launch to
the last bucket's completion in the step, not the sum of the buckets' own times: buckets overlap and queue behind
each other, so summing would count the same seconds more than once. Check the exposition with
``curl -s localhost:9400/metrics | promtool check metrics``.
"""

from __future__ import annotations

import socket
import time

import torch
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

from app.parallel.probes import CommSample

# Seconds. Steps of these models take ~1 ms (MiniMLP) to ~1 s (TinyTransformer on a busy CPU); a GPU step of a
# real model is 10 ms to seconds. All-reduces of one bucket: ~50 µs on loopback up to seconds over a slow network.
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COMM_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
CHECKPOINT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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

        self.step = hist(
            "ddp_step_duration_seconds", "Wall time of one optimizer step (all micro-batches)", STEP_BUCKETS
        )
        self.forward = hist("ddp_forward_duration_seconds", "Forward time per optimizer step", STEP_BUCKETS)
        self.backward = hist(
            "ddp_backward_duration_seconds",
            "Backward time per optimizer step, overlapped communication included",
            STEP_BUCKETS,
        )
        self.optimizer = hist("ddp_optimizer_duration_seconds", "optimizer.step() time", STEP_BUCKETS)
        self.allreduce = hist(
            "ddp_allreduce_duration_seconds", "One gradient bucket's all-reduce, launch to completion", COMM_BUCKETS
        )
        self.exposed = hist(
            "ddp_exposed_comm_duration_seconds",
            "Per step, seconds the end of backward waited on communication",
            COMM_BUCKETS,
        )
        self.allreduce_bytes = counter("ddp_allreduce_bytes_total", "Bytes of gradient buckets all-reduced")
        self.busbw = gauge(
            "ddp_allreduce_bus_bandwidth_bytes_per_second",
            "Last step's all-reduce bus bandwidth: algbw * 2(n-1)/n (nccl-tests' busbw), "
            "algbw = bytes / (first bucket's launch to last bucket's completion)",
        )
        self.samples = counter("ddp_samples_total", "Samples processed by this rank")
        self.optimizer_steps = counter("ddp_optimizer_steps_total", "Optimizer steps taken")
        self.syncs = counter("ddp_gradient_syncs_total", "Backward passes that synchronised gradients")
        self.loss = gauge("ddp_loss", "Last step's mean loss on this rank")
        self.lr = gauge("ddp_learning_rate", "Learning rate of the last step")
        self.world = gauge("ddp_world_size", "Processes in the training job")
        self.heartbeat = gauge("ddp_last_step_timestamp_seconds", "Unix time of the last finished step")
        self.checkpoint = hist(
            "ddp_checkpoint_duration_seconds", "Time to write one checkpoint (rank 0)", CHECKPOINT_BUCKETS
        )
        self.last_checkpoint = gauge("ddp_last_checkpoint_step", "Optimizer step of the last checkpoint")
        # The global step (checkpointed steps included) next to its target: once every worker is gone, their last
        # values tell a crashed job (step < target) from a finished one, which ddp_optimizer_steps_total cannot.
        self.global_step = gauge("ddp_step", "Global optimizer step reached, steps restored from a checkpoint included")
        self.target_steps = gauge("ddp_target_steps", "Configured number of optimizer steps (the steps field)")
        Gauge(
            "ddp_rank_info", "Where this rank runs (value always 1)", ["rank", "local_rank", "node", "host"], registry=r
        ).labels(rank=str(rank), local_rank=str(local_rank), node=str(node), host=host or socket.gethostname()).set(1)
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

    def observe_step(
        self,
        *,
        step_seconds: float,
        forward_seconds: float,
        backward_seconds: float,
        optimizer_seconds: float,
        comm: CommSample,
        samples: int,
        syncs: int,
        loss: float,
        lr: float,
    ) -> None:
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
