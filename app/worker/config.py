"""The trainer's configuration: one documented dataclass, filled from defaults, a YAML file, the environment, flags.

Precedence, highest first::

    CLI flag --field-name   >   env DDP_FIELD_NAME   >   YAML file (--config PATH or env DDP_CONFIG)   >   default

So ``DDP_STEPS=100 torchrun ... -m app.train --config configs/example.yaml --lr 0.01`` takes ``lr`` from the flag,
``steps`` from the environment and the rest from the file or the defaults. The names are flat (``micro_batch``,
not ``train.micro_batch``) because the environment and the flags are flat: one name per setting everywhere.

A bad value raises ``ConfigError``, whose message is one line naming the field, where the value came from and the
fix; ``app.train`` prints it and exits with code 2. This module does not import torch, so a bad flag fails fast.

Run ``python -m app.train --help`` for the flags with their documentation.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from app.parallel import WRAPPERS

ENV_PREFIX = "DDP_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"  # the YAML file's path, when not given with --config

MODEL_CHOICES = ("mini_mlp", "tiny_transformer")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
PARALLEL_CHOICES = ("ddp", "pipeline", "dp")
SCHEDULE_CHOICES = ("gpipe", "1f1b")
DTYPE_CHOICES = ("float32", "float64")
PIPELINE_MAX_STAGES = {"mini_mlp": 3}  # its Linear layers: a stage without one would only pass activations on


class ConfigError(ValueError):
    """A bad configuration value; ``str()`` is the one-line message shown to the user."""


def _doc(text: str, default: Any = MISSING) -> Any:
    # The text becomes the flag's --help line and the README's table: one line, with the unit.
    return field(default=default, metadata={"doc": text})


@dataclass
class TrainConfig:
    """Everything a training run can be told. Validated on construction (``__post_init__``)."""

    # -- workload -------------------------------------------------------------------------------------------------
    model: str = _doc("model to train: mini_mlp | tiny_transformer", "mini_mlp")
    steps: int = _doc("optimizer steps in the whole run (a resumed run continues up to this step)", 200)
    micro_batch: int = _doc("samples per forward/backward on one rank", 32)
    grad_accum_steps: int | None = _doc(
        "micro-batches per optimizer step, per rank (default 1; or set effective_batch instead)", None
    )
    effective_batch: int | None = _doc(
        "samples per optimizer step over all ranks, held fixed at any world size: the ranks split it (unevenly "
        "when it does not divide) and each accumulates micro-batches of at most micro_batch",
        None,
    )
    lr: float = _doc("AdamW learning rate", 0.003)
    dtype: str = _doc(
        "precision of parameters, gradients and inputs: float32 | float64 (parallel=ddp only; float64 keeps runs on "
        "different world sizes equal to ~1e-15, where float32 rounding can tip a ReLU: docs/cluster.md)",
        "float32",
    )
    seed: int = _doc(
        "seed of the parameters and the data (same on every rank); per-rank randomness uses seed + rank", 0
    )
    dataset_size: int = _doc("samples in the generated data set (generated deterministically from seed)", 16384)
    seq_len: int = _doc("tokens per sequence (tiny_transformer only)", 32)
    # -- distribution ---------------------------------------------------------------------------------------------
    wrapper: str = _doc(
        "data-parallel wrapper: ours (app.parallel.ddp) | torch (PyTorch's DDP) | none (world size 1 only)", "ours"
    )
    bucket_cap_mb: float = _doc("DDP bucket size in MiB", 25.0)
    parallel: str = _doc(
        "how the ranks share the work: ddp (data parallel) | pipeline (one model stage per rank, "
        "app.worker.pipeline_trainer) | dp (nn.DataParallel: one process, >= 2 GPUs)",
        "ddp",
    )
    pipeline_stages: int = _doc(
        "parallel=pipeline: stages per pipeline (0 = world size); the world holds world_size / stages replicas", 0
    )
    pipeline_microbatches: int = _doc(
        "parallel=pipeline: micro-batches each replica's batch per step (micro_batch, or its share of "
        "effective_batch) is cut into; must divide it",
        4,
    )
    pipeline_schedule: str = _doc("parallel=pipeline: gpipe | 1f1b (1f1b needs microbatches >= stages)", "gpipe")
    device: str = _doc("auto (CUDA + NCCL when a GPU is visible, else CPU + gloo) | cpu | cuda", "auto")
    rendezvous_timeout_seconds: float = _doc(
        "seconds to reach MASTER_ADDR:MASTER_PORT and form the group (one deadline for both)", 60.0
    )
    collective_timeout_seconds: float = _doc(
        "the formed group's timeout for every collective, in seconds: a hung peer is detected after this long; "
        "must outlast the slowest checkpoint write (the other ranks wait in a collective meanwhile)",
        300.0,
    )
    # -- checkpoints ----------------------------------------------------------------------------------------------
    checkpoint_dir: str = _doc('directory for checkpoints, shared by all ranks ("" = no checkpoints)', "")
    checkpoint_every: int = _doc("write a checkpoint every this many optimizer steps (and at the end)", 50)
    keep_checkpoints: int = _doc("checkpoints to keep (older ones are deleted)", 3)
    # -- observability --------------------------------------------------------------------------------------------
    metrics_port: int = _doc(
        "base port of the Prometheus /metrics endpoint; each process listens on "
        "metrics_port + LOCAL_RANK (0 = no metrics)",
        9400,
    )
    metrics_linger_seconds: float = _doc(
        "keep /metrics up this long after training, so Prometheus scrapes the final values", 0.0
    )
    log_every: int = _doc("rank 0 logs a progress line every this many steps", 10)
    # -- stopping -------------------------------------------------------------------------------------------------
    stop_timeout_seconds: float = _doc(
        "after SIGTERM/SIGINT, force-exit (code 1) if the graceful stop has not finished within this many seconds", 10.0
    )
    inject_nan_at_step: int = _doc("failure drill: the last rank's loss becomes NaN at this step (0 = off)", 0)

    def __post_init__(self) -> None:
        _choice("model", self.model, MODEL_CHOICES)
        _choice("wrapper", self.wrapper, WRAPPERS)
        _choice("device", self.device, DEVICE_CHOICES)
        _choice("parallel", self.parallel, PARALLEL_CHOICES)
        _choice("pipeline_schedule", self.pipeline_schedule, SCHEDULE_CHOICES)
        _choice("dtype", self.dtype, DTYPE_CHOICES)
        if self.dtype != "float32" and self.parallel != "ddp":
            raise ConfigError(f"dtype={self.dtype} works with parallel=ddp only: set dtype=float32 for {self.parallel}")
        _at_least("pipeline_stages", self.pipeline_stages, 0)
        _at_least("pipeline_microbatches", self.pipeline_microbatches, 1)
        if self.parallel == "pipeline":
            self._check_pipeline()
        for name in (
            "steps",
            "micro_batch",
            "dataset_size",
            "seq_len",
            "checkpoint_every",
            "keep_checkpoints",
            "log_every",
        ):
            _at_least(name, getattr(self, name), 1)
        for name in ("grad_accum_steps", "effective_batch"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        for name in (
            "lr",
            "bucket_cap_mb",
            "rendezvous_timeout_seconds",
            "collective_timeout_seconds",
            "stop_timeout_seconds",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be > 0")
        if self.metrics_linger_seconds < 0:
            raise ConfigError(f"metrics_linger_seconds={self.metrics_linger_seconds}: must be >= 0")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port={self.metrics_port}: must be a TCP port 1..65535, or 0 for no metrics")
        if self.inject_nan_at_step < 0:
            raise ConfigError(f"inject_nan_at_step={self.inject_nan_at_step}: must be >= 0 (0 = off)")
        if self.model == "tiny_transformer" and self.seq_len > 64:
            raise ConfigError(f"seq_len={self.seq_len}: tiny_transformer has 64 positions; choose seq_len <= 64")

    def _check_pipeline(self) -> None:
        if self.model not in PIPELINE_MAX_STAGES:
            raise ConfigError(
                f"parallel=pipeline: model={self.model} cannot be cut into stages (its blocks take a mask); "
                f"use model=mini_mlp, or parallel=ddp"
            )
        top = PIPELINE_MAX_STAGES[self.model]
        if self.pipeline_stages > top:
            raise ConfigError(
                f"pipeline_stages={self.pipeline_stages}: {self.model} has {top} layers with parameters; "
                f"use at most {top} stages"
            )
        if self.effective_batch is None and self.micro_batch % self.pipeline_microbatches:
            raise ConfigError(
                f"pipeline_microbatches={self.pipeline_microbatches} does not divide micro_batch={self.micro_batch}: "
                f"unequal micro-batches would change the loss; choose a divisor of {self.micro_batch}"
            )
        if (self.grad_accum_steps or 1) != 1:
            raise ConfigError(
                f"grad_accum_steps={self.grad_accum_steps}: with parallel=pipeline the pipeline's micro-batches "
                f"replace gradient accumulation; leave it unset (size the step with micro_batch or effective_batch)"
            )
        if self.inject_nan_at_step:
            raise ConfigError("inject_nan_at_step: the NaN drill runs with parallel=ddp only; set it to 0")

    def pipeline_layout(self, world_size: int) -> tuple[int, int]:
        """``(stages, replicas)`` of ``parallel=pipeline`` in a world of ``world_size`` ranks; ConfigError if none.

        Example::

            >>> TrainConfig(parallel="pipeline").pipeline_layout(4)
            (4, 1)
        """
        stages = self.pipeline_stages or world_size
        if stages < 2:
            raise ConfigError(
                f"parallel=pipeline with world_size={world_size}: a pipeline needs >= 2 stages, one per rank; "
                f"run >= 2 ranks (torchrun --nproc-per-node=2), or parallel=ddp"
            )
        if stages > PIPELINE_MAX_STAGES[self.model]:
            raise ConfigError(
                f"parallel=pipeline: {stages} stages (pipeline_stages=0: the world size) but {self.model} has "
                f"{PIPELINE_MAX_STAGES[self.model]} layers with parameters; set pipeline_stages to a divisor of "
                f"{world_size} up to {PIPELINE_MAX_STAGES[self.model]}"
            )
        if world_size % stages:
            raise ConfigError(
                f"pipeline_stages={stages} does not divide world_size={world_size}: run a multiple of {stages} ranks"
            )
        if self.pipeline_schedule == "1f1b" and self.pipeline_microbatches < stages:
            raise ConfigError(
                f"pipeline_schedule=1f1b needs pipeline_microbatches >= {stages} stages, got "
                f"{self.pipeline_microbatches}; raise it or use pipeline_schedule=gpipe"
            )
        replicas = world_size // stages
        if self.effective_batch is not None and self.effective_batch % (replicas * self.pipeline_microbatches):
            raise ConfigError(
                f"effective_batch={self.effective_batch} does not split into {replicas} replicas x "
                f"pipeline_microbatches={self.pipeline_microbatches} equal micro-batches; choose a multiple of "
                f"{replicas * self.pipeline_microbatches}"
            )
        return stages, replicas

    def pipeline_batch(self, world_size: int) -> int:
        """Samples one pipeline replica trains on per step: ``micro_batch``, or its share of ``effective_batch``."""
        _, replicas = self.pipeline_layout(world_size)
        return self.micro_batch if self.effective_batch is None else self.effective_batch // replicas

    def check_world(self, world_size: int, local_world_size: int = 1) -> int:
        """Checks that need the world size or this machine; returns ``grad_accum_steps`` per rank.

        ``local_world_size``: processes on this machine (torchrun's LOCAL_WORLD_SIZE), each with its own metrics port.
        """
        if self.parallel == "pipeline":
            _, replicas = self.pipeline_layout(world_size)
            world_size = replicas  # the data is dealt to the replicas; every stage of one sees the same batch
        if self.parallel == "dp" and world_size > 1:
            raise ConfigError(
                f"parallel=dp with world_size={world_size}: nn.DataParallel is one process driving every GPU; "
                f"run it without torchrun (python -m app.train --parallel dp), or use parallel=ddp"
            )
        if self.wrapper == "none" and world_size > 1 and self.parallel == "ddp":
            raise ConfigError(
                f"wrapper=none with world_size={world_size}: unsynchronised ranks would train "
                f"{world_size} different models; use wrapper=ours or wrapper=torch, or run one process"
            )
        if self.dataset_size // world_size < self.micro_batch:
            # DistributedSampler(drop_last=True) gives each rank dataset_size // world_size samples.
            raise ConfigError(
                f"dataset_size={self.dataset_size} gives each of world_size={world_size} ranks "
                f"{self.dataset_size // world_size} samples, fewer than micro_batch={self.micro_batch}; "
                f"raise dataset_size to >= {self.micro_batch * world_size} or lower micro_batch"
            )
        top = self.metrics_port + local_world_size - 1
        if self.metrics_port and top > 65535:
            raise ConfigError(
                f"metrics_port={self.metrics_port}: the {local_world_size} processes on this machine "
                f"would listen on ports up to {top} > 65535; choose metrics_port <= "
                f"{65536 - local_world_size}, or 0 for no metrics"
            )

        import torch  # only once the flags are known good: a bad flag fails before this seconds-long import

        from app.parallel.accum import grad_accum_steps_for, resolve_grad_accum_steps

        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                "device=cuda: no CUDA device is visible here (torch.cuda.is_available() is False); "
                "use device=auto or device=cpu, or run on a machine with a GPU"
            )
        if self.parallel == "dp" and (self.device == "cpu" or torch.cuda.device_count() < 2):
            raise ConfigError(
                f"parallel=dp needs CUDA with >= 2 GPUs; {torch.cuda.device_count()} visible"
                f"{' and device=cpu' if self.device == 'cpu' else ''}: use parallel=ddp (any device), "
                f"or run on a machine with >= 2 GPUs"
            )

        if self.effective_batch is not None and self.grad_accum_steps is None:
            return self._check_global_batch(world_size, grad_accum_steps_for)
        try:
            return resolve_grad_accum_steps(self.micro_batch, world_size, self.grad_accum_steps, self.effective_batch)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _check_global_batch(self, world_size: int, grad_accum_steps_for) -> int:
        if self.effective_batch < world_size:
            raise ConfigError(
                f"effective_batch={self.effective_batch} is smaller than world_size={world_size}: every rank needs "
                f"at least one sample per step; raise effective_batch to >= {world_size} or run fewer ranks"
            )
        if self.effective_batch > self.dataset_size:
            raise ConfigError(
                f"effective_batch={self.effective_batch} is larger than dataset_size={self.dataset_size}: one step "
                f"would need more samples than an epoch holds; raise dataset_size or lower effective_batch"
            )
        return grad_accum_steps_for(self.effective_batch, world_size, self.micro_batch)

    def global_batch(self, world_size: int, grad_accum_steps: int) -> int:
        """Samples per optimizer step over all ranks: ``effective_batch`` when set (the same at every world size),
        else ``micro_batch × grad_accum_steps × world_size``."""
        if self.effective_batch is not None:
            return self.effective_batch
        return self.micro_batch * grad_accum_steps * world_size

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: must be one of {' | '.join(choices)}")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{name}={value}: must be an integer >= {low}")


@dataclass(frozen=True)
class WorldEnv:
    """Where this process sits, as torchrun (or nothing: a world of one) describes it.

    ``min_world_size``/``max_world_size`` are the elastic range: torchrun's ``--nnodes MIN:MAX`` times the processes
    per node (both the world size when the world is static). ``restart_count`` is TORCHELASTIC_RESTART_COUNT: how
    often this rank's agent has restarted its workers.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node: str = "0"
    restart_count: int = 0
    min_world_size: int = 1
    max_world_size: int = 1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorldEnv:
        """Read torchrun's variables.

        Example::

            >>> WorldEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
            WorldEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, node='0', restart_count=0, ...)
        """
        environ = os.environ if environ is None else environ
        rank = int(environ.get("RANK", "0"))
        local_rank = int(environ.get("LOCAL_RANK", "0"))
        world_size = int(environ.get("WORLD_SIZE", "1"))
        local_world_size = max(int(environ.get("LOCAL_WORLD_SIZE", "1")), local_rank + 1)
        low, high = _elastic_range(environ, world_size, local_world_size)
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node=environ.get("GROUP_RANK", "0"),
            restart_count=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            min_world_size=low,
            max_world_size=high,
        )


