"""Model, data and loss as import specs in the worker's config (app.worker.config, app.worker.workload).

What a user notices: the specs and their keywords arrive the same from YAML (a mapping), the environment and flags
(a JSON object); a spec that does not import, keywords the callable does not take, a callable that builds no
``nn.Module``, samples that do not fit the model, a loss that is not a scalar: one line naming the setting, the
spec and the cause, exit code 2, and (the ``python -m app.train`` tests) before the rank waits for its peer.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from app.worker.config import ConfigError, TrainConfig, load_config
from app.worker.workload import build_dataset, build_loss, build_model, check_workload, model_name
from tests.trainer_run import clean_env, free_port, run_module

USER = {"DDP_MODEL": "tests.models_user:SmallNet", "DDP_DATA": "tests.models_user:ClassificationDataset"}


def config(argv=(), env=None):
    return load_config(list(argv), env or {}).config


def test_specs_and_keywords_from_yaml_env_and_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: tests.models_user:SmallNet\nmodel_kwargs: {hidden: 4}\n"
        "data: tests.models_user:ClassificationDataset\ndata_kwargs:\n  size: 64\n"
        "loss: tests.models_user:scaled_cross_entropy\nloss_kwargs: {scale: 2.0}\n"
    )
    cfg = config(["--config", str(path)])
    assert (cfg.model_kwargs, cfg.data_kwargs, cfg.loss_kwargs) == ({"hidden": 4}, {"size": 64}, {"scale": 2.0})
    env = {"DDP_MODEL_KWARGS": '{"hidden": 8}', "DDP_DATA_KWARGS": '{"size": 96}'}
    resolved = load_config(["--config", str(path), "--model-kwargs", '{"hidden": 12}'], env)
    assert resolved.config.model_kwargs == {"hidden": 12}  # flag > env > file
    assert resolved.config.data_kwargs == {"size": 96}  # env > file
    assert resolved.sources["model_kwargs"] == "flag --model-kwargs"
    assert build_model(resolved.config).net[0].out_features == 12
    assert len(build_dataset(resolved.config)) == 96
    assert model_name(resolved.config) == 'tests.models_user:SmallNet {"hidden": 12}'  # what checkpoints record


def test_the_built_in_models_are_specs_with_their_own_data_and_loss():
    cfg = config(["--model", "app.worker.models:TinyTransformer", "--dataset-size", "40", "--seq-len", "8"])
    data = build_dataset(cfg)
    assert len(data) == 40 and data[0][0].shape == (8,)  # tiny_transformer's Markov data, sized by the fields
    logits = torch.zeros(2, 8, 64)
    assert build_loss(cfg)(logits, torch.zeros(2, 8, dtype=torch.long)).item() == pytest.approx(
        torch.log(torch.tensor(64.0)).item()
    )
    assert model_name(cfg) == "tiny_transformer" and model_name(config()) == "mini_mlp"  # old checkpoints resume


def test_the_benchmark_models_are_the_sizes_the_benchmark_docs_give():
    """docs/benchmarks.md describes the two benchmark models by size, and every figure there (and every checksum of
    a ``model=tiny_transformer`` run) stands on those defaults: a default that changes must change the docs too."""
    import re

    from app.worker.models import MODELS
    from tests.trainer_run import REPO

    docs = (REPO / "docs" / "benchmarks.md").read_text()
    for name in ("deep_mlp", "tiny_transformer"):
        described = re.search(rf"`{name}`: ([^`]+?), (\d+) parameter\s+tensors.*?, ([\d.]+) MiB", docs, re.S)
        assert described, f"docs/benchmarks.md no longer describes {name}'s size"
        params = list(MODELS[name]().parameters())  # tied weights once, as DDP sees them
        assert len(params) == int(described[2]), (name, described[0])
        mib = sum(p.numel() * p.element_size() for p in params) / 2**20
        assert round(mib, 1) == round(float(described[3]), 1), (name, mib, described[0])
    transformer = MODELS["tiny_transformer"]()
    assert (len(transformer.blocks), transformer.tok.embedding_dim) == (6, 64)  # "6 blocks, dim 64"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"DDP_MODEL_KWARGS": '{"hidden": 16'}, "model_kwargs='{\"hidden\": 16' (from env DDP_MODEL_KWARGS): not JSON"),
        ({"DDP_MODEL_KWARGS": "[16]"}, "model_kwargs='[16]' (from env DDP_MODEL_KWARGS): must be a mapping"),
        ({"DDP_MODEL": "tests.models_user:SmallNet"}, 'data="": model=tests.models_user:SmallNet has no built-in data'),
        (USER, 'loss="": model=tests.models_user:SmallNet is not a built-in model'),
        ({"DDP_MODEL": "SmallNet"}, "model='SmallNet': not a built-in model"),
        ({"DDP_DATA_KWARGS": '{"size": 3}'}, "data_kwargs={'size': 3}: keywords need a data spec"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(env, expected):
    with pytest.raises(ConfigError) as e:
        config(env=env)
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"model": "tests.nowhere:Net"}, "model: spec 'tests.nowhere:Net': module 'tests.nowhere' does not import"),
        ({"model_kwargs": '{"hiden": 4}'}, "unexpected keyword argument 'hiden' (it takes: hidden)"),
        ({"model": "tests.models_broken:not_a_model"}, "returned a list, not a torch.nn.Module"),
        ({"data_kwargs": '{"size": 10}'}, "10 samples, fewer than one global batch of 32"),
        (
            {"model_kwargs": '{"hidden": 4}', "model": "app.worker.models:DeepMLP"},
            "unexpected keyword argument 'hidden' (it takes: width, depth)",
        ),
        ({"loss": "tests.models_user:per_sample_loss"}, "not a scalar tensor"),
        ({"loss": "mse"}, "loss='mse' failed on the output [2, 8] float32"),
    ],
)
def test_check_workload_names_the_spec_and_the_cause(settings, expected):
    env = {**USER, "DDP_LOSS": "cross_entropy", **{f"DDP_{k.upper()}": v for k, v in settings.items()}}
    cfg = config(["--wrapper", "none"], env)
    with pytest.raises(ConfigError) as e:
        check_workload(cfg, world_size=1, grad_accum_steps=1)
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_pipelines_data_must_hold_one_batch_per_replica():
    # 2 stages: at world 2 one replica takes 32 samples a step; at world 4 two replicas take 32 each.
    cfg = config(["--parallel", "pipeline", "--pipeline-stages", "2", "--dataset-size", "40", "--wrapper", "none"])
    check_workload(cfg, world_size=2, grad_accum_steps=1)  # 40 >= 32: fits
    with pytest.raises(ConfigError) as e:
        check_workload(cfg, world_size=4, grad_accum_steps=1)
    assert "40 samples, fewer than one global batch of 64" in str(e.value) and "\n" not in str(e.value)


def test_a_model_the_samples_do_not_fit_is_named_with_both_shapes():
    cfg = config(["--model-kwargs", '{"in_features": 16}'])  # mini_mlp's own data has 32 features
    with pytest.raises(ConfigError) as e:
        check_workload(cfg, world_size=1, grad_accum_steps=1)
    assert str(e.value).startswith("model='mini_mlp': its forward failed on the first samples of ")
    assert "(input [2, 32] float32, target [2] int64): RuntimeError: mat1 and mat2" in str(e.value)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"DDP_MODEL": "tests.nowhere:Net"}, "module 'tests.nowhere' does not import"),
        ({"DDP_MODEL_KWARGS": '{"hiden": 4}'}, "unexpected keyword argument 'hiden'"),
        ({"DDP_MODEL": "tests.models_broken:not_a_model"}, "returned a list, not a torch.nn.Module"),
    ],
)
def test_the_worker_exits_2_in_one_line_before_waiting_for_its_peer(env, expected):
    # Rank 0 of a world of 2 whose rank 1 never comes: a check after the rendezvous would wait its 300 s out.
    port = free_port()
    rank0 = clean_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank0.update({**USER, "DDP_LOSS": "cross_entropy", "DDP_RENDEZVOUS_TIMEOUT_SECONDS": "300", **env})
    started = time.monotonic()
    result = run_module("app.train", "--metrics-port", "0", timeout=200, env=rank0)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: model: spec ") and expected in lines[0], lines
    assert time.monotonic() - started < 150  # no rendezvous wait (300 s); the torch import is the rest


def loss_that_warns(out, y):
    """A loss that runs but warns, as PyTorch's mse_loss does of a target it broadcasts."""
    warnings.warn("Using a target size that is different to the input size: broadcasting", UserWarning, stacklevel=2)
    return torch.nn.functional.cross_entropy(out, y)


