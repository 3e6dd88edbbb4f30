"""``app.parallel.ddp.comm_stats``: what one synchronised backward's timestamps become (per-bucket latency, the
exposed wait, the span bandwidth uses) and the counters the metrics read, cumulative over backwards."""

from __future__ import annotations

import pickle

import pytest
import torch

from app.parallel.ddp.comm_stats import BackwardTimes, Clock, CommStats


def backward(launches: list[float], dones: list[float], waits: list[tuple[float, float]]) -> BackwardTimes:
    times = BackwardTimes(Clock(torch.device("cpu")), len(launches))
    times.launches, times.dones, times.waits = list(launches), list(dones), list(waits)
    return times


def test_a_backward_is_each_buckets_launch_to_done_its_waits_and_the_first_launch_to_the_last_done():
    # Bucket 1 completes before bucket 0 (a later launch, a shorter reduction): the span still ends at the latest.
    times = backward([10.0, 11.0, 12.0], [14.0, 13.0, 12.5], [(13.0, 13.5), (13.5, 14.0)])
    per_bucket, waited, span = times.seconds()
    assert per_bucket == pytest.approx([4.0, 2.0, 0.5])
    assert waited == pytest.approx(1.0)
    assert span == pytest.approx(4.0)
    assert BackwardTimes(Clock(torch.device("cpu")), 0).seconds() == ([], 0, 0.0)


def test_the_cpu_clock_is_perf_counter_and_its_seconds_are_the_difference():
    clock = Clock(torch.device("cpu"))
    assert not clock.cuda and Clock(torch.device("meta")).cuda is False
    a = clock.now()
    b = clock.now()
    assert isinstance(a, float) and b >= a
    assert clock.seconds(2.0, 5.5) == 3.5


def test_counters_add_up_over_backwards_and_the_last_fields_describe_the_latest():
    stats = CommStats()
    stats.record([100, 40], backward([0.0, 1.0], [2.0, 4.0], [(3.0, 4.0)]))
    assert (stats.sync_calls, stats.buckets_reduced, stats.bytes_reduced) == (1, 2, 140)
    assert stats.last_bucket_bytes == [100, 40]
    assert stats.last_bucket_seconds == pytest.approx([2.0, 3.0])
    assert (stats.last_wait_seconds, stats.last_comm_span_seconds) == pytest.approx((1.0, 4.0))
    stats.record([60], backward([10.0], [10.5], [(10.25, 10.5)]))
    assert (stats.sync_calls, stats.buckets_reduced, stats.bytes_reduced) == (2, 3, 200)
    assert stats.last_bucket_bytes == [60] and stats.last_bucket_seconds == pytest.approx([0.5])
    assert (stats.last_wait_seconds, stats.last_comm_span_seconds) == pytest.approx((0.25, 0.5))
    # The totals are over every backward: 2 + 3 + 0.5 seconds of reductions, 1 + 0.25 waited.
    assert (stats.allreduce_seconds, stats.wait_seconds) == pytest.approx((5.5, 1.25))
    copy = pickle.loads(pickle.dumps(stats))  # (what a rank returns to a test: resolved, then plain numbers)
    assert (copy.sync_calls, copy.allreduce_seconds, copy.last_bucket_bytes) == (2, pytest.approx(5.5), [60])