def _elastic_range(environ: Mapping[str, str], world_size: int, local_world_size: int) -> tuple[int, int]:
    # torchrun does not pass --nnodes on to its workers. It reads it from PET_NNODES when given that way (which the
    # workers inherit), else from its own command line: the worker's parent process.
    nnodes = environ.get("PET_NNODES")
    if not nnodes and "TORCHELASTIC_RUN_ID" in environ:
        nnodes = _parent_flag("--nnodes") or "1"  # torchrun's default
    if not nnodes:
        return world_size, world_size
    low, _, high = nnodes.partition(":")
    try:
        return int(low) * local_world_size, int(high or low) * local_world_size
    except ValueError:
        return world_size, world_size


def _parent_flag(flag: str) -> str | None:
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    for i, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
    return None


# ----------------------------------------------------------------------------------------------------------------
# Loading: file < env < flags
# ----------------------------------------------------------------------------------------------------------------
FIELDS = {f.name: f for f in fields(TrainConfig)}


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(name: str) -> type:
    """int / float / str for a field, unwrapping ``X | None``."""
    hint = typing.get_type_hints(TrainConfig)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _optional(name: str) -> bool:
    return FIELDS[name].default is None


def convert(name: str, raw: Any, source: str) -> Any:
    """Turn a raw value (a string from env/flags, or a YAML scalar) into the field's type."""
    kind = _base_type(name)
    if raw is None or (isinstance(raw, str) and raw.strip() == "" and kind is not str):
        if _optional(name):
            return None
        raise ConfigError(f"{name} (from {source}) is empty: give a {kind.__name__}")
    try:
        if kind is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw) if not isinstance(raw, str) else int(raw.strip())
        if kind is float:
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if isinstance(raw, (dict, list)):
            raise ValueError
        return str(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} (from {source}): must be {'an' if kind is int else 'a'} {kind.__name__}"
        ) from None