def test_a_loss_that_runs_but_warns_is_let_through_with_its_warning_shown():
    # The check catches a failing loss's warnings (they would be a second line after its one-line error); a loss
    # that runs must still show them, once, at start-up: a broadcast target trains on, silently wrong otherwise.
    cfg = config(["--wrapper", "none"], {**USER, "DDP_LOSS": "tests.unit.test_workload:loss_that_warns"})
    with pytest.warns(UserWarning, match="broadcasting") as shown:
        check_workload(cfg, world_size=1, grad_accum_steps=1)
    assert len([w for w in shown if "broadcasting" in str(w.message)]) == 1


def two_tensors(size: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """A data spec that returns ``(inputs, targets)`` tensors instead of a data set."""
    gen = torch.Generator().manual_seed(size)
    return torch.randn(size, 32, generator=gen), torch.randint(0, 8, (size,), generator=gen)


def test_a_data_spec_returning_inputs_and_targets_trains_on_those_inputs_with_those_targets():
    cfg = config(["--wrapper", "none"], {"DDP_DATA": "tests.unit.test_workload:two_tensors"})
    data = build_dataset(cfg)
    inputs, targets = two_tensors()
    assert torch.equal(data.inputs, inputs) and torch.equal(data.targets, targets)
    check_workload(cfg, world_size=1, grad_accum_steps=1)  # and mini_mlp takes them as they come


class RaggedData:
    """A map-style data set whose samples differ in shape: no batch can be stacked from them."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(32 + i % 2), torch.tensor(0)


def test_samples_that_do_not_stack_into_a_batch_are_one_line_at_start_up():
    cfg = config(["--wrapper", "none"], {"DDP_DATA": "tests.unit.test_workload:RaggedData"})
    with pytest.raises(ConfigError) as e:
        check_workload(cfg, world_size=1, grad_accum_steps=1)
    assert str(e.value).startswith("data='tests.unit.test_workload:RaggedData': samples 0 and 1 do not stack")
    assert "\n" not in str(e.value)


class TensorOnlyData:
    """A map-style data set whose samples are one tensor each, no target: a common slip in a user's data set."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.zeros(2, 32)  # indexable as if it were a pair: only the type check can tell


def test_a_sample_that_is_not_an_input_target_pair_is_one_line_at_start_up():
    cfg = config(["--wrapper", "none"], {"DDP_DATA": "tests.unit.test_workload:TensorOnlyData"})
    with pytest.raises(ConfigError) as e:
        check_workload(cfg, world_size=1, grad_accum_steps=1)
    assert str(e.value) == (
        "data='tests.unit.test_workload:TensorOnlyData': a sample is a Tensor, not an (input, target) tensor pair"
    )


class Stream:
    """A re-iterable stream (``__iter__`` only, no ``__len__``): 40 samples of mini_mlp's shapes."""

    def __iter__(self):
        gen = torch.Generator().manual_seed(0)
        return ((torch.randn(32, generator=gen), torch.tensor(i % 8)) for i in range(40))


def test_a_stream_passes_the_start_up_check_on_its_first_two_samples():
    # A stream has no len() and no data[i]: the check must read it as the training loop will, by iterating.
    cfg = config(["--wrapper", "none"], {"DDP_DATA": "tests.unit.test_workload:Stream"})
    check_workload(cfg, world_size=1, grad_accum_steps=1)  # a refusal here would be exit 2 for a valid stream


@pytest.mark.parametrize(
    "flags, at_buckets, units",
    [
        (["--compile", "aot_eager"], True, []),  # our DDP: the model whole, cut at its buckets
        (["--compile", "aot_eager", "--parallel", "zero1"], True, []),  # zero1 is our DDP too
        (
            ["--compile", "aot_eager", "--compile-units", "Linear"],
            False,
            ["net.0", "net.2", "net.4"],
        ),  # named: asked for
        (["--compile", "aot_eager", "--parallel", "zero2"], False, ["net.0", "net.2", "net.4"]),  # stage 2: per unit
        (["--compile", "aot_eager", "--wrapper", "torch"], False, []),  # PyTorch's DDP compiled whole (DDPStep)
        (["--compile", "none"], False, []),
    ],
)
def test_compile_cuts_our_ddp_at_its_buckets_and_the_other_kinds_per_unit(flags, at_buckets, units):
    from app.worker.workload import compiled_units, compiles_at_buckets

    cfg = config(["--model", "mini_mlp", *flags])
    assert compiles_at_buckets(cfg) is at_buckets
    assert list(compiled_units(cfg, build_model(cfg))) == units


def test_a_pipeline_of_a_model_that_is_not_its_children_in_order_is_refused_at_start_up():
    # The start-up check runs the model's children in order on a sample and compares with its forward: a model whose
    # forward is something else (a residual around its first layer) would train another function cut in stages.
    env = {**USER, "DDP_MODEL": "tests.models_user:ResidualNet", "DDP_LOSS": "cross_entropy"}
    cfg = config(["--parallel", "pipeline", "--pipeline-stages", "2", "--micro-batch", "8", "--wrapper", "none"], env)
    with pytest.raises(ConfigError) as e:
        check_workload(cfg, world_size=2, grad_accum_steps=1)
    assert str(e.value).startswith(
        "parallel=pipeline with model='tests.models_user:ResidualNet': ResidualNet's forward is not its children in "
        "order (inner, head): the chain gives another output;"
    ) and str(e.value).endswith(", or use parallel=ddp"), str(e.value)


def test_the_built_in_data_set_is_sized_and_seeded_by_the_settings_and_a_spec_takes_its_own_keywords():
    from app.worker.workload import data_spec

    assert data_spec(TrainConfig(dataset_size=50, seed=3)) == ("teacher_classification", {"size": 50, "seed": 3})
    transformer = TrainConfig(model="tiny_transformer", dataset_size=40, seq_len=8, seed=1)
    assert data_spec(transformer) == ("markov_sequences", {"size": 40, "seed": 1, "seq_len": 8})
    spec = TrainConfig(data="tests.models_user:ClassificationDataset", data_kwargs={"size": 64})
    assert data_spec(spec) == ("tests.models_user:ClassificationDataset", {"size": 64})


def test_each_built_in_model_brings_its_own_loss_and_a_loss_spec_gets_its_keywords():
    out, target = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    ce = torch.nn.functional.cross_entropy(out, target)
    assert build_loss(TrainConfig())(out, target) == ce  # mini_mlp: cross_entropy
    deep = TrainConfig(model="deep_mlp", data="tests.models_user:ClassificationDataset")
    assert build_loss(deep)(out, torch.zeros(2, 2)) == torch.nn.functional.mse_loss(out, torch.zeros(2, 2))
    scaled = TrainConfig(loss="tests.models_user:scaled_cross_entropy", loss_kwargs={"scale": 2.0})
    assert build_loss(scaled)(out, target) == 2 * ce


def test_a_data_set_is_built_once_per_process_and_other_settings_build_another():
    first = build_dataset(TrainConfig(dataset_size=48, seed=5))
    assert build_dataset(TrainConfig(dataset_size=48, seed=5)) is first  # the step kind gets the checked object
    other = build_dataset(TrainConfig(dataset_size=48, seed=6))
    assert other is not first and not torch.equal(other.inputs, first.inputs)
    assert len(build_dataset(TrainConfig(dataset_size=40, seed=5))) == 40


def test_without_a_held_out_share_the_whole_data_set_trains():
    from app.worker.workload import build_splits

    data = build_dataset(TrainConfig(dataset_size=64))
    train, held = build_splits(TrainConfig(dataset_size=64))
    assert train is data and held is None


def test_a_map_style_data_set_is_split_by_position_into_its_first_and_last_samples():
    from app.worker.workload import build_splits

    cfg = TrainConfig(data="tests.unit.test_workload:RaggedData", eval_fraction=0.25)
    train, held = build_splits(cfg)
    assert (list(train.indices), list(held.indices)) == (list(range(30)), list(range(30, 40)))
    assert torch.equal(held[0][0], RaggedData()[30][0])


@pytest.mark.parametrize("fraction, held", [(0.01, 0), (0.99, 40)])
def test_a_share_that_leaves_either_side_empty_is_one_line(fraction, held):
    from app.worker.workload import build_splits

    cfg = TrainConfig(data="tests.unit.test_workload:RaggedData", eval_fraction=fraction)
    with pytest.raises(ConfigError) as e:
        build_splits(cfg)
    assert str(e.value) == (
        f"eval_fraction={fraction} of data='tests.unit.test_workload:RaggedData''s 40 samples holds out {held}; "
        "choose a fraction that leaves at least one sample on each side"
    )


def unequal_tensors():
    return torch.zeros(10, 32), torch.zeros(9, dtype=torch.long)


def a_number():
    return 7


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tests.unit.test_workload:unequal_tensors", "inputs have 10 samples, targets 9"),
        (
            "tests.unit.test_workload:a_number",
            "returned a int, not a map-style data set (__len__, __getitem__), an iterable of (input, target) pairs, "
            "nor (inputs, targets) tensors",
        ),
    ],
)
def test_a_data_spec_that_returns_no_data_set_is_one_line(spec, message):
    with pytest.raises(ConfigError) as e:
        build_dataset(TrainConfig(data=spec))
    assert str(e.value) == f"data={spec!r}: {message}"


