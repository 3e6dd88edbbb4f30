"""Rank 0's progress lines (app.worker.progress): a line at the first step, every ``log_every`` steps and at the last
one, each averaging the steps since the line before; the summary's first and last loss and step times."""

from __future__ import annotations

import logging

from app.worker.progress import ProgressLog, StepRecord


def test_a_line_at_the_first_step_every_log_every_steps_and_the_last_then_the_summary(caplog):
    progress = ProgressLog(steps=7, log_every=3, first_step=1)
    with caplog.at_level(logging.INFO, logger="app.train"):
        closed = [
            progress.record(StepRecord(i, seconds=0.01 * i, comm_seconds=0.0, exposed_seconds=None, loss=10.0 - i,
                                       samples=32))
            for i in range(1, 8)
        ]  # fmt: skip
        progress.summary()
    assert closed == [True, False, True, False, False, True, True]
    steps = [m.split(" | ")[0] for m in caplog.messages if m.startswith("step ")]
    assert steps == ["step 1/7", "step 3/7", "step 6/7", "step 7/7"]
    assert "loss 7.5000" in caplog.messages[1]  # steps 2 and 3, averaged: (8 + 7) / 2
    assert caplog.messages[-1] == (
        "summary: steps=7 loss_first=9.0000 loss_last=3.0000 median_step_ms=40.000 mean_step_ms=40.000"
    )


def test_a_resumed_run_logs_its_first_step_and_no_summary_before_any():
    progress = ProgressLog(steps=200, log_every=50, first_step=101)
    assert progress.record(StepRecord(101, 0.01, 0.0, None, 1.0, 32))  # the first step of this process: a line
    assert not progress.record(StepRecord(102, 0.01, 0.0, None, 1.0, 32))
    ProgressLog(steps=5, log_every=1, first_step=1).summary()  # nothing recorded: nothing to say, no error


def test_a_progress_line_averages_its_window_of_steps_to_the_hundredth_of_a_millisecond(caplog):
    """The step line a person reads: loss, samples/s, step and communication milliseconds averaged over the steps
    since the last line (three here), the exposed figure only over the steps that measured it."""
    progress = ProgressLog(steps=3, log_every=3, first_step=0)
    with caplog.at_level(logging.INFO, logger="app.train"):
        for i, (seconds, comm, exposed, loss) in enumerate([(0.1, 0.01, 0.004, 3.0), (0.2, 0.02, None, 2.0),
                                                            (0.3, 0.03, 0.002, 1.0)], start=1):  # fmt: skip
            progress.record(StepRecord(i, seconds, comm, exposed, loss, samples=64))
    assert caplog.messages[-1] == (
        "step 3/3 | loss 2.0000 | 320 samples/s | step 200.0 ms | comm 20.00 ms (exposed 3.00 ms)"
    )


def test_a_line_without_a_measured_wait_says_n_a_and_a_step_of_no_time_0_samples_per_second(caplog):
    # PyTorch's DDP cannot tell the exposed wait (None); a clock too coarse to see the step reads 0 seconds.
    progress = ProgressLog(steps=2, log_every=10, first_step=1)
    with caplog.at_level(logging.INFO, logger="app.train"):
        assert progress.record(StepRecord(1, 0.0, 0.0, None, 2.5, samples=64))
        assert progress.record(StepRecord(2, 0.5, 0.25, None, 1.5, samples=64))  # the last step: a line
    assert caplog.messages == [
        "step 1/2 | loss 2.5000 | 0 samples/s | step 0.0 ms | comm 0.00 ms (exposed n/a)",
        "step 2/2 | loss 1.5000 | 128 samples/s | step 500.0 ms | comm 250.00 ms (exposed n/a)",
    ]


def test_the_summary_gives_the_median_and_the_mean_step_of_the_whole_run(caplog):
    progress = ProgressLog(steps=4, log_every=100, first_step=1)
    for i, seconds in enumerate([0.001, 0.002, 0.003, 0.010], start=1):
        progress.record(StepRecord(i, seconds, 0.0, 0.0, loss=float(i), samples=8))
    with caplog.at_level(logging.INFO, logger="app.train"):
        progress.summary()
    assert caplog.messages == [
        "summary: steps=4 loss_first=1.0000 loss_last=4.0000 median_step_ms=2.500 mean_step_ms=4.000"
    ]