def _unknown(name: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(name, FIELDS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(FIELDS)}"
    return ConfigError(f"unknown setting {name!r} in {source}{hint}")


def read_yaml(path: str) -> dict[str, Any]:
    source = f"config file {path}"
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"config={path}: cannot read it ({e.strerror}); pass an existing YAML file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"config={path}: not valid YAML{line} ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config={path}: must be a mapping of setting: value, got a {type(data).__name__}")
    for key in data:
        if key not in FIELDS:
            raise _unknown(str(key), source)
    return {key: convert(key, value, source) for key, value in data.items()}


def read_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """Values from ``DDP_*`` variables, and the names of ``DDP_*`` variables that match no field (typos)."""
    values: dict[str, Any] = {}
    unknown = []
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key == CONFIG_ENV:
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name in FIELDS:
            values[name] = convert(name, raw, f"env {key}")
        else:
            unknown.append(key)
    return values, unknown


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # argparse prints usage + message; we want one line
        raise ConfigError(f"{message}; run with --help for the flags")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="python -m app.train",
        description="Data-parallel training worker (run it "
        "under torchrun). Every flag also reads env DDP_<NAME> and the YAML file.",
        argument_default=argparse.SUPPRESS,
    )  # absent flags stay absent: precedence needs it
    parser.add_argument("--config", help=f"YAML file of settings (or env {CONFIG_ENV})")
    for f in fields(TrainConfig):
        default = "unset" if f.default is None else repr(f.default)
        parser.add_argument(
            flag_name(f.name),
            dest=f.name,
            metavar=_base_type(f.name).__name__.upper(),
            help=f"{f.metadata['doc']} [env {env_name(f.name)}; default {default}]",
        )
    return parser


