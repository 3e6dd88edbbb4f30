"""The checks where settings depend on each other (app.worker.config.checks), through ``TrainConfig`` as a user meets
them: each combination the docs allow is taken, each they refuse is one line naming the field and the fix."""

from __future__ import annotations

import pytest

from app.worker.config.checks import (
    KIND_SETTINGS,
    RECIPE_DEFAULTS,
    ConfigError,
    activation_checkpointing_every,
    check_pipeline_cuts,
    pipeline_cuts,
)
from app.worker.config.schema import TrainConfig

USER_MODEL = {"model": "pkg.mod:Net", "data": "pkg.mod:data", "loss": "mse"}  # specs are imported later (workload)


def refused(**kwargs) -> str:
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


# -- the workload ---------------------------------------------------------------------------------------------------


def test_a_model_is_a_built_in_name_or_an_import_spec():
    for name in ("mini_mlp", "tiny_transformer"):
        assert TrainConfig(model=name).model == name
    assert TrainConfig(model="deep_mlp", data="pkg.mod:data").loss == ""  # its own loss, mse
    assert TrainConfig(**USER_MODEL).model == USER_MODEL["model"]
    assert refused(model="resnet") == (
        "model='resnet': not a built-in model (mini_mlp | deep_mlp | tiny_transformer) nor an import spec "
        "'package.module:callable'"
    )


def test_a_user_model_needs_its_data_and_its_loss_named():
    assert refused(model="pkg.mod:Net", loss="mse") == (
        'data="": model=pkg.mod:Net has no built-in data set; set data to an import spec '
        "'package.module:callable' returning (input, target) samples"
    )
    assert refused(model="pkg.mod:Net", data="pkg.mod:data") == (
        'loss="": model=pkg.mod:Net is not a built-in model, so it has no built-in loss; set loss '
        "(cross_entropy | mse | 'package.module:callable')"
    )
    # A built-in model has both, and may take a data set of its own with its own loss left to it.
    assert TrainConfig(model="mini_mlp", data="pkg.mod:data").loss == ""


@pytest.mark.parametrize("name", ["model_kwargs", "data_kwargs", "loss_kwargs"])
def test_each_keyword_mapping_must_be_a_mapping_of_names(name):
    spec = {**USER_MODEL, name: {"width": 8}}
    assert getattr(TrainConfig(**spec), name) == {"width": 8}
    assert refused(**{**USER_MODEL, name: {1: 8}}) == f"{name}={{1: 8}}: must be a mapping of keyword: value"
    assert refused(**{**USER_MODEL, name: ["width"]}) == f"{name}=['width']: must be a mapping of keyword: value"


def test_data_kwargs_need_a_data_spec():
    assert refused(data_kwargs={"n": 4}) == (
        "data_kwargs={'n': 4}: keywords need a data spec (the built-in data set takes dataset_size, seq_len and "
        "seed); set data, or unset data_kwargs"
    )


# -- the recipe -----------------------------------------------------------------------------------------------------


def test_warm_up_may_last_the_whole_run_and_no_longer():
    assert TrainConfig(steps=10, warmup_steps=10).warmup_steps == 10
    assert refused(steps=10, warmup_steps=11) == "warmup_steps=11 exceeds steps=10: lower it or raise steps"


def test_min_lr_ratio_is_a_fraction_with_both_ends_included():
    for ratio in (0.0, 0.5, 1.0):
        assert TrainConfig(lr_schedule="cosine", min_lr_ratio=ratio).min_lr_ratio == ratio
    for ratio in (-0.01, 1.01):
        assert refused(min_lr_ratio=ratio) == f"min_lr_ratio={ratio}: must be in 0..1 (a fraction of lr)"


def test_clipping_is_off_at_zero_and_refuses_a_negative_norm():
    assert TrainConfig(grad_clip_norm=0.0).grad_clip_norm == 0.0
    assert refused(grad_clip_norm=-0.01) == "grad_clip_norm=-0.01: must be >= 0 (0 = off)"


@pytest.mark.parametrize("autocast", ["bf16", "fp16"])
def test_mixed_precision_keeps_float32_master_weights(autocast):
    assert TrainConfig(autocast=autocast).autocast == autocast
    assert refused(autocast=autocast, dtype="float64") == (
        f"autocast={autocast} needs dtype=float32 (its master weights): unset one of them"
    )


