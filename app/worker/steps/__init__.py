"""Which step kind a run uses: ``STEP_KINDS`` (``cfg.parallel`` -> kind) and ``build_step``, what ``app.train`` calls.

The kinds live one per file: ``ddp.py``, ``data_parallel.py`` (dp), ``pipeline.py`` and ``zero.py`` (zero1-3);
they import ``base.py`` for the members every kind has (the ``TrainStep`` protocol), and this module
imports them, so no two modules import each other. The pipeline and ZeRO kinds are imported on use: a ddp run needs
neither the pipelining engine nor the sharding code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from app.parallel.activation_checkpointing import checkpoint_modules
from app.worker.config import TrainConfig
from app.worker.dist import DistContext
from app.worker.steps.base import StepInputs, TrainStep
from app.worker.steps.data_parallel import DataParallelStep
from app.worker.steps.ddp import DDPStep
from app.worker.workload import build_loss, build_model, checkpointed_units, compiled_units, compiles_at_buckets

log = logging.getLogger("app.train")


def _pipeline_step(*args, **kwargs):
    from app.worker.steps.pipeline import PipelineStep

    return PipelineStep(*args, **kwargs)


def _sharded_step(stage: str) -> Callable[..., TrainStep]:
    def build(*args, **kwargs):
        from app.worker.steps.zero import STAGES

        return STAGES[stage](*args, **kwargs)

    return build


STEP_KINDS: dict[str, Callable[..., TrainStep]] = {
    "ddp": DDPStep,
    "dp": DataParallelStep,
    "pipeline": _pipeline_step,
    **{stage: _sharded_step(stage) for stage in ("zero1", "zero2", "zero3")},
}


def build_step(cfg: TrainConfig, ctx: DistContext, grad_accum_steps: int, metrics) -> TrainStep:
    """The step kind ``cfg.parallel`` names, over the model ``cfg.model`` names (app.worker.workload), built from
    ``cfg.seed`` (the same on every rank).

    Every kind is called alike: ``kind(StepInputs(cfg, ctx, model, loss_fn, grad_accum_steps, metrics))``;
    ``metrics`` serves the kinds that report series of their own (the pipeline's ``ddp_pipeline_*``). Then the
    modules ``activation_checkpointing`` names recompute their forward in backward, and the units ``compile``
    names are compiled one by one, whatever the kind (``wrapper=torch`` compiles its DDP whole: DDPStep; our DDP's
    module is compiled whole, cut at its buckets, unless ``compile_units`` names units: ``compiles_at_buckets``).
    """
    torch.manual_seed(cfg.seed)  # identical parameters on every rank, before any wrapper broadcasts them
    model = build_model(cfg)
    to_compile = compiled_units(cfg, model)  # found before the kind: zero3 takes its units' parameters out of them
    kind = STEP_KINDS[cfg.parallel]
    step = kind(StepInputs(cfg, ctx, model, build_loss(cfg), grad_accum_steps, metrics))
    # After the kind: every wrapper and pipeline stage holds these very modules, and zero3 has already found its
    # units by class (a checkpointed module's class is a subclass of its own: app.parallel.activation_checkpointing).
    compile_model_units(cfg, to_compile)
    if compiles_at_buckets(cfg):
        from app.parallel.compile import compile_at_buckets

        def compiled(graphs: int) -> None:  # at the first forward, when dynamo compiles
            log.info("compile (%s): the model whole, cut at our DDP's buckets into %d graphs", cfg.compile, graphs)

        compile_at_buckets(step.wrapped, cfg.compile, on_compile=compiled)
    units = checkpointed_units(cfg, model)
    if units:
        checkpoint_modules(units.values())
        log.info(
            "activation checkpointing (%s): %d modules, %s", cfg.activation_checkpointing, len(units), ", ".join(units)
        )
    return step


def compile_model_units(cfg: TrainConfig, units: dict) -> None:
    """Compile ``compile``'s units in place (app.parallel.compile), after the kind: every wrapper and pipeline stage
    holds these very modules, with their hooks registered; dynamo compiles at the first forward."""
    if units:
        from app.parallel.compile import compile_units

        compile_units(units.values(), cfg.compile)
        log.info("compile (%s): %d units one by one, %s", cfg.compile, len(units), ", ".join(units))