class ShortStream:
    """A stream of 10 samples: fewer than one global batch of 32."""

    def __iter__(self):
        return ((torch.zeros(32), torch.tensor(0)) for _ in range(10))


class FailingStream:
    """A stream whose first read fails (its files gone, say)."""

    def __iter__(self):
        return self._read()

    def _read(self):
        raise OSError("the bucket is gone")
        yield  # a generator: the error comes with the first sample, not from iter()


class FailingData:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        raise KeyError(i)


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "ShortStream",
            "10 samples, fewer than one global batch of 32; give the data set more samples, or lower "
            "micro_batch or effective_batch",
        ),
        ("FailingStream", "reading the stream raised OSError: the bucket is gone"),
        ("FailingData", "reading sample 0 raised KeyError: 0"),
    ],
)
def test_data_that_cannot_give_a_first_batch_is_one_line_at_start_up(spec, message):
    cfg = TrainConfig(data=f"tests.unit.test_workload:{spec}")
    with pytest.raises(ConfigError) as e:
        check_workload(cfg, world_size=1, grad_accum_steps=1)
    assert str(e.value) == f"data='tests.unit.test_workload:{spec}': {message}"


def test_a_global_batch_of_exactly_the_data_sets_size_passes():
    check_workload(TrainConfig(dataset_size=64, micro_batch=16), world_size=2, grad_accum_steps=2)
    with pytest.raises(
        ConfigError, match=r"^data='teacher_classification': 64 samples, fewer than one global batch of"
    ):
        check_workload(TrainConfig(dataset_size=64, micro_batch=16), world_size=2, grad_accum_steps=3)


