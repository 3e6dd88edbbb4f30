"""Configuration: precedence (flag > env > file > default) and one-line errors with exit code 2.

The exit-code tests run the real worker (``python -m app.train``) as a user would; a bad value fails before torch
is imported or any process group is joined.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from app.worker.config import FIELDS, ConfigError, TrainConfig, load_config
from tests.trainer_run import REPO, clean_env, run_module


def write(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_are_the_contracts():
    cfg = load_config([], {}).config
    assert (cfg.model, cfg.steps, cfg.micro_batch, cfg.seed, cfg.wrapper) == ("mini_mlp", 200, 32, 0, "ours")
    assert (cfg.bucket_cap_mb, cfg.checkpoint_dir, cfg.checkpoint_every, cfg.keep_checkpoints) == (25, "", 50, 3)
    assert (cfg.metrics_port, cfg.metrics_linger_seconds, cfg.rendezvous_timeout_seconds, cfg.log_every) == (
        9400,
        0,
        60,
        10,
    )
    assert cfg.check_world(1) == 1  # grad_accum_steps defaults to 1


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    path = write(tmp_path, "steps: 11\nlr: 0.5\nmicro_batch: 8\nseed: 3\n")
    env = {"DDP_STEPS": "22", "DDP_LR": "0.25"}
    resolved = load_config(["--config", path, "--steps", "33"], env)
    cfg = resolved.config
    assert cfg.steps == 33  # flag beats env and file
    assert cfg.lr == 0.25  # env beats file
    assert (cfg.micro_batch, cfg.seed) == (8, 3)  # file beats default
    assert cfg.model == "mini_mlp"  # default
    assert resolved.sources["steps"] == "flag --steps"
    assert resolved.sources["lr"] == "env DDP_LR"
    assert resolved.sources["seed"] == f"config file {path}"


def test_config_file_from_env_and_example_file_loads():
    resolved = load_config([], {"DDP_CONFIG": str(REPO / "configs" / "example.yaml")})
    assert resolved.sources["model"].startswith("config file")
    assert resolved.config.checkpoint_every >= 1


def test_effective_batch_sets_accumulation_per_world_size():
    cfg = load_config(["--effective-batch", "256", "--micro-batch", "32"], {}).config
    assert cfg.check_world(4) == 2 and cfg.check_world(2) == 4
    # The global batch is held fixed at any world size: 256 over 3 ranks is 86/85/85, each in 3 micro-batches.
    assert cfg.check_world(3) == 3 and cfg.global_batch(3, 3) == 256
    with pytest.raises(ConfigError, match=r"^effective_batch=256 is smaller than world_size=300"):
        cfg.check_world(300)
    with pytest.raises(ConfigError, match=r"^effective_batch=256 is larger than dataset_size=200"):
        TrainConfig(effective_batch=256, dataset_size=200).check_world(1)
    assert TrainConfig(micro_batch=32, grad_accum_steps=2).global_batch(3, 2) == 192  # no effective_batch: grows


def test_zero3_refuses_a_global_batch_whose_smallest_share_cannot_fill_every_ranks_micro_batches():
    # Stage 3 reduce-scatters after each micro-batch, so every rank runs as many as the largest share needs. 4 over
    # 3 ranks is 2/1/1 samples: with micro_batch=1 rank 0 needs 2, and the others cannot cut 1 sample into 2 (it
    # hung before this check, seen in tests/integration/test_train_composed.py).
    cfg = TrainConfig(parallel="zero3", effective_batch=4, micro_batch=1)
    with pytest.raises(ConfigError) as e:
        cfg.check_world(3)
    assert str(e.value) == (
        "parallel=zero3: effective_batch=4 over world_size=3 leaves some ranks 1 samples for the 2 micro-batches of "
        "micro_batch <= 1 every rank runs (zero3 reduce-scatters after each one); set effective_batch to a multiple "
        "of 3 (e.g. 6) or raise micro_batch"
    )
    assert cfg.check_world(2) == 2 and cfg.check_world(4) == 1  # even shares
    assert TrainConfig(parallel="zero3", effective_batch=12, micro_batch=2).check_world(5) == 2  # 3/3/2/2/2: 2 each
    assert TrainConfig(parallel="zero2", effective_batch=4, micro_batch=1).check_world(3) == 2  # no_sync: one sync


def test_zero3_ranks_cut_unequal_shares_into_equal_micro_batch_counts():
    from app.worker.data import BatchShare

    def sizes(world, equal):
        return [BatchShare(12, 2, r, world, "cpu", None, equal_counts=equal).sizes for r in range(world)]

    assert sizes(5, False) == [[2, 1], [2, 1], [2], [2], [2]]  # ddp and zero1/2: one sync per step, any counts
    assert sizes(5, True) == [[2, 1], [2, 1], [1, 1], [1, 1], [1, 1]]  # zero3: a reduce-scatter per micro-batch


def test_world_checks_name_the_fields():
    with pytest.raises(ConfigError, match=r"^dataset_size=48 .* micro_batch=32; raise dataset_size to >= 64"):
        TrainConfig(dataset_size=48, micro_batch=32).check_world(2)
    assert TrainConfig(dataset_size=64, micro_batch=32).check_world(2) == 1
    with pytest.raises(ConfigError, match=r"^metrics_port=65534: .* up to 65537"):
        TrainConfig(metrics_port=65534).check_world(1, local_world_size=4)
    assert TrainConfig(metrics_port=65532).check_world(1, local_world_size=4) == 1
    assert TrainConfig(metrics_port=0).check_world(1, local_world_size=4) == 1  # 0 = no metrics: no port at all


def test_unknown_env_setting_is_an_error_with_the_nearest_name():
    # A typo must not train at the default: DDP_STPES=5 once ran all 200 steps with a warning few would read.
    with pytest.raises(ConfigError, match=r"^DDP_STPES: no such setting \(did you mean DDP_STEPS\?\)"):
        load_config([], {"DDP_STPES": "5"})
    with pytest.raises(ConfigError, match=r"^DDP_ZZZZZZZZ: no such setting"):
        load_config([], {"DDP_ZZZZZZZZ": "1", "DDP_STEPS": "5"})
    assert load_config([], {"DDP_CONFIG": "", "DDP_STEPS": "5", "OTHER": "x"}).config.steps == 5


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"steps": 0}, "steps"),
        ({"model": "resnet"}, "model"),
        ({"wrapper": "horovod"}, "wrapper"),
        ({"lr": 0.0}, "lr"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"metrics_port": -1}, "metrics_port"),
        ({"grad_accum_steps": 0}, "grad_accum_steps"),
        ({"collective_timeout_seconds": 0}, "collective_timeout_seconds"),
        ({"model": "tiny_transformer", "seq_len": 65}, "seq_len"),
        ({"dtype": "float16"}, "dtype"),
        ({"dtype": "float64", "parallel": "pipeline", "pipeline_stages": 2}, "dtype"),
        ({"autocast": "fp8"}, "autocast"),
        ({"autocast": "bf16", "dtype": "float64"}, "autocast"),
        ({"lr_schedule": "step"}, "lr_schedule"),
        ({"warmup_steps": 201}, "warmup_steps"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"grad_clip_norm": -1.0}, "grad_clip_norm"),
        ({"lr_reference_batch": -64}, "lr_reference_batch"),
        ({"autocast": "bf16", "lr_schedule": "cosine", "parallel": "dp"}, "autocast"),
        ({"grad_clip_norm": 1.0, "parallel": "dp"}, "grad_clip_norm"),
        ({"pipeline_split": "net.2"}, "pipeline_split"),  # parallel=ddp: nothing to split
        ({"pipeline_split": "net.2,,net.4", "parallel": "pipeline"}, "pipeline_split"),
        ({"min_step_seconds": -0.01}, "min_step_seconds"),
        ({"metrics_linger_seconds": -1.0}, "metrics_linger_seconds"),
        ({"eval_every": 5}, "eval_every"),  # nothing held out to evaluate
        ({"eval_every": -1}, "eval_every"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"eval_fraction": -0.1}, "eval_fraction"),
        ({"eval_every": 5, "eval_fraction": 0.1, "parallel": "zero3"}, "eval_every"),
        ({"compile": "max-autotune"}, "compile"),
        ({"compile": "aot_eager", "parallel": "dp"}, "compile"),
        ({"compile": "aot_eager", "activation_checkpointing": "units"}, "compile"),
        ({"compile": "aot_eager", "wrapper": "torch", "bucket_cap_mb": 0.5}, "compile"),  # DDPOptimizer's 1 MiB
        ({"compile_units": "Block"}, "compile_units"),  # compile off: nothing to compile
        ({"overlap_gather": 1}, "overlap_gather"),  # parallel=ddp: no all-gather to overlap
        ({"overlap_gather": 2, "parallel": "zero2"}, "overlap_gather"),
        ({"prefetch": 1, "parallel": "zero2"}, "prefetch"),
        ({"prefetch": -1, "parallel": "zero3"}, "prefetch"),
        ({"reshard_after_forward": 0, "parallel": "zero2"}, "reshard_after_forward"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"^{field}="):
        TrainConfig(**kwargs)


# The real worker, as a user runs it: one line on stderr naming the field, exit code 2, no traceback.
BAD = {
    "negative steps": (["--steps", "-5"], {}, "steps=-5"),
    "unknown model": (["--model", "resnet50"], {}, "model='resnet50'"),
    "unknown wrapper": (["--wrapper", "horovod"], {}, "wrapper='horovod'"),
    "effective_batch below the world size": (["--effective-batch", "1"], {"WORLD_SIZE": "2"}, "effective_batch=1"),
    "effective_batch disagreeing with grad_accum_steps": (
        ["--effective-batch", "100", "--grad-accum-steps", "2"],
        {"WORLD_SIZE": "2"},
        "effective_batch=100 disagrees with micro_batch=32 × grad_accum_steps=2 × world_size=2",
    ),
    "non-numeric env": ([], {"DDP_MICRO_BATCH": "lots"}, "micro_batch='lots' (from env DDP_MICRO_BATCH)"),
    "bad yaml key": (["--config", "@bad.yaml"], {}, "unknown setting 'stpes'"),
    "wrapper none with 2 ranks": (["--wrapper", "none"], {"WORLD_SIZE": "2"}, "wrapper=none with world_size=2"),
    "unknown flag": (["--stpes", "5"], {}, "--stpes"),
    "the recipe with DataParallel": (
        ["--autocast", "bf16", "--parallel", "dp"],
        {},
        "autocast=bf16: the recipe runs with parallel=ddp|pipeline|zero1|zero2|zero3 (not yet in the dp step); "
        "unset it, or use one of those",
    ),
    "compile_units naming no module": (
        ["--compile", "aot_eager", "--compile-units", "Block"],
        {},
        "compile_units='Block': Block names no module class of MiniMLP",
    ),
    "unknown env setting": ([], {"DDP_STESP": "10"}, "DDP_STESP: no such setting (did you mean DDP_STEPS?)"),
    "env value of the wrong type": ([], {"DDP_LR": "abc"}, "lr='abc' (from env DDP_LR): must be a float"),
    "data set smaller than one micro-batch": (
        ["--dataset-size", "16", "--micro-batch", "32"],
        {},
        "dataset_size=16 gives each of world_size=1 ranks 16 samples, fewer than micro_batch=32",
    ),
    "one micro-batch in all, two ranks": (
        ["--dataset-size", "48", "--micro-batch", "32"],
        {"WORLD_SIZE": "2"},
        "dataset_size=48 gives each of world_size=2 ranks 24 samples",
    ),
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on GPU machines too.
    "device cuda without a GPU": (["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": ""}, "device=cuda: no CUDA device"),
    "metrics port past 65535": (
        ["--metrics-port", "65535"],
        {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
        "metrics_port=65535: the 2 processes on this machine would listen on ports up to "
        "65536 > 65535; choose metrics_port <= 65534",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_one_line(case, tmp_path):
    args, env, expected = BAD[case]
    (tmp_path / "bad.yaml").write_text("stpes: 5\n")
    args = [str(tmp_path / a[1:]) if a.startswith("@") else a for a in args]
    result = run_module("app.train", "--metrics-port", "0", *args, timeout=60, env=clean_env(**env))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr


def test_torchrun_variables_are_read_once_with_the_elastic_range():
    from app.worker.config import WorldEnv

    assert WorldEnv.from_environ({}) == WorldEnv()  # no torchrun: a world of one
    static = WorldEnv.from_environ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert (static.rank, static.local_rank, static.world_size, static.local_world_size) == (3, 1, 4, 2)
    assert (static.min_world_size, static.max_world_size) == (4, 4)
    elastic = WorldEnv.from_environ(
        {
            "RANK": "0",
            "WORLD_SIZE": "6",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "2",
            "PET_NNODES": "2:4",  # torchrun --nnodes given through its environment, which the workers inherit
            "TORCHELASTIC_RESTART_COUNT": "3",
        }
    )
    assert (elastic.min_world_size, elastic.max_world_size) == (4, 8)
    assert (elastic.node, elastic.restart_count) == ("2", 3)


# A worker under torchrun reads the elastic range from torchrun's own command line (its parent's), where --nnodes
# may be written as one word (--nnodes=2:4) or two (--nnodes 2:4). The parent here stands in for torchrun.
CHILD = (
    "from app.worker.config import WorldEnv; "
    "w = WorldEnv.from_environ({'TORCHELASTIC_RUN_ID': 'r', 'RANK': '0', 'WORLD_SIZE': '4', 'LOCAL_WORLD_SIZE': '2'}); "
    "print(w.min_world_size, w.max_world_size)"
)
PARENT = "import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', sys.argv[1]]).returncode)"


@pytest.mark.parametrize("flag", [["--nnodes=2:4"], ["--nnodes", "2:4"]], ids=["one-word", "two-words"])
def test_the_elastic_range_is_read_from_torchruns_nnodes_in_either_spelling(flag):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", PARENT, CHILD, *flag], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["4", "8"], "2..4 nodes of 2 ranks each: a world of 4 to 8 ranks"


def test_the_compose_settings_run_sets_every_field():
    """The e2e run that sends every setting through compose must name each field; checked here, without Docker,
    so a new field fails in seconds rather than after a 30-minute CI run."""
    from tests.e2e.test_compose_cluster import EVERY_SETTING

    assert set(EVERY_SETTING) == set(FIELDS), "give the new field a value in EVERY_SETTING: it must reach the workers"


@pytest.mark.parametrize("route", ["flag", "env", "file"])
def test_every_setting_arrives_by_each_documented_route(route, tmp_path):
    """Each field, set by a flag alone, by DDP_<NAME> alone or by a YAML key alone, is the value the trainer runs
    with, and its source says so (the e2e run sends the same values through compose: EVERY_SETTING)."""
    from app.worker.config import convert
    from tests.e2e.test_compose_cluster import EVERY_SETTING

    expected = TrainConfig(**{name: convert(name, raw, "test") for name, raw in EVERY_SETTING.items()})
    argv, env = [], {}
    if route == "flag":
        argv = [arg for name, raw in EVERY_SETTING.items() for arg in (f"--{name.replace('_', '-')}", raw)]
    elif route == "env":
        env = {f"DDP_{name.upper()}": raw for name, raw in EVERY_SETTING.items()}
    else:  # YAML as a user writes it: numbers, strings, a mapping
        argv = ["--config", write(tmp_path, "".join(f"{n}: {r or repr('')}\n" for n, r in EVERY_SETTING.items()))]
    resolved = load_config(argv, env)
    assert resolved.config == expected
    prefix = {"flag": "flag --", "env": "env DDP_", "file": "config file "}[route]
    assert [n for n in EVERY_SETTING if not resolved.sources[n].startswith(prefix)] == []


def test_yaml_reads_off_and_no_as_the_words_a_user_wrote(tmp_path):
    # YAML 1.1 turns off/on/yes/no into booleans: `activation_checkpointing: off` was refused as 'False'.
    path = write(tmp_path, "activation_checkpointing: off\nautocast: none\n")
    cfg = load_config(["--config", path], {}).config
    assert (cfg.activation_checkpointing, cfg.autocast) == ("off", "none")
    with pytest.raises(ConfigError, match="steps=True"):  # true/false stay booleans, as in YAML 1.2
        load_config(["--config", write(tmp_path, "steps: true\n")], {})


def test_the_config_flag_wins_over_ddp_config(tmp_path):
    flag_file, env_file = tmp_path / "flag.yaml", tmp_path / "env.yaml"
    flag_file.write_text("steps: 11\n")
    env_file.write_text("steps: 22\nseed: 5\n")
    resolved = load_config(["--config", str(flag_file)], {"DDP_CONFIG": str(env_file)})
    assert (resolved.config.steps, resolved.config.seed) == (11, 0)  # one file is read, the flag's, not a merge
    assert resolved.sources["steps"] == f"config file {flag_file}"
    assert load_config([], {"DDP_CONFIG": str(env_file)}).config.steps == 22


@pytest.mark.parametrize(
    ("text", "kind"), [("- steps: 5\n", "list"), ("- steps\n- lr\n", "list"), ("200\n", "int"), ("steps\n", "str")]
)
def test_a_config_file_that_is_not_a_mapping_is_one_line(tmp_path, text, kind):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(["--config", path], {})
    assert str(e.value) == f"config={path}: must be a mapping of setting: value, got a {kind}"


def test_a_pipeline_split_names_one_cut_per_stage_after_the_first():
    cfg = TrainConfig(parallel="pipeline", pipeline_split="net.2")
    assert cfg.pipeline_layout(2) == (2, 1)
    with pytest.raises(ConfigError, match=r"^pipeline_split='net.2' names 1 cut\(s\) for 3 stages .* name 2"):
        cfg.pipeline_layout(3)


@pytest.mark.parametrize(("world_size", "replica_batch"), [(2, 64), (4, 32), (8, 16)])
def test_a_pipelines_effective_batch_is_split_among_its_replicas(world_size, replica_batch):
    # 2 stages: world 2 is one pipeline, 4 is two replicas of it, 8 four; together they train effective_batch.
    cfg = TrainConfig(parallel="pipeline", pipeline_stages=2, effective_batch=64, pipeline_microbatches=4)
    stages, replicas = cfg.pipeline_layout(world_size)
    assert (stages, replicas) == (2, world_size // 2)
    assert cfg.pipeline_batch(world_size) == replica_batch and replica_batch * replicas == 64
    assert TrainConfig(parallel="pipeline", pipeline_stages=2, micro_batch=32).pipeline_batch(world_size) == 32


def test_an_effective_batch_the_replicas_cannot_split_names_the_multiple_to_choose():
    cfg = TrainConfig(parallel="pipeline", pipeline_stages=2, effective_batch=64, pipeline_microbatches=3)
    message = (
        "effective_batch=64 does not split into 2 replicas x pipeline_microbatches=3 equal micro-batches; "
        "choose a multiple of 6"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        cfg.pipeline_layout(4)


def test_seq_len_bounds_only_the_transformers_built_in_sequences():
    # 64 is the transformer's number of positions: the longest sequence it can take is allowed, and seq_len, read
    # only by the built-in token data of model=tiny_transformer, is no reason to refuse another model.
    assert TrainConfig(model="tiny_transformer", seq_len=64).seq_len == 64
    assert TrainConfig(model="mini_mlp", seq_len=128).seq_len == 128


def test_a_bad_value_names_where_it_was_set(tmp_path):
    # The field's source follows the error, so a user knows which of flag, environment or file to fix.
    with pytest.raises(ConfigError, match=r"^lr=-1.0: must be > 0 \(set by env DDP_LR\)$"):
        load_config([], environ={"DDP_LR": "-1"})
    with pytest.raises(ConfigError, match=r"\(set by flag --lr\)$"):
        load_config(["--lr", "-1"], environ={})
    path = tmp_path / "train.yaml"
    path.write_text("lr: -1\n")
    with pytest.raises(ConfigError, match=rf"\(set by config file {path}\)$"):
        load_config(["--config", str(path)], environ={})


@pytest.mark.parametrize("value", [["width"], "width=8", {1: 8}])
def test_keyword_arguments_that_are_no_mapping_of_names_are_refused(value):
    with pytest.raises(ConfigError, match=r"^model_kwargs=.*must be a mapping of keyword: value"):
        TrainConfig(model="app.worker.models:MiniMLP", loss="cross_entropy", model_kwargs=value)


def test_a_positive_clip_norm_is_accepted_and_a_negative_one_refused():
    assert TrainConfig(grad_clip_norm=1.0).grad_clip_norm == 1.0
    assert TrainConfig(grad_clip_norm=0.0).grad_clip_norm == 0.0  # off
    with pytest.raises(ConfigError, match="grad_clip_norm"):
        TrainConfig(grad_clip_norm=-0.5)


@pytest.mark.parametrize("microbatches, ok", [(4, True), (8, True), (32, True), (5, False), (3, False)])
def test_pipeline_micro_batches_are_accepted_exactly_when_they_divide_the_micro_batch(microbatches, ok):
    def make():
        return TrainConfig(parallel="pipeline", micro_batch=32, pipeline_microbatches=microbatches)

    if ok:
        assert make().pipeline_microbatches == microbatches
    else:
        with pytest.raises(ConfigError, match=f"pipeline_microbatches={microbatches} does not divide micro_batch=32"):
            make()


@pytest.mark.parametrize("steps, ok", [(None, True), (1, True), (2, False), (4, False)])
def test_the_pipeline_refuses_gradient_accumulation_of_more_than_one_step(steps, ok):
    """With parallel=pipeline its micro-batches are the accumulation: grad_accum_steps 2 or more is refused."""

    def make():
        return TrainConfig(parallel="pipeline", micro_batch=32, grad_accum_steps=steps)

    if ok:
        assert make().grad_accum_steps == steps
    else:
        with pytest.raises(ConfigError, match=f"grad_accum_steps={steps}: with parallel=pipeline"):
            make()


def test_a_whole_number_written_as_a_float_is_taken_for_a_count_and_a_fraction_refused(tmp_path):
    # YAML reads `steps: 4.0` as a float: a count that says a whole number is that number, and 4.5 steps is no count
    # (int() would quietly round it down).
    assert load_config(["--config", write(tmp_path, "steps: 4.0\n")], {}).config.steps == 4
    with pytest.raises(ConfigError, match=r"^steps"):
        load_config(["--config", write(tmp_path, "steps: 4.5\n")], {})


@pytest.mark.parametrize("value, ok", [(0, True), (1, True), (2, False), (-1, False)])
def test_desync_check_is_off_or_on_and_nothing_else(value, ok):
    if ok:
        assert TrainConfig(desync_check=value).desync_check == value
    else:
        with pytest.raises(ConfigError, match=rf"^desync_check={value}: must be 0 \(off\) or 1 \(on\)$"):
            TrainConfig(desync_check=value)


@pytest.mark.parametrize("value, every", [("off", 0), ("units", 1), ("every:1", 1), ("every:3", 3)])
def test_activation_checkpointing_every_reads_each_documented_form(value, every):
    from app.worker.config.checks import activation_checkpointing_every

    assert activation_checkpointing_every(value) == every


@pytest.mark.parametrize("value", ["every:0", "every:", "every:-1", "each:2"])
def test_activation_checkpointing_every_refuses_a_step_below_one_in_one_line(value):
    from app.worker.config.checks import activation_checkpointing_every

    with pytest.raises(ConfigError, match=r"N an integer >= 1") as err:
        activation_checkpointing_every(value)
    assert "\n" not in str(err.value)


def test_parallel_dp_without_two_gpus_names_what_is_missing():
    # device=cpu rules dp out whatever the GPUs; the error says so only when it is what the user set.
    import torch  # (check_world's own import: the rest of this file runs without torch)

    gpus = torch.cuda.device_count()
    if gpus >= 2:
        pytest.skip("this machine has >= 2 GPUs: parallel=dp with device=auto is valid here")
    with pytest.raises(ConfigError) as cpu:
        TrainConfig(parallel="dp", device="cpu").check_world(1)
    assert str(cpu.value) == (
        f"parallel=dp needs CUDA with >= 2 GPUs; {gpus} visible and device=cpu: use parallel=ddp (any device), "
        "or run on a machine with >= 2 GPUs"
    )
    with pytest.raises(ConfigError) as auto:
        TrainConfig(parallel="dp").check_world(1)
    assert str(auto.value).startswith(f"parallel=dp needs CUDA with >= 2 GPUs; {gpus} visible: use parallel=ddp")


def test_the_settings_digest_is_the_same_whatever_order_a_mappings_keys_came_in():
    # Two containers given the same loss_kwargs in another JSON key order must not be told their settings differ.
    from app.worker.config.load import digest

    one = TrainConfig(loss_kwargs={"label_smoothing": 0.1, "reduction": "mean"})
    other = TrainConfig(loss_kwargs={"reduction": "mean", "label_smoothing": 0.1})
    assert digest(one) == digest(other)
    assert digest(one) != digest(TrainConfig(loss_kwargs={"label_smoothing": 0.2, "reduction": "mean"}))


def test_a_local_rank_without_local_world_size_counts_itself_and_the_ranks_below_it():
    # A launcher that sets LOCAL_RANK but not LOCAL_WORLD_SIZE: local rank 3 means at least 4 processes on this node.
    from app.worker.config import WorldEnv

    assert WorldEnv.from_environ({"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4"}).local_world_size == 4
