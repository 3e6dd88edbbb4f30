"""The throughput, MFU, memory and collective-progress series of one rank (part of ``TrainMetrics``' registry).

Per step (``observe``): samples and tokens per second, model FLOP/s and MFU against this rank's measured matmul peak
(``app.diagnostics.throughput``). Read at each scrape (so a rank stuck mid-step still shows where it is): resident
memory now and at its peak, CUDA's allocated and reserved bytes (0 without a GPU), and the sequence number of the
last collective this rank issued in the default group (the flight recorder's, ``app.diagnostics.recorder``): a rank
whose number stays below the others' while no rank moves is the one the others wait for (``DDPRankBehind``).
"""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, Gauge

from app.diagnostics import throughput
from app.diagnostics.recorder import RECORDER

# Times a rank measures its matmul peak at most: once, then again when a step beats it (the first timing was slowed
# by other processes). Bounded, since a model whose matmuls outrun the timed ones would otherwise re-time every step.
PEAK_MEASUREMENTS = 3


class ThroughputSeries:
    def __init__(self, registry: CollectorRegistry, rank: str, cuda: torch.device | None = None):

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["rank"], registry=registry).labels(rank=rank)

        self.samples = gauge("ddp_samples_per_second", "Last step: samples this rank trained on per second")
        self.tokens = gauge(
            "ddp_tokens_per_second", "Last step: tokens per second (token-id inputs; else one per sample)"
        )
        self.flops = gauge("ddp_model_flops_per_second", "Last step: model FLOPs (flop_counter) per second")
        self.peak = gauge("ddp_peak_flops_per_second", "This rank's measured float32 matmul rate (MFU's peak)")
        self.mfu = gauge("ddp_mfu_ratio", "Last step: model FLOPs utilisation, model FLOP/s over the measured peak")
        gauge("ddp_memory_rss_bytes", "Resident memory of this rank now").set_function(throughput.rss_bytes)
        gauge("ddp_memory_peak_rss_bytes", "Peak resident memory of this rank").set_function(throughput.peak_rss_bytes)
        gauge("ddp_last_collective_sequence", "Collectives this rank has issued in the default group").set_function(
            RECORDER.last_seq
        )
        # Registered on every rank (0 without a GPU), so that one dashboard and one set of rules fit every run.
        for name, key, doc in (
            ("ddp_cuda_memory_allocated_bytes", "cuda_allocated", "allocated by tensors"),
            ("ddp_cuda_memory_reserved_bytes", "cuda_reserved", "reserved by the caching allocator"),
        ):
            read = (lambda key=key: throughput.memory(cuda)[key]) if cuda is not None else (lambda: 0)
            gauge(name, f"CUDA memory {doc} on this rank's GPU (0 without one)").set_function(read)
        self._peak: float | None = None
        self._peak_measurements = 0

    def observe(
        self, *, samples: int, tokens_per_sample: int, seconds: float, flops: int | None, device: torch.device
    ) -> None:
        """One step's rates. The peak is measured on the first call with FLOPs (a fraction of a second), and again,
        a bounded number of times, when a step beats it: a peak timed while other processes held the cores is too
        low, and MFU over it would read above 1."""
        if seconds <= 0:
            return
        self.samples.set(samples / seconds)
        self.tokens.set(samples * tokens_per_sample / seconds)
        if flops is None:
            return
        rate = flops / seconds
        if self._peak is None or (rate > self._peak and self._peak_measurements < PEAK_MEASUREMENTS):
            self._peak = max(self._peak or 0.0, throughput.measure_matmul_peak(device))
            self._peak_measurements += 1
            self.peak.set(self._peak)
        self.flops.set(rate)
        self.mfu.set(rate / self._peak)