@pytest.mark.parametrize(("name", "value"), [("autocast", "x"), ("lr_schedule", "step")])
def test_the_recipes_choices_are_listed_when_refused(name, value):
    choices = {"autocast": "none | bf16 | fp16", "lr_schedule": "constant | cosine | linear"}[name]
    assert refused(**{name: value}) == f"{name}={value!r}: must be one of {choices}"


SET = {"autocast": "bf16", "grad_clip_norm": 1.0, "lr_schedule": "cosine", "warmup_steps": 2, "lr_reference_batch": 64}


@pytest.mark.parametrize("name", list(SET))
def test_each_recipe_setting_runs_with_the_recipe_kinds_and_is_refused_by_dp(name):
    assert set(RECIPE_DEFAULTS) | {"lr_reference_batch"} == set(SET)
    for parallel in ("ddp", "zero1", "zero2", "zero3"):
        assert getattr(TrainConfig(parallel=parallel, **{name: SET[name]}), name) == SET[name]
    assert refused(parallel="dp", **{name: SET[name]}) == (
        f"{name}={SET[name]}: the recipe runs with parallel=ddp|pipeline|zero1|zero2|zero3 (not yet in the dp "
        "step); unset it, or use one of those"
    )


def test_dp_takes_the_recipe_at_its_defaults_and_names_every_setting_changed():
    assert TrainConfig(parallel="dp", **RECIPE_DEFAULTS, lr_reference_batch=0).parallel == "dp"
    assert refused(parallel="dp", grad_clip_norm=1.0, warmup_steps=2).startswith(
        "grad_clip_norm=1.0, warmup_steps=2: the recipe runs with"
    )


# -- settings of one kind ---------------------------------------------------------------------------------------------


VALUES = {"fsdp_units": "Block", "pipeline_split": "net.2", "overlap_gather": 1, "prefetch": 1}


@pytest.mark.parametrize(("name", "kind"), list(KIND_SETTINGS.items()))
def test_a_setting_of_one_kind_is_taken_by_it_and_refused_by_another(name, kind):
    assert getattr(TrainConfig(parallel=kind, **{name: VALUES[name]}), name) == VALUES[name]
    assert refused(parallel="ddp", **{name: VALUES[name]}) == (
        f"{name}={VALUES[name]!r} is for parallel={kind} only: unset it for ddp"
    )


# -- heal -------------------------------------------------------------------------------------------------------------


HEAL = {"heal": "in_place", "heal_store": "rendezvous:29400", "effective_batch": 64}


def test_heal_in_place_runs_under_ddp_with_a_store_and_a_fixed_global_batch():
    assert TrainConfig(**HEAL).heal == "in_place"
    assert refused(heal="mend") == "heal='mend': must be one of restart | in_place"


def test_a_heal_store_without_heal_in_place_is_refused():
    assert TrainConfig(heal="restart").heal_store == ""
    assert refused(heal_store="rendezvous:29400") == (
        "heal_store='rendezvous:29400' is for heal=in_place only: unset it, or set heal"
    )


@pytest.mark.parametrize(
    ("parallel", "why"),
    [
        ("zero1", "a lost rank takes its shard of the optimizer state with it"),
        ("zero2", "a lost rank takes its shard of the optimizer state and gradients with it"),
        ("zero3", "a lost rank takes its shard of the parameters with it"),
        ("pipeline", "a lost rank takes its stage of the model with it"),
        ("dp", "one process holds the whole world"),
    ],
)
def test_heal_in_place_is_refused_by_every_kind_whose_ranks_hold_a_part(parallel, why):
    assert refused(**HEAL, parallel=parallel) == (
        f"heal=in_place works with parallel=ddp only: under parallel={parallel} {why}; set heal=restart "
        "(resume from the checkpoint)"
    )


@pytest.mark.parametrize("store", ["rendezvous:1", "rendezvous:65535", "10.0.0.1:29400"])
def test_a_heal_store_is_any_host_and_a_tcp_port(store):
    assert TrainConfig(**{**HEAL, "heal_store": store}).heal_store == store


@pytest.mark.parametrize("store", ["", "rendezvous", ":29400", "rendezvous:0", "rendezvous:65536", "rendezvous:x"])
def test_a_heal_store_that_is_not_host_and_port_is_refused(store):
    assert refused(**{**HEAL, "heal_store": store}) == (
        f"heal_store={store!r}: heal=in_place needs HOST:PORT of a store that outlives every rank (the rendezvous "
        "store, e.g. rendezvous:29400)"
    )


