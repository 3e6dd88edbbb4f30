"""What a run trains: the model, data set and loss its config names, built from specs, tried before any rank waits.

    # a model of your own, with its own data and loss (YAML: model_kwargs etc. are mappings)
    python -m app.train --wrapper none --model mypkg.models:build --model-kwargs '{"hidden": 16}' \\
        --data mypkg.data:train_set --loss torch.nn:CrossEntropyLoss
    DDP_MODEL=mypkg.models:build DDP_MODEL_KWARGS='{"hidden": 16}' DDP_DATA=mypkg.data:train_set ...

The built-in models are entries of the same mechanism (``MODEL_SPECS``, ``DATA_SPECS``, ``LOSS_SPECS`` in
app.specs): ``model: mini_mlp`` is ``app.worker.models:MiniMLP``, and with ``data`` unset it trains on its own data
set (``MODEL_DATA``: ``teacher_classification`` sized by ``dataset_size``), with its own loss (``MODEL_LOSS``).

``check_workload(cfg, ...)`` is what ``app.train`` calls after the config check and before the process group forms:
it imports every spec, checks the keywords against each callable's signature, builds the data set and the model,
and runs one sample through the model and the loss. Whatever is wrong becomes a ``ConfigError`` of one line naming
the setting, the spec and the cause (exit 2), on every rank alike, so no rank is left waiting for one that failed.
The data set it built is kept (``build_dataset``): the step kind gets the same object, not a second read of files.
"""

from __future__ import annotations

import json
import warnings
from itertools import islice
from typing import Any

import torch
from torch import nn
from torch.utils.data import Subset

from app.cli import first_line
from app.parallel.activation_checkpointing import candidate_units, every_nth
from app.parallel.compile import default_units
from app.parallel.pipeline.split import check_sequence, model_sequence, split_names, stage_ranges
from app.specs import DATA_SPECS, LOSS_SPECS, MODEL_DATA, MODEL_LOSS, MODEL_SPECS, SpecError, build, builtin_name
from app.specs import build_loss as build_loss_spec
from app.specs import build_model as build_model_spec
from app.worker.checkpoint.weights import WeightsError, load_model_state, read_model_state
from app.worker.config import ConfigError, TrainConfig
from app.worker.config.checks import activation_checkpointing_every, pipeline_cuts
from app.worker.data import Dataset
from app.worker.data_stream import is_stream, resumable

_DATASETS: dict[str, Any] = {}  # data spec + kwargs (JSON) -> the data set built for it in this process


def model_name(cfg: TrainConfig) -> str:
    """What checkpoints record as the model (``model_name``): the built-in name or the spec, and the keywords when
    any, so a resume with another model or other keywords is refused (``mini_mlp`` stays ``mini_mlp``)."""
    name = builtin_name(cfg.model, MODEL_SPECS) or cfg.model
    return f"{name} {json.dumps(cfg.model_kwargs, sort_keys=True)}" if cfg.model_kwargs else name


def data_spec(cfg: TrainConfig) -> tuple[str, dict[str, Any]]:
    """The data spec and its keywords: ``data``/``data_kwargs``, or the built-in model's own set sized by the fields."""
    if cfg.data:
        return cfg.data, cfg.data_kwargs
    spec = MODEL_DATA[builtin_name(cfg.model, MODEL_SPECS)]
    kwargs = {"size": cfg.dataset_size, "seed": cfg.seed}
    return spec, kwargs | ({"seq_len": cfg.seq_len} if spec == "markov_sequences" else {})


def build_model(cfg: TrainConfig) -> nn.Module:
    """The model ``cfg.model`` names, built with ``model_kwargs`` (seed the RNG first for equal ranks), with the
    weights of ``init_from`` if it names any (app.worker.weights: names and shapes must match)."""
    model = _as_config_error("model", lambda: build_model_spec(cfg.model, cfg.model_kwargs))
    if cfg.init_from:
        try:
            load_model_state(model, read_model_state(cfg.init_from), cfg.init_from)
        except WeightsError as e:
            raise ConfigError(f"init_from={cfg.init_from!r}: {first_line(str(e))}") from None
    return model


