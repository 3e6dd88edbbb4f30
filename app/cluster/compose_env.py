"""Every ``DDP_*`` setting of the caller's environment, written to the env file each compose worker reads.

Compose hands a container only the variables its file names. compose.yaml used to name a hand-kept dozen, so a
setting it did not list (``DDP_LR=abc``, a typo such as ``DDP_STESP=10``, a field added later) never reached the
containers and the run trained at the defaults without a word. Now it names none: the workers read
``env_file: ${CLUSTER_ENV_FILE:-.cluster.env}`` (``format: raw``: values as given, no quoting or ``$``
expansion), which this writes from the environment, every ``DDP_*`` name included; the worker's launcher then
refuses a name that is no setting (exit 2, "did you mean"). Torch-free, stdlib only::

    python3 -m app.cluster.compose_env                  # .cluster.env from this shell's DDP_* (`make up` runs it)
    CLUSTER_ENV_FILE=/tmp/run.env python3 -m app.cluster.compose_env   # a file of its own (one per project)

``DDP_CONFIG`` is left out: a path on this machine means nothing in a container (compose.yaml sets the image's).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

PREFIX = "DDP_"
DEFAULT_FILE = ".cluster.env"
FILE_ENV = "CLUSTER_ENV_FILE"


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
    lines = "".join(f"{key}={value}\n" for key, value in settings(environ).items())
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(lines)
    os.replace(tmp, path)  # never half a file: a worker starting meanwhile reads the old one or the new one
    return path


def with_env_file(env: Mapping[str, str], path: str | os.PathLike) -> dict[str, str]:
    """``env`` plus ``CLUSTER_ENV_FILE`` naming a file just written from its ``DDP_*``: what a harness that runs
    ``docker compose`` with an environment of its own passes, so its settings reach the workers as `make up`'s do.

    Example::

        subprocess.run(["docker", "compose", "-p", name, "up", "-d"], env=with_env_file(env, tmp / f"{name}.env"))
    """
    return {**env, FILE_ENV: str(write_env_file(path, env))}


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
