"""Pipeline parallelism across ranks on PyTorch's engine (``torch.distributed.pipelining``): one stage per rank.

``stages.py`` builds a rank's stage, its process groups (the pipeline's, and the data-parallel group of each stage
over replicas) and runs GPipe or 1F1B on it.
"""

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
    "build_pipeline_groups",
    "build_pipeline_stage",
    "merge_state_dicts",
    "theoretical_bubble",
]
