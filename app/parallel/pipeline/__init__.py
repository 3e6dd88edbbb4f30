"""Pipeline parallelism across ranks on PyTorch's engine (``torch.distributed.pipelining``): one stage per rank.

``stages.py`` builds a rank's stage, its process groups (the pipeline's, and the data-parallel group of each stage
over replicas) and runs GPipe or 1F1B on it with ``schedule.py``'s loop (every receive of a step posted ahead);
``split.py`` says where a model is cut (its sequence of children, cut at named modules or balanced by parameter
count).
"""

from app.parallel.pipeline.split import SequenceStage, check_sequence, model_sequence, stage_ranges
from app.parallel.pipeline.stages import (
    SCHEDULES,
    PipelineRunner,
    build_pipeline_groups,
    build_pipeline_stage,
    merge_state_dicts,
    theoretical_bubble,
)

__all__ = [
    "SCHEDULES",
    "PipelineRunner",
    "SequenceStage",
    "build_pipeline_groups",
    "build_pipeline_stage",
    "check_sequence",
    "merge_state_dicts",
    "model_sequence",
    "stage_ranges",
    "theoretical_bubble",
]
