"""The checks of ``TrainConfig`` where settings depend on each other: the workload, the recipe, the pipeline.

``TrainConfig.__post_init__`` (app.worker.config.schema) calls them with itself; each raises ``ConfigError``, one line
naming the field and the fix. Torch-free, like the rest of the package.
"""

from __future__ import annotations

from typing import Any

from app.parallel.compile import BACKENDS
from app.specs import MODEL_DATA, MODEL_SPECS, builtin_name

MODEL_CHOICES = tuple(MODEL_SPECS)  # the built-in names; any 'package.module:callable' spec is also a model
AUTOCAST_CHOICES = ("none", "bf16", "fp16")
LR_SCHEDULE_CHOICES = ("constant", "cosine", "linear")
RECIPE_DEFAULTS = {"autocast": "none", "grad_clip_norm": 0.0, "lr_schedule": "constant", "warmup_steps": 0}
PIPELINE_MAX_STAGES = {"mini_mlp": 3}  # its Linear layers: a stage without one would only pass activations on
# Built-in models that are not a sequence of children (app.parallel.pipeline.split): refused before anything is built.
PIPELINE_UNSPLITTABLE = {"tiny_transformer": "its blocks take a mask"}


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


# The step kinds that run the recipe (app.worker.steps.ddp.DDPStep, the ZeRO stages built on it, the pipeline).
RECIPE_KINDS = ("ddp", "pipeline", "zero1", "zero2", "zero3")


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


# Settings that mean something to one step kind only: set for another, they would be silently ignored.
KIND_SETTINGS = {
    "fsdp_units": "zero3",
    "pipeline_split": "pipeline",
    "overlap_gather": "zero2",
    "prefetch": "zero3",
}
COMPILE_CHOICES = ("none", *BACKENDS)  # "none", as autocast: YAML reads a bare off as false


def check_kind_settings(cfg) -> None:
    for name, kind in KIND_SETTINGS.items():
        if getattr(cfg, name) and cfg.parallel != kind:
            raise ConfigError(f"{name}={getattr(cfg, name)!r} is for parallel={kind} only: unset it for {cfg.parallel}")


HEAL_CHOICES = ("restart", "in_place")
# Why each kind cannot heal in place: what a lost rank takes with it that no survivor holds.
HEAL_REFUSED = {
    "zero1": "a lost rank takes its shard of the optimizer state with it",
    "zero2": "a lost rank takes its shard of the optimizer state and gradients with it",
    "zero3": "a lost rank takes its shard of the parameters with it",
    "pipeline": "a lost rank takes its stage of the model with it",
    "dp": "one process holds the whole world",
}


def check_heal(cfg) -> None:
    """``heal=in_place`` only where every survivor holds the whole state (parallel=ddp), with a store to meet at
    and a global batch that does not depend on the world size."""
    choice("heal", cfg.heal, HEAL_CHOICES)
    if cfg.heal == "restart":
        if cfg.heal_store:
            raise ConfigError(f"heal_store={cfg.heal_store!r} is for heal=in_place only: unset it, or set heal")
        return
    if cfg.parallel in HEAL_REFUSED:
        raise ConfigError(
            f"heal=in_place works with parallel=ddp only: under parallel={cfg.parallel} "
            f"{HEAL_REFUSED[cfg.parallel]}; set heal=restart (resume from the checkpoint)"
        )
    host, _, port = cfg.heal_store.rpartition(":")
    if not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(
            f"heal_store={cfg.heal_store!r}: heal=in_place needs HOST:PORT of a store that outlives every rank "
            f"(the rendezvous store, e.g. rendezvous:29400)"
        )
    if cfg.compile != "none":  # a heal wraps the model again, uncompiled: the two are not wired together
        raise ConfigError(f"heal=in_place with compile={cfg.compile} is not wired: set compile=none or heal=restart")
    if cfg.effective_batch is None:
        raise ConfigError(
            "effective_batch unset: heal=in_place needs the global batch fixed in samples, so that a step redone "
            "by fewer ranks is the same step; set effective_batch"
        )


