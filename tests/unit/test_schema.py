"""TrainConfig's documented ranges, each at its edge: the value just inside is taken as given, the value just outside
is refused in the one line that names the field and the fix (app.train prints it and exits 2; tests/unit/test_config.py
runs that path whole). Torch-free but for ``check_world``'s own import, so milliseconds each.
"""

from __future__ import annotations

import pytest

from app.worker.config.checks import ConfigError
from app.worker.config.schema import TrainConfig


def refused(**kwargs) -> str:
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def refused_world(cfg: TrainConfig, world_size: int, local_world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as e:
        cfg.check_world(world_size, local_world_size)
    assert "\n" not in str(e.value)
    return str(e.value)


# (field, the lowest value taken) for every count the docs give a floor: one below is refused, naming the floor.
FLOORS = [
    ("steps", 1),
    ("micro_batch", 1),
    ("dataset_size", 1),
    ("seq_len", 1),
    ("checkpoint_every", 1),
    ("keep_checkpoints", 1),
    ("log_every", 1),
    ("grad_accum_steps", 1),
    ("effective_batch", 1),
    ("pipeline_stages", 0),
    ("pipeline_microbatches", 1),
    ("flight_recorder_entries", 0),
    ("warmup_steps", 0),
    ("lr_reference_batch", 0),
    ("eval_every", 0),
]


@pytest.mark.parametrize(("name", "low"), FLOORS, ids=[f[0] for f in FLOORS])
def test_every_counts_floor_is_taken_and_one_below_it_refused_naming_the_floor(name, low):
    extra = {"eval_fraction": 0.1} if name == "eval_every" else {}
    assert getattr(TrainConfig(**{name: low}, **extra), name) == low
    assert refused(**{name: low - 1}, **extra) == f"{name}={low - 1}: must be an integer >= {low}"


def test_the_optional_counts_may_be_unset():
    cfg = TrainConfig(grad_accum_steps=None, effective_batch=None)
    assert (cfg.grad_accum_steps, cfg.effective_batch) == (None, None)


POSITIVE = [
    "lr",
    "bucket_cap_mb",
    "rendezvous_timeout_seconds",
    "collective_timeout_seconds",
    "stop_timeout_seconds",
    "checkpoint_timeout_seconds",
]


@pytest.mark.parametrize("name", POSITIVE)
def test_every_amount_that_must_be_positive_takes_a_small_one_and_refuses_zero(name):
    small = 0.002
    write = {"checkpoint_timeout_seconds": 0.001}  # a write must stay shorter than the stop and the collectives
    assert getattr(TrainConfig(**{**write, name: small}), name) == small
    assert refused(**{name: 0.0}) == f"{name}=0.0: must be > 0"
    assert refused(**{name: -1.0}) == f"{name}=-1.0: must be > 0"


@pytest.mark.parametrize("name", ["metrics_linger_seconds", "min_step_seconds"])
def test_the_waits_take_zero_and_refuse_a_negative(name):
    assert getattr(TrainConfig(**{name: 0.0}), name) == 0.0
    assert refused(**{name: -0.001}) == f"{name}=-0.001: must be >= 0"


def test_the_metrics_port_is_a_tcp_port_or_zero():
    for port in (0, 1, 65535):
        assert TrainConfig(metrics_port=port).metrics_port == port
    for port in (-1, 65536):
        assert refused(metrics_port=port) == (f"metrics_port={port}: must be a TCP port 1..65535, or 0 for no metrics")


def test_the_nan_drill_is_off_at_zero_and_refuses_a_negative_step():
    assert TrainConfig(inject_nan_at_step=0).inject_nan_at_step == 0
    assert TrainConfig(inject_nan_at_step=3).inject_nan_at_step == 3
    assert refused(inject_nan_at_step=-1) == "inject_nan_at_step=-1: must be >= 0 (0 = off)"


def test_tiny_transformers_64_positions_bound_only_its_built_in_sequences():
    assert TrainConfig(model="tiny_transformer", seq_len=64).seq_len == 64
    assert refused(model="tiny_transformer", seq_len=65) == (
        "seq_len=65: tiny_transformer has 64 positions; choose seq_len <= 64"
    )
    # A data spec brings its own sequences: seq_len is not read, so it is no reason to refuse.
    spec = TrainConfig(model="tiny_transformer", data="app.worker.data:synthetic_tokens", seq_len=128)
    assert spec.seq_len == 128


@pytest.mark.parametrize(
    ("name", "value", "choices"),
    [
        ("wrapper", "horovod", "ours | torch | none"),
        ("device", "tpu", "auto | cpu | cuda"),
        ("parallel", "fsdp", "ddp | pipeline | dp | zero1 | zero2 | zero3"),
        ("pipeline_schedule", "interleaved", "gpipe | 1f1b"),
        ("dtype", "float16", "float32 | float64"),
    ],
)
def test_a_choice_outside_its_list_is_refused_listing_the_choices(name, value, choices):
    assert refused(**{name: value}) == f"{name}={value!r}: must be one of {choices}"


@pytest.mark.parametrize("parallel", ["ddp", "zero1", "zero2"])
def test_float64_is_taken_by_the_kinds_that_keep_it(parallel):
    assert TrainConfig(dtype="float64", parallel=parallel).dtype == "float64"


@pytest.mark.parametrize("parallel", ["zero3", "dp", "pipeline"])
def test_float64_is_refused_by_the_other_kinds_naming_the_kind(parallel):
    assert refused(dtype="float64", parallel=parallel) == (
        f"dtype=float64 works with parallel=ddp, zero1 or zero2 only: set dtype=float32 for {parallel}"
    )


# -- pipeline_layout: stages and replicas of a world ----------------------------------------------------------------


def test_a_pipelines_stages_default_to_the_world_size_and_the_rest_are_replicas():
    assert TrainConfig(parallel="pipeline").pipeline_layout(2) == (2, 1)
    assert TrainConfig(parallel="pipeline").pipeline_layout(3) == (3, 1)
    assert TrainConfig(parallel="pipeline", pipeline_stages=2).pipeline_layout(6) == (2, 3)


def test_a_pipeline_of_one_stage_is_refused():
    assert refused_world(TrainConfig(parallel="pipeline"), 1) == (
        "parallel=pipeline with world_size=1: a pipeline needs >= 2 stages, one per rank; run >= 2 ranks "
        "(torchrun --nproc-per-node=2), or parallel=ddp"
    )


def test_mini_mlp_takes_up_to_its_three_layers_as_stages():
    assert TrainConfig(parallel="pipeline").pipeline_layout(3) == (3, 1)
    assert refused_world(TrainConfig(parallel="pipeline"), 4) == (
        "parallel=pipeline: 4 stages (pipeline_stages=0: the world size) but mini_mlp has 3 layers with parameters; "
        "set pipeline_stages to a divisor of 4 up to 3"
    )
    assert refused(parallel="pipeline", pipeline_stages=4) == (
        "pipeline_stages=4: mini_mlp has 3 layers with parameters; use at most 3 stages"
    )


def test_a_user_models_stages_are_bounded_only_by_the_world():
    cfg = TrainConfig(parallel="pipeline", model="app.worker.models:DeepMLP", loss="cross_entropy", data="x:y")
    assert cfg.pipeline_layout(8) == (8, 1)


def test_stages_that_do_not_divide_the_world_are_refused():
    cfg = TrainConfig(parallel="pipeline", pipeline_stages=2)
    assert refused_world(cfg, 3) == "pipeline_stages=2 does not divide world_size=3: run a multiple of 2 ranks"


def test_1f1b_needs_at_least_as_many_micro_batches_as_stages():
    cfg = TrainConfig(parallel="pipeline", pipeline_schedule="1f1b", pipeline_microbatches=2, micro_batch=32)
    assert cfg.pipeline_layout(2) == (2, 1)  # as many: taken
    assert refused_world(cfg, 3) == (
        "pipeline_schedule=1f1b needs pipeline_microbatches >= 3 stages, got 2; raise it or use pipeline_schedule=gpipe"
    )
    gpipe = TrainConfig(parallel="pipeline", pipeline_microbatches=2, micro_batch=32)
    assert gpipe.pipeline_layout(3) == (3, 1)  # gpipe runs any count


def test_a_pipelines_world_checks_deal_the_data_to_its_replicas_not_its_ranks():
    # 2 stages x 2 replicas: the data set is dealt to 2 replicas, 32 samples each, not to 4 ranks (16 < 32).
    cfg = TrainConfig(parallel="pipeline", pipeline_stages=2, dataset_size=64, micro_batch=32)
    assert cfg.check_world(4) == 1
    assert refused_world(TrainConfig(parallel="pipeline", pipeline_stages=2, dataset_size=63, micro_batch=32), 4) == (
        "dataset_size=63 gives each of world_size=2 ranks 31 samples, fewer than micro_batch=32; "
        "raise dataset_size to >= 64 or lower micro_batch"
    )


# -- check_world: what needs the world size ------------------------------------------------------------------------


def test_dataparallel_is_one_process_and_refuses_a_world():
    assert refused_world(TrainConfig(parallel="dp"), 2) == (
        "parallel=dp with world_size=2: nn.DataParallel is one process driving every GPU; run it without torchrun "
        "(python -m app.train --parallel dp), or use parallel=ddp"
    )


def test_wrapper_none_is_for_one_process_of_ddp():
    assert TrainConfig(wrapper="none").check_world(1) == 1
    assert refused_world(TrainConfig(wrapper="none"), 2) == (
        "wrapper=none with world_size=2: unsynchronised ranks would train 2 different models; use wrapper=ours or "
        "wrapper=torch, or run one process"
    )
    # The ZeRO kinds bring their own synchronisation: the wrapper setting is not theirs.
    assert TrainConfig(wrapper="none", parallel="zero1").check_world(2) == 1


def test_the_built_in_data_set_must_give_every_rank_a_micro_batch_and_a_data_spec_is_checked_later():
    assert TrainConfig(dataset_size=96, micro_batch=32).check_world(3) == 1
    assert refused_world(TrainConfig(dataset_size=95, micro_batch=32), 3) == (
        "dataset_size=95 gives each of world_size=3 ranks 31 samples, fewer than micro_batch=32; raise dataset_size "
        "to >= 96 or lower micro_batch"
    )
    spec = TrainConfig(model="app.worker.models:DeepMLP", loss="mse", data="x:y", dataset_size=1, micro_batch=32)
    assert spec.check_world(3) == 1  # its size is known once it is built (app.worker.workload)


def test_the_last_local_process_may_listen_on_port_65535():
    assert TrainConfig(metrics_port=65533).check_world(1, local_world_size=3) == 1  # 65533..65535
    assert refused_world(TrainConfig(metrics_port=65534), 1, 3) == (
        "metrics_port=65534: the 3 processes on this machine would listen on ports up to 65536 > 65535; choose "
        "metrics_port <= 65533, or 0 for no metrics"
    )


def test_an_effective_batch_may_equal_the_world_size_and_the_data_set():
    assert TrainConfig(effective_batch=4, micro_batch=1).check_world(4) == 1
    assert refused_world(TrainConfig(effective_batch=3), 4) == (
        "effective_batch=3 is smaller than world_size=4: every rank needs at least one sample per step; raise "
        "effective_batch to >= 4 or run fewer ranks"
    )
    assert TrainConfig(effective_batch=64, dataset_size=64).check_world(2) == 1
    assert refused_world(TrainConfig(effective_batch=65, dataset_size=64, micro_batch=1), 1) == (
        "effective_batch=65 is larger than dataset_size=64: one step would need more samples than an epoch holds; "
        "raise dataset_size or lower effective_batch"
    )
    spec = TrainConfig(model="app.worker.models:DeepMLP", loss="mse", data="x:y", effective_batch=65, dataset_size=64)
    assert spec.check_world(1) == 3  # a data spec's size is not dataset_size: 65 in micro-batches of <= 32


def test_grad_accum_steps_is_what_check_world_returns():
    assert TrainConfig(grad_accum_steps=3).check_world(2) == 3
    assert TrainConfig(effective_batch=256, micro_batch=32).check_world(2) == 4
    assert TrainConfig(effective_batch=128, micro_batch=32, grad_accum_steps=2).check_world(2) == 2  # they agree
    message = refused_world(TrainConfig(effective_batch=100, micro_batch=32, grad_accum_steps=2), 2)
    assert message.startswith("effective_batch=100 disagrees with micro_batch=32 × grad_accum_steps=2 × world_size=2")


def test_the_global_batch_is_the_effective_batch_when_set_and_else_grows_with_the_world():
    assert TrainConfig(effective_batch=96).global_batch(4, 7) == 96
    assert TrainConfig(micro_batch=8).global_batch(4, 3) == 96
    assert TrainConfig(micro_batch=8).global_batch(2, 1) == 16


def test_a_pipeline_replicas_batch_is_micro_batch_or_its_share_of_the_effective_batch():
    assert TrainConfig(parallel="pipeline", pipeline_stages=2, micro_batch=16).pipeline_batch(6) == 16
    assert TrainConfig(parallel="pipeline", pipeline_stages=2, effective_batch=96).pipeline_batch(6) == 32


def test_as_dict_holds_every_setting_by_value():
    d = TrainConfig(steps=7, loss_kwargs={"reduction": "sum"}).as_dict()
    assert d["steps"] == 7 and d["loss_kwargs"] == {"reduction": "sum"}
    assert TrainConfig(**d) == TrainConfig(steps=7, loss_kwargs={"reduction": "sum"})


def test_each_config_gets_its_own_keyword_mappings():
    one, two = TrainConfig(), TrainConfig()
    one.model_kwargs["hidden"] = 8
    assert two.model_kwargs == {} and TrainConfig().model_kwargs == {}


def test_device_cuda_without_a_visible_gpu_is_refused_at_the_world_check(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    import torch

    if torch.cuda.is_available():  # CUDA initialised earlier in this process: the variable comes too late
        pytest.skip("a GPU is visible to this process")
    assert refused_world(TrainConfig(device="cuda"), 1) == (
        "device=cuda: no CUDA device is visible here (torch.cuda.is_available() is False); use device=auto or "
        "device=cpu, or run on a machine with a GPU"
    )
    assert TrainConfig(device="cpu").check_world(1) == 1
