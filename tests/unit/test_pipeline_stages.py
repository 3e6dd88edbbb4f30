"""``app.parallel.pipeline.stages`` on 2 real gloo ranks: what one step of a stage reports besides its training
(which tests/integration/test_pipeline.py compares with one process): the measured bubble as a share of the step,
the flight recorder's record of every activation and gradient a stage hands its neighbour, and the runner's
attributes."""

from __future__ import annotations

import pytest
import torch

from app.diagnostics.recorder import RECORDER
from app.parallel.pipeline.schedule import OverlappedSchedule
from app.parallel.pipeline.stages import build_pipeline_stage
from app.world import run_world

WIDTH, MICRO, BATCH = 8, 4, 8


def one_step(rank: int, world: int, schedule: str) -> dict:
    from app.worker.models import DeepMLP

    torch.manual_seed(0)
    runner = build_pipeline_stage(
        DeepMLP(width=WIDTH, depth=4), stage_index=rank, num_stages=world, n_microbatches=MICRO, schedule=schedule
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    seq = RECORDER.recorded
    result = runner.forward_backward(x, y)
    entries = RECORDER.entries()[-(RECORDER.recorded - seq) :]
    return {
        "result": result,
        "p2p": sorted((e[1], e[3], e[5], e[8]) for e in entries if e[8] is not None),
        "open": [e[5] for e in entries if e[7] is None],
        "loss_share": [(e[1], e[5]) for e in entries if e[8] is None],
        "runner": (runner.stage_index, runner.num_stages, runner.n_microbatches, runner.schedule_name),
        # The default engine: every receive posted ahead (PyTorch's own loop is the baseline, overlap=False).
        "engine": (type(runner.schedule).__name__, isinstance(runner.schedule, OverlappedSchedule)),
    }


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stages_step_reports_its_bubble_and_records_every_hand_off(schedule):
    ranks = run_world(one_step, 2, schedule)
    chunk = BATCH // MICRO * WIDTH * 4  # one micro-batch's activation (or its gradient): [2, 8] fp32
    for rank, r in enumerate(ranks):
        result = r["result"]
        assert r["runner"] == (rank, 2, MICRO, schedule)
        assert r["engine"] == ("OverlappedSchedule", True)
        # The bubble is the share of the step's wall time not spent computing: send_recv / (compute + send_recv).
        wall = result.compute_seconds + result.send_recv_seconds
        assert 0 < result.bubble_ratio < 1
        assert result.bubble_ratio == pytest.approx(result.send_recv_seconds / wall, rel=1e-6)
        assert sum(result.phases.values()) == pytest.approx(wall, rel=1e-6, abs=1e-6)
        assert result.activation_bytes == MICRO * chunk
        # Every hand-off of the step is in the recorder, ended by the step's end: stage 0 sends each micro-batch's
        # activations and receives its gradient; stage 1 the other way round. Then the loss, from the last stage.
        out, back = ("activations out", "gradients in") if rank == 0 else ("gradients out", "activations in")
        expected = [("send", chunk, f"pipeline stage {rank} {out} chunk {i}", 1 - rank) for i in range(MICRO)]
        expected += [("recv", chunk, f"pipeline stage {rank} {back} chunk {i}", 1 - rank) for i in range(MICRO)]
        assert r["p2p"] == sorted(expected), rank
        assert r["open"] == [], rank
        assert r["loss_share"] == [("broadcast", "pipeline: the loss")], rank
    assert ranks[0]["result"].loss == ranks[1]["result"].loss  # the last stage's loss, on every stage