def mean_as_float(out, y):
    return float(torch.nn.functional.cross_entropy(out, y))


def test_a_loss_that_returns_a_number_not_a_tensor_is_one_line():
    cfg = TrainConfig(loss="tests.unit.test_workload:mean_as_float", dataset_size=64)
    with pytest.raises(ConfigError) as e:
        check_workload(cfg, world_size=1, grad_accum_steps=1)
    assert str(e.value).startswith("loss='tests.unit.test_workload:mean_as_float': returned float  on the first")
    assert str(e.value).endswith("not a scalar tensor; reduce it to a mean over the samples")


@pytest.mark.parametrize("model", ["mini_mlp", "tiny_transformer"])
def test_float64_runs_the_model_and_its_float_inputs_in_float64_and_leaves_token_ids_whole(model):
    # mini_mlp's float features are cast with the model; tiny_transformer's token ids stay integers for its table.
    check_workload(TrainConfig(model=model, dtype="float64", dataset_size=64, seq_len=8), 1, 1)


def test_a_pipeline_is_cut_where_pipeline_split_says_or_balanced_by_parameters():
    from app.worker.workload import pipeline_split

    model = build_model(TrainConfig())
    assert pipeline_split(TrainConfig(parallel="pipeline"), model, 3) == ["net.2", "net.4"]
    assert pipeline_split(TrainConfig(parallel="pipeline", pipeline_split="net.4"), model, 2) == ["net.4"]
    with pytest.raises(ConfigError) as e:
        pipeline_split(TrainConfig(parallel="pipeline", pipeline_split="net.9"), model, 2)
    assert str(e.value).startswith("pipeline_split='net.9' with model='mini_mlp': 'net.9' is not a module of")
    with pytest.raises(ConfigError) as e:
        pipeline_split(TrainConfig(parallel="pipeline"), model, 4)
    assert str(e.value) == (
        "pipeline_stages=4 with model='mini_mlp': 4 stages but the model's sequence has 3 module(s) with parameters: "
        "use at most 3 stages"
    )


