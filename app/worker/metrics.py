"""Prometheus metrics of one training process, and the probes that measure its communication.

Each process serves ``/metrics`` on ``0.0.0.0:<metrics_port + LOCAL_RANK>`` (several ranks share a host under
torchrun, so each gets its own port). Every ``ddp_*`` series carries exactly one label, ``rank`` (global rank),
except ``ddp_rank_info``, which maps a rank to its local rank, node (torchrun's GROUP_RANK) and host, so a
dashboard can answer "which rank is slow, and where does it run?".

Elastic series (every rank of every world): ``ddp_world_size``, the range ``ddp_min_world_size`` /
``ddp_max_world_size``, ``ddp_elastic_restarts``, ``ddp_world_generation`` (worlds formed so far, carried in the
checkpoints), ``ddp_reformation_seconds`` (newest checkpoint's wall time → this world's first finished step) and
``ddp_steps_redone_total``, and ``ddp_stop_requested`` (1 on a rank told to stop: its departure is planned).
Pipeline series (``ddp_pipeline_*``) appear only once a pipeline stage reports
(``observe_pipeline``), so a data-parallel run exposes none of them. ZeRO series (``ddp_zero_*``) likewise appear
only for ``parallel=zero1|zero2|zero3`` (``enable_zero``): per step, seconds and bytes of the reduce-scatters and
all-gathers (stages 2-3; stage 1's all-reduce is ``ddp_allreduce_*``), and what this rank holds after the step:
parameter, gradient and optimizer-state bytes.

Throughput, MFU, memory and collective progress (``app.worker.throughput_metrics``, every rank):
``ddp_samples_per_second``, ``ddp_tokens_per_second``, ``ddp_model_flops_per_second``, ``ddp_peak_flops_per_second``,
``ddp_mfu_ratio``, ``ddp_memory_rss_bytes``, ``ddp_memory_peak_rss_bytes``, ``ddp_last_collective_sequence``, and
``ddp_cuda_memory_allocated_bytes`` and ``ddp_cuda_memory_reserved_bytes`` (0 without a GPU).

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
from app.worker.throughput_metrics import ThroughputSeries

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
        self._rank = str(rank)
        self._timing_series()
        self._progress_series()
        where = ["rank", "local_rank", "node", "host"]
        Gauge("ddp_rank_info", "Where this rank runs (value always 1)", where, registry=self.registry).labels(
            rank=str(rank), local_rank=str(local_rank), node=str(node), host=host or socket.gethostname()
        ).set(1)
        self._elastic_series()
        cuda = torch.device("cuda", local_rank) if torch.cuda.is_available() else None
        # samples/s, MFU, memory, the last collective (their module)
        self.throughput = ThroughputSeries(self.registry, self._rank, cuda)
        self.world.set(world_size)
        self.min_world.set(world_size)
        self.max_world.set(world_size)
        self.generation.set(1)
        self.world_size = world_size
        self._pipeline: dict | None = None
        self._validation: Gauge | None = None  # (observe_validation)
        self._zero: dict | None = None
        self._server = None

    def _hist(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(name, doc, ["rank"], registry=self.registry, buckets=buckets).labels(rank=self._rank)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["rank"], registry=self.registry).labels(rank=self._rank)

    def _counter(self, name: str, doc: str) -> Counter:
        # prometheus-client appends "_total" to a counter's name in the exposition.
        return Counter(name.removesuffix("_total"), doc, ["rank"], registry=self.registry).labels(rank=self._rank)

    def _timing_series(self) -> None:
        """Where a step's time goes: forward, backward, optimizer, each bucket's all-reduce, exposed communication."""
        self.step = self._hist(
            "ddp_step_duration_seconds", "Wall time of one optimizer step (all micro-batches)", STEP_BUCKETS
        )
        self.forward = self._hist("ddp_forward_duration_seconds", "Forward time per optimizer step", STEP_BUCKETS)
        self.backward = self._hist(
            "ddp_backward_duration_seconds",
            "Backward time per optimizer step, overlapped communication included",
            STEP_BUCKETS,
        )
        self.optimizer = self._hist("ddp_optimizer_duration_seconds", "optimizer.step() time", STEP_BUCKETS)
        self.allreduce = self._hist(
            "ddp_allreduce_duration_seconds", "One gradient bucket's all-reduce, launch to completion", COMM_BUCKETS
        )
        self.exposed = self._hist(
            "ddp_exposed_comm_duration_seconds",
            "Per step, seconds the end of backward waited on communication",
            COMM_BUCKETS,
        )
        self.allreduce_bytes = self._counter("ddp_allreduce_bytes_total", "Bytes of gradient buckets all-reduced")
        self.busbw = self._gauge(
            "ddp_allreduce_bus_bandwidth_bytes_per_second",
            "Last step's all-reduce bus bandwidth: algbw * 2(n-1)/n (nccl-tests' busbw), "
            "algbw = bytes / (first bucket's launch to last bucket's completion)",
        )

    def _progress_series(self) -> None:
        """How far the run is: samples, steps, loss, learning rate, heartbeat, checkpoints."""
        self.samples = self._counter("ddp_samples_total", "Samples processed by this rank")
        self.optimizer_steps = self._counter("ddp_optimizer_steps_total", "Optimizer steps taken")
        self.syncs = self._counter("ddp_gradient_syncs_total", "Backward passes that synchronised gradients")
        self.loss = self._gauge("ddp_loss", "Last step's mean loss on this rank")
        self.lr = self._gauge("ddp_learning_rate", "Learning rate of the last step")
        self.world = self._gauge("ddp_world_size", "Processes in the training job")
        self.heartbeat = self._gauge("ddp_last_step_timestamp_seconds", "Unix time of the last finished step")
        self.checkpoint = self._hist(
            "ddp_checkpoint_duration_seconds", "Time to write one checkpoint (rank 0)", CHECKPOINT_BUCKETS
        )
        self.last_checkpoint = self._gauge("ddp_last_checkpoint_step", "Optimizer step of the last checkpoint")
        # The global step (checkpointed steps included) next to its target: once every worker is gone, their last
        # values tell a crashed job (step < target) from a finished one, which ddp_optimizer_steps_total cannot.
        self.global_step = self._gauge(
            "ddp_step", "Global optimizer step reached, steps restored from a checkpoint included"
        )
        self.target_steps = self._gauge("ddp_target_steps", "Configured number of optimizer steps (the steps field)")

    def _elastic_series(self) -> None:
        """The elastic picture: gauges a dashboard can annotate when they change."""
        self.min_world = self._gauge(
            "ddp_min_world_size", "Smallest world the job may shrink to (torchrun --nnodes MIN)"
        )
        self.max_world = self._gauge("ddp_max_world_size", "Largest world the job may grow to (torchrun --nnodes MAX)")
        self.restarts = self._gauge(
            "ddp_elastic_restarts", "Restarts of this rank's agent (TORCHELASTIC_RESTART_COUNT)"
        )
        self.generation = self._gauge("ddp_world_generation", "Worlds this job has formed, this one included")
        self.reformation = self._gauge(
            "ddp_reformation_seconds",
            "Time lost in the last re-formation: newest checkpoint written -> this world's first step (0 if fresh)",
        )
        self.redone = self._counter("ddp_steps_redone_total", "Steps trained again after a resume")
        # Set on the rank that was itself told to stop (SIGTERM: `docker compose stop`, a scale-down, a pod deleted)
        # and kept up a few seconds for a scrape: its container then leaves on purpose, and DDPRankDown stays quiet.
        self.stop_requested = self._gauge(
            "ddp_stop_requested", "1 once this rank was told to stop: a planned departure"
        )

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

    def observe_throughput(self, **step) -> None:
        """One step's rates (``ThroughputSeries.observe``): samples, tokens_per_sample, seconds, flops, device."""
        self.throughput.observe(**step)

    def observe_progress(self, step: int, target: int) -> None:
        self.global_step.set(step)
        self.target_steps.set(target)

    def observe_stop_requested(self) -> None:
        self.stop_requested.set(1)

    def observe_checkpoint(self, step: int, seconds: float | None) -> None:
        if seconds is not None:
            self.checkpoint.observe(seconds)
        self.last_checkpoint.set(step)

    def observe_world(
        self, *, world_size: int, min_world_size: int, max_world_size: int, restart_count: int, generation: int
    ) -> None:
        """The world this rank joined: its size, the elastic range, the agent's restarts, the job's generation.

        Example::

            metrics.observe_world(world_size=3, min_world_size=2, max_world_size=4, restart_count=1, generation=2)
        """
        self.world_size = world_size
        self.world.set(world_size)
        self.min_world.set(min_world_size)
        self.max_world.set(max_world_size)
        self.restarts.set(restart_count)
        self.generation.set(generation)

    def observe_healed_world(self, world_size: int) -> None:
        """A heal in place (``heal=in_place``) formed a world of ``world_size`` without restarting this process:
        ``ddp_world_size`` follows it, as DDPWorldShrank and DDPRankDown read it. The series keep the ``rank`` label
        this process started with: on a dashboard a process stays one line across heals."""
        self.world_size = world_size
        self.world.set(world_size)

    def observe_resume(self, *, steps_redone: int) -> None:
        """Steps this world will train again: the lost world's last step minus the checkpoint's."""
        if steps_redone > 0:
            self.redone.inc(steps_redone)

    def observe_reformation(self, seconds: float) -> None:
        """Seconds from the newest checkpoint's write to this world's first finished step."""
        self.reformation.set(max(seconds, 0.0))

    def observe_validation(self, loss: float) -> None:
        """The mean loss over the held-out split (app.worker.evaluation); the series appears at the first one, so a
        run without ``eval_every`` exposes none."""
        if self._validation is None:
            self._validation = self._gauge("ddp_validation_loss", "Mean loss over the held-out validation split")
        self._validation.set(loss)

    def observe_pipeline(
        self,
        *,
        stage: int,
        compute_seconds: float,
        send_recv_seconds: float,
        bubble_ratio: float,
        activation_bytes: int,
    ) -> None:
        """One pipeline step of this rank's stage: compute time, time blocked in send/recv, idle share, bytes sent.

        Example::

            metrics.observe_pipeline(stage=1, compute_seconds=0.012, send_recv_seconds=0.003, bubble_ratio=0.25,
                                     activation_bytes=65536)
        """
        p = self._pipeline or self.enable_pipeline()
        p["stage"].set(stage)
        p["compute"].observe(compute_seconds)
        p["send_recv"].observe(send_recv_seconds)
        p["bubble"].set(bubble_ratio)
        if activation_bytes:
            p["bytes"].inc(activation_bytes)

    def enable_pipeline(self) -> dict:
        """Register the ``ddp_pipeline_*`` series (``observe_pipeline`` does it on its first call); idempotent."""
        if self._pipeline:
            return self._pipeline
        r, label, rank = self.registry, ["rank"], self._rank
        self._pipeline = {
            "stage": Gauge("ddp_pipeline_stage", "Pipeline stage index of this rank", label, registry=r),
            "compute": Histogram(
                "ddp_pipeline_compute_seconds",
                "Per step: this stage's forward+backward compute time",
                label,
                registry=r,
                buckets=STEP_BUCKETS,
            ),
            "send_recv": Histogram(
                "ddp_pipeline_send_recv_seconds",
                "Per step: time blocked in send/recv of activations and gradients",
                label,
                registry=r,
                buckets=COMM_BUCKETS,
            ),
            "bubble": Gauge(
                "ddp_pipeline_bubble_ratio", "Last step's idle share of this stage (0..1)", label, registry=r
            ),
            "bytes": Counter(
                "ddp_pipeline_activation_bytes",
                "Bytes of activations and gradients sent to other stages",
                label,
                registry=r,
            ),
        }
        self._pipeline = {name: metric.labels(rank=rank) for name, metric in self._pipeline.items()}
        return self._pipeline

    def enable_zero(self, stage: int) -> dict:
        """Register the ``ddp_zero_*`` series (a ZeRO step kind does it when built); idempotent."""
        if self._zero:
            return self._zero
        r, label = self.registry, ["rank"]

        def hist(name, doc):
            return Histogram(name, doc, label, registry=r, buckets=COMM_BUCKETS)

        def counter(name, doc):
            return Counter(name.removesuffix("_total"), doc, label, registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, label, registry=r)

        zero = {
            "stage": gauge("ddp_zero_stage", "ZeRO stage of this run: 1, 2 or 3 (parallel=zero1|zero2|zero3)"),
            "reduce_scatter_seconds": hist(
                "ddp_zero_reduce_scatter_seconds",
                "Per step: seconds backward's end waited on the gradient reduce-scatters (they run during backward)",
            ),
            "all_gather_seconds": hist(
                "ddp_zero_all_gather_seconds",
                "Per step: seconds in parameter all-gathers (stage 2: after the optimizer step; 3: per unit use)",
            ),
            "reduce_scatter_bytes": counter(
                "ddp_zero_reduce_scatter_bytes_total", "Bytes of flat gradients handed to reduce-scatter"
            ),
            "all_gather_bytes": counter("ddp_zero_all_gather_bytes_total", "Bytes of parameters all-gathered"),
            "parameter_bytes": gauge("ddp_zero_parameter_bytes", "Parameter bytes this rank keeps between steps"),
            "gradient_bytes": gauge("ddp_zero_gradient_bytes", "Gradient bytes this rank holds after a step"),
            "optimizer_state_bytes": gauge(
                "ddp_zero_optimizer_state_bytes", "Optimizer state bytes (AdamW's moments) this rank holds"
            ),
        }
        self._zero = {name: metric.labels(rank=self._rank) for name, metric in zero.items()}
        self._zero["stage"].set(stage)
        return self._zero

    def observe_zero(
        self,
        *,
        collectives: dict[str, tuple[int, float]],
        parameter_bytes: int,
        gradient_bytes: int,
        optimizer_state_bytes: int,
    ) -> None:
        """One ZeRO step: ``collectives`` is ``{"reduce_scatter"|"all_gather": (bytes, seconds)}`` of this step
        (empty for stage 1), and the bytes this rank holds after it.

        Example::

            metrics.observe_zero(collectives={"reduce_scatter": (4096, 0.001), "all_gather": (4096, 0.002)},
                                 parameter_bytes=4096, gradient_bytes=1024, optimizer_state_bytes=2048)
        """
        z = self._zero or self.enable_zero(0)
        for name, (nbytes, seconds) in collectives.items():
            z[f"{name}_seconds"].observe(seconds)
            if nbytes:
                z[f"{name}_bytes"].inc(nbytes)
        z["parameter_bytes"].set(parameter_bytes)
        z["gradient_bytes"].set(gradient_bytes)
        z["optimizer_state_bytes"].set(optimizer_state_bytes)


class NoMetrics:
    """Stands in for TrainMetrics when metrics_port is 0: the training loop does not branch on it."""

    def serve(self, port: int) -> None: ...
    def shutdown(self) -> None: ...
    def observe_step(self, **_) -> None: ...
    def observe_throughput(self, **_) -> None: ...
    def observe_progress(self, step: int, target: int) -> None: ...
    def observe_checkpoint(self, step: int, seconds: float | None) -> None: ...
    def observe_stop_requested(self) -> None: ...
    def observe_world(self, **_) -> None: ...
    def observe_healed_world(self, world_size: int) -> None: ...
    def observe_resume(self, **_) -> None: ...
    def observe_reformation(self, seconds: float) -> None: ...
    def observe_pipeline(self, **_) -> None: ...
    def observe_validation(self, loss: float) -> None: ...
    def enable_pipeline(self) -> None: ...
    def enable_zero(self, stage: int) -> None: ...
    def observe_zero(self, **_) -> None: ...


def synchronize_for(device: torch.device):
    """What to call before reading a clock, so GPU times are real (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