def checkpointed_units(cfg: TrainConfig, model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` that ``activation_checkpointing`` names in ``model`` (``{}``: off); ConfigError if none."""
    every = activation_checkpointing_every(cfg.activation_checkpointing)
    if not every:
        return {}
    classes = [n.strip() for n in cfg.activation_checkpointing_units.split(",") if n.strip()]
    try:
        units = candidate_units(model, classes)
    except ValueError as e:
        if classes:
            raise ConfigError(
                f"activation_checkpointing_units={cfg.activation_checkpointing_units!r}: {e}; name those, or leave "
                f"it empty"
            ) from None
        raise ConfigError(
            f"activation_checkpointing={cfg.activation_checkpointing}: {e}; name its block classes in "
            f"activation_checkpointing_units, or set activation_checkpointing=off"
        ) from None
    chosen = every_nth(units, every)
    if not chosen:
        raise ConfigError(
            f"activation_checkpointing={cfg.activation_checkpointing}: {type(model).__name__} has {len(units)} "
            f"units ({next(iter(units))} .. {list(units)[-1]}), so every {every}th names none; choose "
            f"N <= {len(units)}, or units"
        )
    return chosen


def compiles_wrapper_whole(cfg: TrainConfig) -> bool:
    """Whether ``compile`` compiles PyTorch's DDP wrapper whole (``wrapper=torch``, parallel=ddp|zero1: dynamo's
    DDPOptimizer cuts the graph at its buckets, the way PyTorch documents) instead of the model's units one by one."""
    return cfg.compile != "none" and cfg.wrapper == "torch" and cfg.parallel in ("ddp", "zero1")


def compiles_at_buckets(cfg: TrainConfig) -> bool:
    """Whether ``compile`` compiles our DDP's module whole, its graph cut at the buckets (app.parallel.compile's
    ``compile_at_buckets``): wrapper=ours, parallel=ddp|zero1, unless ``compile_units`` names units to compile one by
    one."""
    return (
        cfg.compile != "none" and cfg.wrapper == "ours" and cfg.parallel in ("ddp", "zero1") and not cfg.compile_units
    )


def compiled_units(cfg: TrainConfig, model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` that ``compile`` compiles one by one (app.parallel.compile: a wrapper's gradient hooks fire
    between them); ``{}`` when none or when the module is compiled whole. ConfigError (one line) if none is found."""
    if cfg.compile == "none" or compiles_wrapper_whole(cfg) or compiles_at_buckets(cfg):
        return {}
    classes = [n.strip() for n in cfg.compile_units.split(",") if n.strip()]
    try:
        return default_units(model, classes)
    except ValueError as e:
        fix = "name those (with parameters), or leave it empty" if classes else "name its block classes"
        raise ConfigError(f"compile_units={cfg.compile_units!r}: {e}; {fix}") from None


def build_loss(cfg: TrainConfig):
    """``loss(output, target) -> scalar``: ``loss`` with ``loss_kwargs``, or the built-in model's own loss."""
    spec = cfg.loss or MODEL_LOSS[builtin_name(cfg.model, MODEL_SPECS)]
    return _as_config_error("loss", lambda: build_loss_spec(spec, cfg.loss_kwargs, LOSS_SPECS))


def build_dataset(cfg: TrainConfig):
    """The data set (built once per process and kept): a ``Dataset``, or a map-style set of (input, target)."""
    spec, kwargs = data_spec(cfg)
    key = json.dumps([spec, kwargs], sort_keys=True, default=str)
    if key not in _DATASETS:
        data = _as_config_error("data", lambda: build(spec, kwargs, aliases=DATA_SPECS))
        _DATASETS[key] = _as_data_set(data, spec)
    return _DATASETS[key]


def build_splits(cfg: TrainConfig) -> tuple[Any, Any | None]:
    """The training set and the held-out validation set: the data set's last ``eval_fraction`` of samples (None
    when 0). Cut by position, not shuffled: the same split on every rank and every run."""
    data = build_dataset(cfg)
    if not cfg.eval_fraction:
        return data, None
    spec = data_spec(cfg)[0]
    if is_stream(data):
        raise ConfigError(
            f"eval_fraction={cfg.eval_fraction}: data={spec!r} is a stream, which has no last samples to hold out; "
            f"set eval_fraction=0 and eval_every=0"
        )
    held = round(len(data) * cfg.eval_fraction)
    if not 0 < held < len(data):
        raise ConfigError(
            f"eval_fraction={cfg.eval_fraction} of data={spec!r}'s {len(data)} samples holds out {held}; choose a "
            f"fraction that leaves at least one sample on each side"
        )
    return _subset(data, 0, len(data) - held), _subset(data, len(data) - held, len(data))


def _subset(data: Any, start: int, stop: int):
    if isinstance(data, Dataset):  # still two tensors: GlobalBatches indexes them whole
        return Dataset(data.inputs[start:stop], data.targets[start:stop])
    return Subset(data, range(start, stop))


def _as_data_set(data: Any, spec: str):
    """A ``Dataset`` for ``(inputs, targets)`` tensors; a map-style set as it is; anything else a ConfigError."""
    if isinstance(data, Dataset):
        return data
    if isinstance(data, tuple | list) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        if len(data[0]) != len(data[1]):
            raise ConfigError(f"data={spec!r}: inputs have {len(data[0])} samples, targets {len(data[1])}")
        return Dataset(data[0], data[1])
    if is_stream(data):
        if why := resumable(data):
            raise ConfigError(
                f"data={spec!r}: {why}; return a re-iterable data set (a class whose __iter__ starts the stream "
                f"over) or give it state_dict()/load_state_dict()"
            )
        return data
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise ConfigError(
            f"data={spec!r}: returned a {type(data).__name__}, not a map-style data set (__len__, __getitem__), "
            f"an iterable of (input, target) pairs, nor (inputs, targets) tensors"
        )
    return data


def check_workload(cfg: TrainConfig, world_size: int, grad_accum_steps: int) -> None:
    """Build and try the model, loss and data on two samples; ConfigError (one line) on the first problem."""
    model = build_model(cfg).to(getattr(torch, cfg.dtype))  # the cheap ones first: a bad spec fails before any read
    checkpointed_units(cfg, model)
    compiled_units(cfg, model)
    loss_fn = build_loss(cfg)
    data, spec = build_splits(cfg)[0], data_spec(cfg)[0]
    shares = cfg.pipeline_layout(world_size)[1] if cfg.parallel == "pipeline" else world_size
    global_batch = cfg.pipeline_batch(world_size) * shares if cfg.parallel == "pipeline" else None
    global_batch = global_batch or cfg.global_batch(world_size, grad_accum_steps)
    available = _count_samples(data, spec, global_batch)
    if available < global_batch:
        raise ConfigError(
            f"data={spec!r}: {available} samples, fewer than one global batch of {global_batch}; "
            f"give the data set more samples, or lower micro_batch or effective_batch"
        )
    x, y = _first_samples(data, spec, cfg.dtype)
    what = f"the first samples of data={spec!r} (input {_shape(x)}, target {_shape(y)})"
    try:
        out = model(x)
    except Exception as e:
        raise ConfigError(f"model={cfg.model!r}: its forward failed on {what}: {_cause(e)}") from None
    if cfg.parallel == "pipeline":
        pipeline_split(cfg, model, cfg.pipeline_layout(world_size)[0], sample=x)
    loss_name = cfg.loss or MODEL_LOSS[builtin_name(cfg.model, MODEL_SPECS)]
    try:
        with warnings.catch_warnings(record=True) as caught:  # a failing loss's warnings would be a second line
            warnings.simplefilter("always")
            loss = loss_fn(out, y)
    except Exception as e:
        raise ConfigError(
            f"loss={loss_name!r} failed on the output {_shape(out)} of model={cfg.model!r} and {what}: {_cause(e)}"
        ) from None
    for w in caught:  # it ran: what it warned of (a broadcast target, ...) is worth seeing
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(
            f"loss={loss_name!r}: returned {type(loss).__name__} {_shape(loss)} on {what}, not a scalar tensor; "
            f"reduce it to a mean over the samples"
        )


def pipeline_split(
    cfg: TrainConfig, model: nn.Module, num_stages: int, sample: torch.Tensor | None = None
) -> list[str]:
    """Where ``model`` is cut into ``num_stages`` (``pipeline_split``, or balanced by parameter count): the names
    where stages 2.. begin. With ``sample``, first proves the model is its sequence of children (check_workload).
    ConfigError (one line naming the setting) when it cannot be cut, or not there."""
    cuts = pipeline_cuts(cfg.pipeline_split)
    sequence = model_sequence(model)
    if sample is not None:
        try:
            check_sequence(model, sequence, sample)
        except ValueError as e:
            raise ConfigError(f"parallel=pipeline with model={cfg.model!r}: {e}, or use parallel=ddp") from None
    try:
        return split_names(sequence, stage_ranges(sequence, num_stages, cuts))
    except ValueError as e:
        setting = f"pipeline_split={cfg.pipeline_split!r}" if cuts else f"pipeline_stages={num_stages}"
        raise ConfigError(f"{setting} with model={cfg.model!r}: {e}") from None


def _count_samples(data: Any, spec: str, at_most: int) -> int:
    """``len(data)``; for a stream, how many of its first ``at_most`` samples a pass yields (read, not kept)."""
    if not is_stream(data):
        return len(data)
    try:
        return sum(1 for _ in islice(iter(data), at_most))
    except Exception as e:
        raise ConfigError(f"data={spec!r}: reading the stream raised {_cause(e)}") from None


def _first_samples(data: Any, spec: str, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples 0 and 1, stacked as GlobalBatches stacks them (two: BatchNorm refuses a batch of one in train mode)."""
    try:
        samples = list(islice(iter(data), 2)) if is_stream(data) else [data[i] for i in range(min(2, len(data)))]
    except Exception as e:
        raise ConfigError(f"data={spec!r}: reading sample 0 raised {_cause(e)}") from None
    for s in samples:
        if not (isinstance(s, tuple | list) and len(s) == 2 and all(isinstance(t, torch.Tensor) for t in s)):
            raise ConfigError(f"data={spec!r}: a sample is a {type(s).__name__}, not an (input, target) tensor pair")
    try:
        x, y = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
    except RuntimeError as e:
        raise ConfigError(f"data={spec!r}: samples 0 and 1 do not stack into a batch: {_cause(e)}") from None
    return (x.to(getattr(torch, dtype)) if x.is_floating_point() else x), y


def _as_config_error(field: str, make):
    try:
        return make()
    except SpecError as e:
        raise ConfigError(f"{field}: {e}") from None


def _shape(t: Any) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" if isinstance(t, torch.Tensor) else ""


def _cause(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"
