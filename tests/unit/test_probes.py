"""``app.parallel.probes``: one step's communication sample (what ``ddp_allreduce_*`` and the bus bandwidth are
computed from) and the probe that fits each wrapper."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.parallel.ddp.comm_stats import BackwardTimes, Clock, CommStats
from app.parallel.probes import CommSample, NoCommProbe, OursCommProbe, comm_probe


def test_a_sample_adds_up_its_buckets_seconds_and_bytes():
    sample = CommSample([0.5, 0.25], [1000, 3000], wait_seconds=0.1, span_seconds=0.6)
    assert sample.seconds == 0.75 and sample.nbytes == 4000
    assert CommSample().seconds == 0 and CommSample().nbytes == 0 and CommSample().wait_seconds is None


def test_bus_bandwidth_is_the_bytes_over_the_span_times_2_n_minus_1_over_n():
    # nccl-tests' busbw for an all-reduce: algbw × 2(n−1)/n, algbw from the wall time the bytes took (the span).
    sample = CommSample([0.5, 0.5], [1000, 3000], span_seconds=0.8)
    assert sample.bus_bandwidth(4) == pytest.approx(4000 / 0.8 * 2 * 3 / 4)
    assert sample.bus_bandwidth(2) == pytest.approx(4000 / 0.8)
    # No span (a wrapper that cannot tell): the buckets' summed seconds instead.
    assert CommSample([0.5, 0.5], [1000, 3000]).bus_bandwidth(2) == pytest.approx(4000 / 1.0)
    # One rank sends nothing, and a sample without time has no bandwidth (never a division by zero).
    assert sample.bus_bandwidth(1) == 0.0
    assert CommSample([], [], span_seconds=0.0).bus_bandwidth(4) == 0.0


class Wrapped(nn.Linear):
    """What OursCommProbe reads of our wrapper: its ``stats``."""

    def __init__(self):
        super().__init__(1, 1)
        self.stats = CommStats()


def test_our_probe_takes_each_synchronised_backward_once_and_nothing_between():
    wrapped = Wrapped()
    times = BackwardTimes(Clock(torch.device("cpu")), 2)
    times.launches, times.dones, times.waits = [1.0, 2.0], [3.0, 3.5], [(3.0, 3.5)]
    wrapped.stats.record([80, 20], times)  # before the probe: not this probe's to report
    probe = OursCommProbe(wrapped)
    assert probe.take() == CommSample()
    wrapped.stats.record([80, 20], times)
    assert probe.take() == CommSample([2.0, 1.5], [80, 20], 0.5, 2.5)
    assert probe.take() == CommSample()  # a no_sync() micro-batch, or a step without a sync: nothing new


def test_the_probe_fits_the_wrapper_and_a_bare_module_has_an_empty_one():
    probe = comm_probe(nn.Linear(2, 2))
    assert isinstance(probe, NoCommProbe) and probe.take() == CommSample()