@pytest.mark.parametrize(
    "settings, whole",
    [
        ({"wrapper": "torch"}, True),
        ({"wrapper": "torch", "parallel": "zero1"}, True),
        ({"wrapper": "torch", "parallel": "zero2"}, False),
        ({"wrapper": "ours"}, False),
        ({"wrapper": "torch", "compile": "none"}, False),
    ],
)
def test_only_pytorchs_ddp_under_ddp_or_zero1_is_compiled_whole(settings, whole):
    from app.worker.workload import compiled_units, compiles_wrapper_whole

    cfg = TrainConfig(**{"compile": "aot_eager", **settings})
    assert compiles_wrapper_whole(cfg) is whole
    if whole:
        assert compiled_units(cfg, build_model(cfg)) == {}


def test_compile_units_that_name_nothing_say_what_the_model_has():
    from app.worker.workload import compiled_units

    cfg = TrainConfig(compile="aot_eager", parallel="zero2", compile_units="Conv2d")
    with pytest.raises(ConfigError) as e:
        compiled_units(cfg, build_model(cfg))
    assert str(e.value) == (
        "compile_units='Conv2d': Conv2d names no module class of MiniMLP (it has Linear, ReLU, Sequential); name "
        "those (with parameters), or leave it empty"
    )


def loss_that_warns_and_fails(out, y):
    warnings.warn("Using a target size that is different to the input size", UserWarning, stacklevel=2)
    raise ValueError("Target size (torch.Size([2]))\n    must be the same as input size")


