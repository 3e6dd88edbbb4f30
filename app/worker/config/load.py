"""Loading the trainer's settings: defaults < YAML file < environment < flags, into one ``TrainConfig``.

Precedence, highest first::

    CLI flag --field-name   >   env DDP_FIELD_NAME   >   YAML file (--config PATH or env DDP_CONFIG)   >   default

So ``DDP_STEPS=100 torchrun ... -m app.train --config configs/example.yaml --lr 0.01`` takes ``lr`` from the flag,
``steps`` from the environment and the rest from the file or the defaults. The names are flat (``micro_batch``,
not ``train.micro_batch``) because the environment and the flags are flat: one name per setting everywhere.

A name that matches no field is an error on every path, with the nearest field as a hint: a typo in a YAML key, a
flag, or a ``DDP_*`` variable (``DDP_STESP=10``) must not train silently at the default. A bad value raises
``ConfigError``, one line naming the field, where the value came from and the fix. A mapping field (``model_kwargs``,
``data_kwargs``, ``loss_kwargs``) is a YAML mapping in the file and a JSON object in the environment and on the
command line: ``DDP_MODEL_KWARGS='{"hidden": 16}'``, ``--model-kwargs '{"hidden": 16}'``. Torch-free, so a bad flag
fails fast. Run ``python -m app.train --help`` for the flags with their documentation.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from app.cli import OneLineParser
from app.worker.config.checks import ConfigError
from app.worker.config.schema import TrainConfig

ENV_PREFIX = "DDP_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"  # the YAML file's path, when not given with --config

FIELDS = {f.name: f for f in fields(TrainConfig)}


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(name: str) -> type:
    """int / float / str / dict for a field, unwrapping ``X | None`` and ``dict[str, Any]``."""
    hint = typing.get_type_hints(TrainConfig)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def _default(name: str) -> Any:
    f = FIELDS[name]
    return f.default_factory() if f.default is MISSING else f.default


def _optional(name: str) -> bool:
    return FIELDS[name].default is None


def convert(name: str, raw: Any, source: str) -> Any:
    """Turn a raw value (a string from env/flags, or a YAML scalar or mapping) into the field's type."""
    kind = _base_type(name)
    if kind is dict:
        return _mapping(name, raw, source)
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
    except (ValueError, TypeError):  # TypeError: a YAML list or mapping where a number belongs
        raise ConfigError(
            f"{name}={raw!r} (from {source}): must be {'an' if kind is int else 'a'} {kind.__name__}"
        ) from None


def _mapping(name: str, raw: Any, source: str) -> dict[str, Any]:
    """A mapping field (keyword arguments): a YAML mapping as it is, a string (env, flag) parsed as a JSON object."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    value = raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{name}={raw!r} (from {source}): not JSON ({e.msg} at column {e.colno}); "
                f"""give a JSON object, e.g. '{{"hidden": 16}}'"""
            ) from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(
            f"{name}={raw!r} (from {source}): must be a mapping of keyword: value (a JSON object in env and "
            f"flags), got {'a' if not isinstance(value, dict) else 'a mapping with'} "
            f"{type(value).__name__ if not isinstance(value, dict) else 'non-string keys'}"
        )
    return value


def _unknown(name: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(name, FIELDS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(FIELDS)}"
    return ConfigError(f"unknown setting {name!r} in {source}{hint}")


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true/false. YAML 1.1 also reads on/off/yes/no as
    booleans, so ``activation_checkpointing: off`` arrived as False (then "False", an unknown value)."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def read_yaml(path: str) -> dict[str, Any]:
    source = f"config file {path}"
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"config={path}: cannot read it ({e.strerror}); pass an existing YAML file") from None
    try:
        data = yaml.load(text, Loader=_Yaml12Loader)  # a SafeLoader: it builds no Python objects
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


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Values from ``DDP_*`` variables; a ``DDP_*`` name that matches no field is a ConfigError.

    An error, not a warning: a typo (``DDP_STESP``) would otherwise train at the default, and a cluster's warning
    scrolls by in the logs of N containers while the run looks fine.
    """
    values: dict[str, Any] = {}
    for key in sorted(environ):  # sorted: the same error whichever order the environment lists them in
        if not key.startswith(ENV_PREFIX) or key == CONFIG_ENV:
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = f"did you mean {env_name(close[0])}?" if close else f"the settings are {ENV_PREFIX}<FIELD>"
            raise ConfigError(f"{key}: no such setting ({hint}); unset it or fix its name (python -m app.train --help)")
        values[name] = convert(name, environ[key], f"env {key}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m app.train",
        raise_as=ConfigError,
        description="Data-parallel training worker (run it "
        "under torchrun). Every flag also reads env DDP_<NAME> and the YAML file.",
        argument_default=argparse.SUPPRESS,
    )  # absent flags stay absent: precedence needs it
    parser.add_argument("--config", help=f"YAML file of settings (or env {CONFIG_ENV})")
    for f in fields(TrainConfig):
        default = "unset" if f.default is None else repr(_default(f.name))
        kind = _base_type(f.name)
        parser.add_argument(
            flag_name(f.name),
            dest=f.name,
            metavar="JSON" if kind is dict else kind.__name__.upper(),
            help=f"{f.metadata['doc']} [env {env_name(f.name)}; default {default}]",
        )
    return parser


@dataclass
class Resolved:
    config: TrainConfig
    sources: dict[str, str]  # field -> "default" | "config file X" | "env DDP_X" | "flag --x"
    warnings: list[str]  # lines for rank 0 to log as warnings (none today: an unknown name is an error)


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
    for name, value in read_env(environ).items():
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
    return Resolved(config, sources, warnings=[])


def digest(config: TrainConfig) -> str:
    """12 hex digits that differ when any setting differs: one short line compares N containers' settings.

    Example::

        digest(load_config([], {}).config) == digest(TrainConfig())  # True
    """
    return hashlib.sha256(json.dumps(config.as_dict(), sort_keys=True).encode()).hexdigest()[:12]


def describe(resolved: Resolved) -> str:
    """The resolved configuration, one field per line with its source, for rank 0's start-up log."""
    width = max(map(len, FIELDS))
    lines = [
        f"  {name:<{width}} = {value!r:<12} ({resolved.sources[name]})"
        for name, value in resolved.config.as_dict().items()
    ]
    return "configuration:\n" + "\n".join(lines)