def test_heal_in_place_refuses_compile_and_a_batch_that_follows_the_world():
    assert refused(**HEAL, compile="aot_eager") == (
        "heal=in_place with compile=aot_eager is not wired: set compile=none or heal=restart"
    )
    assert refused(**{**HEAL, "effective_batch": None}) == (
        "effective_batch unset: heal=in_place needs the global batch fixed in samples, so that a step redone by "
        "fewer ranks is the same step; set effective_batch"
    )


# -- compile and the ZeRO switches -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "parallel"), [("overlap_gather", "zero2"), ("reshard_after_forward", "zero3")])
def test_a_switch_is_0_or_1(name, parallel):
    for value in (0, 1):
        assert getattr(TrainConfig(parallel=parallel, **{name: value}), name) == value
    for value in (2, -1):
        assert refused(parallel=parallel, **{name: value}) == f"{name}={value}: must be 0 (off) or 1 (on)"


def test_prefetch_counts_from_zero():
    assert TrainConfig(parallel="zero3", prefetch=0).prefetch == 0
    assert TrainConfig(parallel="zero3", prefetch=2).prefetch == 2
    assert refused(parallel="zero3", prefetch=-1) == "prefetch=-1: must be an integer >= 0"


def test_keeping_the_gathered_parameters_is_zero3s_alone():
    assert TrainConfig(parallel="zero3", reshard_after_forward=0).reshard_after_forward == 0
    assert refused(parallel="zero1", reshard_after_forward=0) == (
        "reshard_after_forward=0 is for parallel=zero3 only: set it to 1 for zero1"
    )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_takes_each_backend_and_its_units(backend):
    cfg = TrainConfig(compile=backend, compile_units="Linear")
    assert (cfg.compile, cfg.compile_units) == (backend, "Linear")
    assert refused(compile="eager").startswith("compile='eager': must be one of none | ")


def test_compile_units_need_compile_on():
    assert refused(compile_units="Block") == "compile_units='Block' needs compile on: set compile, or unset it"


def test_compile_is_refused_with_dataparallel_and_with_activation_checkpointing():
    assert refused(compile="aot_eager", parallel="dp") == (
        "compile=aot_eager is not wired for parallel=dp (nn.DataParallel): set compile=none"
    )
    assert refused(compile="aot_eager", activation_checkpointing="every:2") == (
        "compile=aot_eager with activation_checkpointing=every:2: the two together are not tested here; set "
        "compile=none or activation_checkpointing=off"
    )


@pytest.mark.parametrize("parallel", ["ddp", "zero1"])
def test_compile_with_torchs_ddp_needs_buckets_of_at_least_1_mib(parallel):
    cfg = TrainConfig(compile="aot_eager", wrapper="torch", parallel=parallel, bucket_cap_mb=1.0)
    assert cfg.bucket_cap_mb == 1.0
    assert refused(compile="aot_eager", wrapper="torch", parallel=parallel, bucket_cap_mb=0.99) == (
        "compile=aot_eager with wrapper=torch needs bucket_cap_mb >= 1, got 0.99: PyTorch's DDPOptimizer, which "
        "cuts the compiled graph at the buckets, refuses buckets below its 1 MiB first one"
    )


def test_small_buckets_are_refused_only_where_dynamo_cuts_torchs_ddp():
    assert TrainConfig(compile="aot_eager", wrapper="ours", bucket_cap_mb=0.5).bucket_cap_mb == 0.5
    assert TrainConfig(compile="aot_eager", wrapper="torch", parallel="zero2", bucket_cap_mb=0.5).parallel == "zero2"


# -- the pipeline ---------------------------------------------------------------------------------------------------


def test_pipeline_split_reads_a_comma_list_and_empty_means_balanced():
    assert pipeline_cuts("") is None and pipeline_cuts("  ") is None
    assert pipeline_cuts("net.2") == ["net.2"]
    assert pipeline_cuts("blocks.4, blocks.8") == ["blocks.4", "blocks.8"]
    for bad in ("net.2,,net.4", "net.2,", "net 2"):
        with pytest.raises(ConfigError) as e:
            pipeline_cuts(bad)
        assert str(e.value) == (
            f"pipeline_split={bad!r}: must be a comma list of module names where stages 2.. begin (net.2, or "
            "blocks.4,blocks.8), without empty names"
        )


