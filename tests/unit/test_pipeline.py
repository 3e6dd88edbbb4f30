"""``app.worker.steps.pipeline`` without ranks: what a pipeline's checkpoint holds for its optimizers, and which
checkpoints it refuses (one line naming the fix, exit 2 through ``CheckpointMismatch``)."""

from __future__ import annotations

import pytest
import torch

from app.worker.checkpoint.checkpointer import CheckpointMismatch
from app.worker.steps.pipeline import _StageOptimizers


def stage_optimizer(stage: int, num_stages: int) -> _StageOptimizers:
    param = torch.nn.Parameter(torch.ones(2))
    return _StageOptimizers(torch.optim.AdamW([param], lr=0.5), stage, num_stages)


def test_a_stage_resumes_its_own_entry_of_the_pipelines_optimizer_state():
    saved = [stage_optimizer(s, 2).optimizer for s in range(2)]
    for s, opt in enumerate(saved):
        opt.param_groups[0]["lr"] = 0.1 * (s + 1)  # each stage's state told apart by its lr
    state = {"pipeline_stages": 2, "stages": [opt.state_dict() for opt in saved]}
    for s in range(2):
        resumed = stage_optimizer(s, 2)
        resumed.load_state_dict(state)
        assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * (s + 1))


@pytest.mark.parametrize(
    ("state", "says"),
    [
        ({"state": {}, "param_groups": []}, "written by parallel=ddp (one optimizer for the whole model); resume"),
        ({"pipeline_stages": 3, "stages": [{}] * 3}, "written by a 3-stage pipeline, this one has 2 stages; set "),
    ],
)
def test_an_optimizer_state_of_another_layout_is_refused_in_one_line(state, says):
    with pytest.raises(CheckpointMismatch, match=r"^[^\n]*$") as refused:
        stage_optimizer(0, 2).load_state_dict(state)
    assert says in str(refused.value)
