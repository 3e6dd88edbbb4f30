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

from app.worker.config import ConfigError, load_config
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