@dataclass
class Resolved:
    config: TrainConfig
    sources: dict[str, str]  # field -> "default" | "config file X" | "env DDP_X" | "flag --x"
    warnings: list[str]


def load_config(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> Resolved:
    """Resolve the configuration from flags (``argv``), ``environ`` and the YAML file; raise ConfigError."""
    environ = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(sys.argv[1:] if argv is None else argv))
    config_path = args.pop("config", None) or environ.get(CONFIG_ENV) or None

    values: dict[str, Any] = {}
    sources: dict[str, str] = {name: "default" for name in FIELDS}
    if config_path:
        for name, value in read_yaml(config_path).items():
            values[name], sources[name] = value, f"config file {config_path}"
    env_values, unknown = read_env(environ)
    for name, value in env_values.items():
        values[name], sources[name] = value, f"env {env_name(name)}"
    for name, raw in args.items():
        values[name], sources[name] = convert(name, raw, f"flag {flag_name(name)}"), f"flag {flag_name(name)}"

    try:
        config = TrainConfig(**values)
    except ConfigError as e:
        # Say where the bad value came from: the field name starts the message.
        name = str(e).split("=", 1)[0].split(" ", 1)[0]
        if name in sources and sources[name] != "default":
            raise ConfigError(f"{e} (set by {sources[name]})") from None
        raise
    warnings = [f"ignoring {key}: no setting {key[len(ENV_PREFIX) :].lower()!r} (typo?)" for key in unknown]
    return Resolved(config, sources, warnings)


