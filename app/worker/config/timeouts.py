"""The run's timeouts, checked at start to be in the order that lets the right layer see a fault first.

From the shortest to the longest, each must be shorter than the ones it points at:

    checkpoint_timeout_seconds ─┬─> stop_timeout_seconds        a stop's final save must finish before the forced exit
                                └─> collective_timeout_seconds  the others wait for rank 0's write inside a collective:
                                                                a slow write must not pass for a hung rank 0
    store heartbeat ────────────┬─> collective_timeout_seconds  a dead or paused agent is dropped by the rendezvous
       (keep_alive_interval x   │                               before its peers give up on it, so the next round
        keep_alive_max_attempt) │                               forms without it instead of waiting for it
                                └─> join_timeout                and well before a round stops waiting for members
    last_call_timeout ──────────> join_timeout                  latecomers are waited for inside the round's bound

``check_trainer_timeouts(cfg)`` checks the trainer's own settings (``TrainConfig.__post_init__`` calls it);
``check_launch_timeouts(rdzv_conf, collective_timeout_seconds)`` the launcher's ``--rdzv-conf`` (torch's c10d
rendezvous defaults where a key is missing) against the trainer's collective timeout. A pair out of order is a
``ConfigError``, one line naming both values and the fix. The checkpoint write itself is only known once it happens:
a write slower than ``checkpoint_timeout_seconds`` is logged by the trainer, naming both. Torch-free.
"""

from __future__ import annotations

from app.worker.config.checks import ConfigError

# torch.distributed.elastic's c10d rendezvous defaults (DynamicRendezvousHandler, RendezvousTimeout, keep-alive).
RDZV_DEFAULTS = {
    "join_timeout": 600.0,
    "last_call_timeout": 30.0,
    "close_timeout": 30.0,
    "keep_alive_interval": 5.0,
    "keep_alive_max_attempt": 3.0,
}


def shorter(short: tuple[str, float, str], long: tuple[str, float, str]) -> None:
    """Raise unless ``short``'s value is below ``long``'s; each is ``(setting, value, what it bounds)``."""
    (s_name, s_value, s_what), (l_name, l_value, l_what) = short, long
    if not s_value < l_value:
        raise ConfigError(
            f"{s_name}={s_value:g} ({s_what}) must be shorter than {l_name}={l_value:g} ({l_what}); "
            f"lower {s_name} or raise {l_name} (docs/diagnostics.md#timeouts)"
        )


def check_trainer_timeouts(cfg) -> None:
    write = ("checkpoint_timeout_seconds", cfg.checkpoint_timeout_seconds, "one checkpoint write")
    shorter(write, ("stop_timeout_seconds", cfg.stop_timeout_seconds, "a stop's final save must fit in it"))
    shorter(write, ("collective_timeout_seconds", cfg.collective_timeout_seconds, "the others wait in a collective"))


def rdzv_timeouts(rdzv_conf: str) -> dict[str, float]:
    """``--rdzv-conf``'s timeouts in seconds, torch's defaults where a key is missing (other keys are ignored)."""
    out = dict(RDZV_DEFAULTS)
    for item in filter(None, (part.strip() for part in rdzv_conf.split(","))):
        key, _, value = item.partition("=")
        if key in out:
            try:
                out[key] = float(value)
            except ValueError:
                raise ConfigError(f"--rdzv-conf {key}={value!r}: must be a number of seconds") from None
    return out


def check_launch_timeouts(rdzv_conf: str, collective_timeout_seconds: float) -> None:
    """The launcher's rendezvous timeouts against each other and against the trainer's collective timeout."""
    t = rdzv_timeouts(rdzv_conf)
    beat = t["keep_alive_interval"] * t["keep_alive_max_attempt"]
    heartbeat = ("keep_alive_interval x keep_alive_max_attempt", beat, "the store drops a silent agent after it")
    shorter(heartbeat, ("collective_timeout_seconds", collective_timeout_seconds, "its peers give up on it"))
    shorter(heartbeat, ("join_timeout", t["join_timeout"], "a round stops waiting for members"))
    shorter(
        ("last_call_timeout", t["last_call_timeout"], "latecomers are waited for"),
        ("join_timeout", t["join_timeout"], "a round stops waiting for members"),
    )