def test_a_failing_loss_is_one_line_with_its_cause_folded_and_none_of_its_warnings():
    cfg = config(["--wrapper", "none"], {"DDP_LOSS": "tests.unit.test_workload:loss_that_warns_and_fails"})
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with pytest.raises(ConfigError) as e:
            check_workload(cfg, world_size=1, grad_accum_steps=1)
    assert str(e.value) == (
        "loss='tests.unit.test_workload:loss_that_warns_and_fails' failed on the output [2, 8] float32 of "
        "model='mini_mlp' and the first samples of data='teacher_classification' (input [2, 32] float32, target [2] "
        "int64): ValueError: Target size (torch.Size([2])) must be the same as input size"
    )
    assert [str(w.message) for w in shown if "target size" in str(w.message)] == []  # it would be a second line


def test_the_recorded_model_name_is_the_same_whatever_order_its_keywords_came_in():
    # A resume compares it with the checkpoint's: the same keywords from a YAML file and from JSON in another order
    # must not be told apart.
    one = TrainConfig(model="deep_mlp", data="x:y", model_kwargs={"width": 8, "depth": 2})
    other = TrainConfig(model="app.worker.models:DeepMLP", data="x:y", model_kwargs={"depth": 2, "width": 8})
    assert model_name(one) == model_name(other) == 'deep_mlp {"depth": 2, "width": 8}'
