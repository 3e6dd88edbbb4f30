"""The launchers' settings: ``LaunchConfig``, read from ``LAUNCH_*`` variables once and validated, torch-free.

The cluster's launcher (``app.cluster.launch``) reads them before anything else, so a bad value is one line naming
the variable and exit 2, before the seconds-long torch import; the local-world launcher (``app.world``) and the
tests' worker starts read ``fork`` from here too::

    LAUNCH_STORE_WAIT_SECONDS=60 python -m app.cluster.launch ...   # wait longer for the rendezvous store
    LAUNCH_FORK=0 make test                                          # every process a fresh interpreter

Not ``DDP_*`` names: the cluster forwards every ``DDP_*`` variable to the trainer, which refuses one it does not
know. A ``LAUNCH_*`` name that matches no field is refused as well, with the nearest one as a hint: a typo must not
run silently at the default.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from app.worker.config.checks import ConfigError

LAUNCH_PREFIX = "LAUNCH_"


@dataclass(frozen=True)
class LaunchConfig:
    """Every ``LAUNCH_<FIELD>`` setting; its default where the variable is unset or empty."""

    store_wait_seconds: float = 30.0  # how long the launcher waits for the rendezvous store to answer at start
    # A store lost mid-run (crashed and restarted, or this container cut off) is waited for this long before the
    # agent joins it again: longer than the start-up wait, since the others may need a re-formation first.
    store_lost_seconds: float = 120.0
    peers: str = ""  # the DNS name of every replica (compose: the service's): the job's first world waits for all
    peers_wait_seconds: float = 90.0  # how long the first world waits for every replica's launcher to be ready
    # Docker's DNS lists a replica only once its container runs; `up --scale worker=N` on a busy machine starts the
    # N containers seconds apart, and the first ones could all be ready before the last is even listed. The first
    # world forms only once no new address has appeared for this long.
    peers_settle_seconds: float = 3.0
    # Before the first world, with every replica ready: how long after each arrival the rest are waited for (then
    # the world forms without them, as torch's last call would). Below join_timeout, so a member that is in never
    # times out waiting for one that is not coming.
    first_world_hold_seconds: float = 30.0
    # A container can sit in the full world's redundancy list for a moment while a lost member's keep-alive
    # expires; longer than this, it is one container too many.
    redundant_grace_seconds: float = 20.0
    state_dir: str = ""  # where each job's ending is recorded (app.cluster.job_state); "" keeps nothing
    # 1: processes that run torch code are forked from one that has imported torch (the container's trainer, a
    # local world's ranks, the tests' workers); 0: each is a new interpreter. bench/startup.py measures it.
    fork: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float" and not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{env_name(f.name)}={value!r}: must be a number of seconds >= 0")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchConfig:
        """The settings ``environ`` (default ``os.environ``) gives; ``ConfigError`` names the first bad one.

        Example::

            >>> LaunchConfig.from_environ({"LAUNCH_PEERS": "worker", "LAUNCH_FORK": "0"}).fork
            False
        """
        environ = os.environ if environ is None else environ
        known = {env_name(f.name): f for f in fields(cls)}
        values = {}
        for name, raw in environ.items():
            if not name.startswith(LAUNCH_PREFIX):
                continue
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean {near[0]}?" if near else "known: " + ", ".join(known)
                raise ConfigError(f"{name}: no such launcher setting; {hint} (unset it)")
            if raw.strip():
                values[known[name].name] = _convert(name, known[name].type, raw.strip())
        return cls(**values)


def env_name(field: str) -> str:
    return LAUNCH_PREFIX + field.upper()


def _convert(name: str, kind: str, raw: str) -> float | bool | str:
    if kind == "bool":
        if raw not in ("0", "1"):
            raise ConfigError(f"{name}={raw!r}: must be 1 (on) or 0 (off)")
        return raw == "1"
    if kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r}: must be a number of seconds >= 0 (e.g. {name}=30)") from None
    return raw