def test_a_split_names_one_cut_fewer_than_the_stages():
    check_pipeline_cuts("", 4)
    check_pipeline_cuts("a,b,c", 4)
    with pytest.raises(ConfigError) as e:
        check_pipeline_cuts("a,b", 4)
    assert str(e.value) == (
        "pipeline_split='a,b' names 2 cut(s) for 4 stages (pipeline_stages=0: the world size); name 3: the module "
        "where each stage after the first begins"
    )


def test_the_transformer_is_refused_as_a_pipeline_before_anything_is_built():
    assert refused(parallel="pipeline", model="tiny_transformer") == (
        "parallel=pipeline: model=tiny_transformer cannot be cut into stages (its blocks take a mask); use "
        "model=mini_mlp or a model whose forward is its children in order, or parallel=ddp"
    )


def test_micro_batches_must_divide_the_micro_batch_unless_an_effective_batch_sizes_the_step():
    assert refused(parallel="pipeline", micro_batch=30, pipeline_microbatches=4) == (
        "pipeline_microbatches=4 does not divide micro_batch=30: unequal micro-batches would change the loss; "
        "choose a divisor of 30"
    )
    cfg = TrainConfig(parallel="pipeline", micro_batch=30, pipeline_microbatches=4, effective_batch=64)
    assert cfg.pipeline_microbatches == 4  # effective_batch's split is checked against the world (pipeline_layout)


def test_the_nan_drill_is_refused_in_a_pipeline():
    assert refused(parallel="pipeline", inject_nan_at_step=3) == (
        "inject_nan_at_step: the NaN drill runs with parallel=ddp only; set it to 0"
    )
    assert TrainConfig(inject_nan_at_step=3).inject_nan_at_step == 3


def test_the_pipeline_checks_run_only_for_a_pipeline():
    cfg = TrainConfig(micro_batch=30, pipeline_microbatches=4, grad_accum_steps=2, pipeline_stages=8)
    assert cfg.grad_accum_steps == 2


# -- activation checkpointing and validation ------------------------------------------------------------------------


def test_activation_checkpointing_units_need_it_on():
    assert TrainConfig(
        activation_checkpointing="units", activation_checkpointing_units="Linear"
    ).activation_checkpointing
    assert TrainConfig(activation_checkpointing="every:2", activation_checkpointing_units="Linear").parallel == "ddp"
    assert refused(activation_checkpointing_units="Linear") == (
        "activation_checkpointing_units='Linear' is for activation checkpointing, which is off: set "
        "activation_checkpointing=units (or every:N), or unset it"
    )
    assert activation_checkpointing_every("every:12") == 12


def test_the_held_out_share_lies_in_0_to_1_with_1_left_out():
    for fraction in (0.0, 0.5, 0.99):
        assert TrainConfig(eval_fraction=fraction).eval_fraction == fraction
    for fraction in (1.0, -0.01):
        assert refused(eval_fraction=fraction) == (
            f"eval_fraction={fraction}: must lie in [0, 1), the share held out of training"
        )


def test_validation_needs_a_held_out_share():
    assert refused(eval_every=5) == "eval_every=5 needs a held-out split: set eval_fraction (e.g. 0.1), or eval_every=0"
    assert TrainConfig(eval_fraction=0.1).eval_every == 0  # a split may be held out without evaluating it


@pytest.mark.parametrize("parallel", ["ddp", "dp", "zero1", "zero2"])
def test_validation_runs_where_every_rank_holds_the_whole_model(parallel):
    assert TrainConfig(eval_every=5, eval_fraction=0.1, parallel=parallel).eval_every == 5


@pytest.mark.parametrize("parallel", ["zero3", "pipeline"])
def test_validation_is_refused_where_no_rank_holds_the_whole_model(parallel):
    assert refused(eval_every=5, eval_fraction=0.1, parallel=parallel) == (
        f"eval_every=5 works with parallel=ddp, dp, zero1 or zero2 only: set eval_every=0 for {parallel}"
    )


def test_a_built_in_model_without_built_in_data_needs_a_data_spec():
    assert refused(model="deep_mlp") == (
        'data="": model=deep_mlp has no built-in data set; set data to an import spec '
        "'package.module:callable' returning (input, target) samples"
    )