def check_compile(cfg) -> None:
    """``compile`` and the zero settings that are switches (0 | 1)."""
    choice("compile", cfg.compile, COMPILE_CHOICES)
    for name in ("overlap_gather", "reshard_after_forward"):
        if getattr(cfg, name) not in (0, 1):
            raise ConfigError(f"{name}={getattr(cfg, name)}: must be 0 (off) or 1 (on)")
    at_least("prefetch", cfg.prefetch, 0)
    if not cfg.reshard_after_forward and cfg.parallel != "zero3":
        raise ConfigError(f"reshard_after_forward=0 is for parallel=zero3 only: set it to 1 for {cfg.parallel}")
    if cfg.compile == "none":
        if cfg.compile_units:
            raise ConfigError(f"compile_units={cfg.compile_units!r} needs compile on: set compile, or unset it")
        return
    if cfg.parallel == "dp":
        raise ConfigError(f"compile={cfg.compile} is not wired for parallel=dp (nn.DataParallel): set compile=none")
    if cfg.activation_checkpointing != "off":
        raise ConfigError(
            f"compile={cfg.compile} with activation_checkpointing={cfg.activation_checkpointing}: the two together "
            f"are not tested here; set compile=none or activation_checkpointing=off"
        )
    if cfg.wrapper == "torch" and cfg.parallel in ("ddp", "zero1") and cfg.bucket_cap_mb < 1:
        # torch/_dynamo/backends/distributed.py asserts it: a first bucket of 1 MiB, the others no smaller.
        raise ConfigError(
            f"compile={cfg.compile} with wrapper=torch needs bucket_cap_mb >= 1, got {cfg.bucket_cap_mb}: PyTorch's "
            f"DDPOptimizer, which cuts the compiled graph at the buckets, refuses buckets below its 1 MiB first one"
        )


def pipeline_cuts(value: str) -> list[str] | None:
    """``pipeline_split`` as the list of names where stages 2.. begin; ``None`` when empty (balanced split)."""
    if not value.strip():
        return None
    names = [name.strip() for name in value.split(",")]
    if not all(names) or any(" " in name for name in names):
        raise ConfigError(
            f"pipeline_split={value!r}: must be a comma list of module names where stages 2.. begin "
            f"(net.2, or blocks.4,blocks.8), without empty names"
        )
    return names


def check_pipeline_cuts(value: str, stages: int) -> None:
    """A ``pipeline_split`` of ``stages - 1`` names (the stage count is known once the world size is)."""
    cuts = pipeline_cuts(value)
    if cuts is not None and len(cuts) != stages - 1:
        raise ConfigError(
            f"pipeline_split={value!r} names {len(cuts)} cut(s) for {stages} stages (pipeline_stages=0: the world "
            f"size); name {stages - 1}: the module where each stage after the first begins"
        )


def check_pipeline(cfg) -> None:
    builtin = builtin_name(cfg.model, MODEL_SPECS)
    if builtin in PIPELINE_UNSPLITTABLE:
        raise ConfigError(
            f"parallel=pipeline: model={cfg.model} cannot be cut into stages ({PIPELINE_UNSPLITTABLE[builtin]}); "
            f"use model=mini_mlp or a model whose forward is its children in order, or parallel=ddp"
        )
    pipeline_cuts(cfg.pipeline_split)
    top = PIPELINE_MAX_STAGES.get(builtin, cfg.pipeline_stages)
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


def check_validation(cfg) -> None:
    """``eval_every`` needs a held-out split to evaluate, and a kind whose every rank holds the whole model."""
    at_least("eval_every", cfg.eval_every, 0)
    if not 0 <= cfg.eval_fraction < 1:
        raise ConfigError(f"eval_fraction={cfg.eval_fraction}: must lie in [0, 1), the share held out of training")
    if cfg.eval_every and not cfg.eval_fraction:
        raise ConfigError(
            f"eval_every={cfg.eval_every} needs a held-out split: set eval_fraction (e.g. 0.1), or eval_every=0"
        )
    if cfg.eval_every and cfg.parallel not in ("ddp", "dp", "zero1", "zero2"):
        # zero3 shards the parameters and a pipeline cuts the model: no rank can run the whole forward alone.
        raise ConfigError(
            f"eval_every={cfg.eval_every} works with parallel=ddp, dp, zero1 or zero2 only: set eval_every=0 for "
            f"{cfg.parallel}"
        )