def describe(resolved: Resolved) -> str:
    """The resolved configuration, one field per line with its source, for rank 0's start-up log."""
    width = max(map(len, FIELDS))
    lines = [
        f"  {name:<{width}} = {value!r:<12} ({resolved.sources[name]})"
        for name, value in resolved.config.as_dict().items()
    ]
    return "configuration:\n" + "\n".join(lines)


def config_table_markdown() -> str:
    """The configuration table of docs/training.md, one row per ``TrainConfig`` field, from the fields themselves.

    ``make docs-config`` writes it into the docs; ``tests/unit/test_docs.py`` fails when the docs hold another one,
    so a field added here cannot be missing there.

    Example::

        >>> print(config_table_markdown().splitlines()[2])
        | `model` | `DDP_MODEL` | `--model` | `mini_mlp` | model to train: mini_mlp \\| tiny_transformer |
    """

    def cell(text: str) -> str:
        return text.replace("|", "\\|")  # a bare | would end the Markdown cell

    rows = ["| field | env | flag | default | meaning |", "|---|---|---|---|---|"]
    for f in fields(TrainConfig):
        value = f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
        default = "unset" if value is None else f"`{value!r}`" if value == "" else f"`{value}`"
        rows.append(
            f"| `{f.name}` | `{env_name(f.name)}` | `{flag_name(f.name)}` | {default} | {cell(f.metadata['doc'])} |"
        )
    return "\n".join(rows) + "\n"
