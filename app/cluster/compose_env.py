"""The env file `make up` hands the compose workers: every ``DDP_*`` of the caller's environment, whatever its name.

compose.yaml names every ``TrainConfig`` field's ``DDP_*`` variable (generated: ``make docs-config``), so a plain
``DDP_STEPS=400 docker compose up`` reaches the workers. What Compose cannot do is pass a name its file does not
list: a typo (``DDP_STESP=10``) would be dropped and the run train at the default without a word. `make up` closes
that gap with this file (``env_file: ${CLUSTER_ENV_FILE:-/dev/null}``, ``format: raw``: values as given, no quoting
or ``$`` expansion): every ``DDP_*`` name goes in, and the worker's launcher refuses one that is no setting (exit 2,
"did you mean"). Each `make up` writes it anew, `make down` removes it, and a plain ``docker compose up`` reads none,
so yesterday's settings cannot train today's run. The file also names itself and its settings, which the launcher
logs (``describe_env_file``). Torch-free, stdlib only::

    python3 -m app.cluster.compose_env                  # .cluster.env from this shell's DDP_* (`make up` runs it)
    CLUSTER_ENV_FILE=/tmp/run.env python3 -m app.cluster.compose_env   # a file of its own (one per project)

``DDP_CONFIG`` is left out: a path on this machine means nothing in a container (compose.yaml sets the image's).
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from app.files import write_text_atomically

PREFIX = "DDP_"
DEFAULT_FILE = ".cluster.env"
FILE_ENV = "CLUSTER_ENV_FILE"
# Written into the file beside the settings, for the launcher's line: which file, when, and which names it carried.
NAMES_ENV, WRITTEN_ENV = "CLUSTER_ENV_SETTINGS", "CLUSTER_ENV_WRITTEN"


def settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``DDP_*`` variables to forward, sorted by name; ValueError for a value Compose cannot carry."""
    found = {k: v for k, v in sorted(environ.items()) if k.startswith(PREFIX) and k != PREFIX + "CONFIG"}
    for key, value in found.items():
        if "\n" in value or "\r" in value:
            raise ValueError(f"{key}: a value with a line break cannot go through an env file; give it on one line")
    return found


def write_env_file(path: str | os.PathLike, environ: Mapping[str, str] = os.environ) -> Path:
    """Write ``KEY=VALUE`` per ``DDP_*`` variable of ``environ`` to ``path`` (replaced whole); returns the path.

    Example::

        env = {**os.environ, "DDP_STEPS": "50"}
        env["CLUSTER_ENV_FILE"] = str(write_env_file(tmp / "run.env", env))
        subprocess.run(["docker", "compose", "up", "-d"], env=env)
    """
    path = Path(path)
    found = settings(environ)
    written = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    about = {FILE_ENV: str(path), WRITTEN_ENV: written, NAMES_ENV: " ".join(found)}
    lines = "".join(f"{key}={value}\n" for key, value in {**found, **about}.items())
    write_text_atomically(path, lines)  # a worker starting meanwhile reads the old file or the new one, never half
    return path


def with_env_file(env: Mapping[str, str], path: str | os.PathLike) -> dict[str, str]:
    """``env`` plus ``CLUSTER_ENV_FILE`` naming a file just written from its ``DDP_*``: what a harness that runs
    ``docker compose`` with an environment of its own passes, so its settings reach the workers as `make up`'s do.

    Example::

        subprocess.run(["docker", "compose", "-p", name, "up", "-d"], env=with_env_file(env, tmp / f"{name}.env"))
    """
    return {**env, FILE_ENV: str(write_env_file(path, env))}


def describe_env_file(environ: Mapping[str, str]) -> str | None:
    """The launcher's line about the env file its container read, or None where it read none (a plain ``up``).

    Example::

        >>> describe_env_file({FILE_ENV: ".cluster.env", WRITTEN_ENV: "2026-12-03T18:00:00Z", NAMES_ENV: "DDP_LR"})
        'settings from env file .cluster.env (written 2026-12-03T18:00:00Z): DDP_LR'
    """
    if FILE_ENV not in environ:
        return None
    names = environ.get(NAMES_ENV, "").split()
    when = environ.get(WRITTEN_ENV, "at an unknown time")
    listed = ", ".join(names) if names else "none (no DDP_* in its shell)"
    return f"settings from env file {environ[FILE_ENV]} (written {when}): {listed}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else os.environ.get(FILE_ENV) or DEFAULT_FILE
    try:
        written = write_env_file(path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {path} ({e.strerror}): choose another CLUSTER_ENV_FILE", file=sys.stderr)
        return 2
    names = list(settings(os.environ))
    print(f"{written}: {len(names)} setting(s) for the workers{': ' + ' '.join(names) if names else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
