"""The checks of ``TrainConfig`` where settings depend on each other: the workload, the recipe, the pipeline.

``TrainConfig.__post_init__`` (app.worker.config.schema) calls them with itself; each raises ``ConfigError``, one line
naming the field and the fix. Torch-free, like the rest of the package.
"""

from __future__ import annotations

from typing import Any

from app.specs import MODEL_DATA, MODEL_SPECS, builtin_name

MODEL_CHOICES = tuple(MODEL_SPECS)  # the built-in names; any 'package.module:callable' spec is also a model
AUTOCAST_CHOICES = ("none", "bf16", "fp16")
LR_SCHEDULE_CHOICES = ("constant", "cosine", "linear")
RECIPE_DEFAULTS = {"autocast": "none", "grad_clip_norm": 0.0, "lr_schedule": "constant", "warmup_steps": 0}
PIPELINE_MAX_STAGES = {"mini_mlp": 3}  # its Linear layers: a stage without one would only pass activations on


class ConfigError(ValueError):
    """A bad configuration value; ``str()`` is the one-line message shown to the user."""


def choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: must be one of {' | '.join(choices)}")


def at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{name}={value}: must be an integer >= {low}")


def check_workload(cfg) -> None:
    """What the model/data/loss settings alone can break; app.worker.workload imports and tries the specs."""
    if cfg.model not in MODEL_SPECS and ":" not in cfg.model:
        raise ConfigError(
            f"model={cfg.model!r}: not a built-in model ({' | '.join(MODEL_CHOICES)}) nor an import spec "
            f"'package.module:callable'"
        )
    builtin = builtin_name(cfg.model, MODEL_SPECS)
    if not cfg.data and builtin not in MODEL_DATA:
        raise ConfigError(
            f'data="": model={cfg.model} has no built-in data set; set data to an import spec '
            f"'package.module:callable' returning (input, target) samples"
        )
    if not cfg.loss and builtin is None:
        raise ConfigError(
            f'loss="": model={cfg.model} is not a built-in model, so it has no built-in loss; set loss '
            f"(cross_entropy | mse | 'package.module:callable')"
        )
    for name in ("model_kwargs", "data_kwargs", "loss_kwargs"):
        value = getattr(cfg, name)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{name}={value!r}: must be a mapping of keyword: value")
    if cfg.data_kwargs and not cfg.data:
        raise ConfigError(
            f"data_kwargs={cfg.data_kwargs!r}: keywords need a data spec (the built-in data set takes "
            f"dataset_size, seq_len and seed); set data, or unset data_kwargs"
        )


# The step kinds that run the recipe (app.worker.steps.ddp.DDPStep and the ZeRO stages built on it).
RECIPE_KINDS = ("ddp", "zero1", "zero2", "zero3")


def check_recipe(cfg) -> None:
    choice("autocast", cfg.autocast, AUTOCAST_CHOICES)
    choice("lr_schedule", cfg.lr_schedule, LR_SCHEDULE_CHOICES)
    for name in ("warmup_steps", "lr_reference_batch"):
        at_least(name, getattr(cfg, name), 0)
    if cfg.warmup_steps > cfg.steps:
        raise ConfigError(f"warmup_steps={cfg.warmup_steps} exceeds steps={cfg.steps}: lower it or raise steps")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ConfigError(f"min_lr_ratio={cfg.min_lr_ratio}: must be in 0..1 (a fraction of lr)")
    if not cfg.grad_clip_norm >= 0:
        raise ConfigError(f"grad_clip_norm={cfg.grad_clip_norm}: must be >= 0 (0 = off)")
    if cfg.autocast != "none" and cfg.dtype != "float32":
        raise ConfigError(f"autocast={cfg.autocast} needs dtype=float32 (its master weights): unset one of them")
    changed = [f"{k}={getattr(cfg, k)}" for k, v in RECIPE_DEFAULTS.items() if getattr(cfg, k) != v]
    if cfg.lr_reference_batch:
        changed.append(f"lr_reference_batch={cfg.lr_reference_batch}")
    if changed and cfg.parallel not in RECIPE_KINDS:
        raise ConfigError(
            f"{', '.join(changed)}: the recipe runs with parallel={'|'.join(RECIPE_KINDS)} (not yet in the "
            f"{cfg.parallel} step); unset it, or use one of those"
        )


def check_pipeline(cfg) -> None:
    if cfg.model not in PIPELINE_MAX_STAGES:
        raise ConfigError(
            f"parallel=pipeline: model={cfg.model} cannot be cut into stages (its blocks take a mask); "
            f"use model=mini_mlp, or parallel=ddp"
        )
    top = PIPELINE_MAX_STAGES[cfg.model]
    if cfg.pipeline_stages > top:
        raise ConfigError(
            f"pipeline_stages={cfg.pipeline_stages}: {cfg.model} has {top} layers with parameters; "
            f"use at most {top} stages"
        )
    if cfg.effective_batch is None and cfg.micro_batch % cfg.pipeline_microbatches:
        raise ConfigError(
            f"pipeline_microbatches={cfg.pipeline_microbatches} does not divide micro_batch={cfg.micro_batch}: "
            f"unequal micro-batches would change the loss; choose a divisor of {cfg.micro_batch}"
        )
    if (cfg.grad_accum_steps or 1) != 1:
        raise ConfigError(
            f"grad_accum_steps={cfg.grad_accum_steps}: with parallel=pipeline the pipeline's micro-batches "
            f"replace gradient accumulation; leave it unset (size the step with micro_batch or effective_batch)"
        )
    if cfg.inject_nan_at_step:
        raise ConfigError("inject_nan_at_step: the NaN drill runs with parallel=ddp only; set it to 0")


def activation_checkpointing_every(value: str) -> int:
    """``activation_checkpointing`` as a step over the units: 0 off, 1 each unit, N every N-th; ConfigError else."""
    if (named := {"off": 0, "units": 1}.get(value)) is not None:
        return named
    head, _, n = value.partition(":")
    if head != "every" or not n.isdigit() or int(n) < 1:
        raise ConfigError(
            f"activation_checkpointing={value!r}: must be off | units | every:N with N an integer >= 1 (every:2: "
            f"every second unit)"
        )
    return int(n)


def check_activation_checkpointing(cfg) -> None:
    """The setting's form; whether it names modules of the model is app.worker.workload's check (it builds it)."""
    if not activation_checkpointing_every(cfg.activation_checkpointing) and cfg.activation_checkpointing_units:
        raise ConfigError(
            f"activation_checkpointing_units={cfg.activation_checkpointing_units!r} is for activation "
            f"checkpointing, which is off: set activation_checkpointing=units (or every:N), or unset it"
        )
