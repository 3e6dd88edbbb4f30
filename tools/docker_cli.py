"""The Docker CLI from Python: the one way the tests, the drills and the benches run ``docker`` and ``docker compose``.

    docker("inspect", container).stdout          # DockerFailed (Docker's own reason) when it exits non-zero
    docker("info", check=False).returncode       # look at the outcome yourself
    compose("proj", env, "up", "-d", "worker")   # docker compose -p proj, from the checkout, DDP_* via an env file
    stamp(line)                                  # unix time of a `docker logs --timestamps` line, or None

Text output, both streams captured, a timeout on every call (a hung engine fails the caller instead of blocking
it). ``compose`` hands the workers every ``DDP_*`` variable of ``env`` through an env file, as ``make up`` does
(app/cluster/compose_env.py); ``plain=True`` runs it as a user types it, with the shell's environment only.
"""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from app.cluster.compose_env import FILE_ENV, with_env_file

ROOT = Path(__file__).resolve().parents[1]  # where compose.yaml is
STAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z")


class DockerFailed(subprocess.CalledProcessError):
    """``docker ...`` exited non-zero; ``str()`` is the command, its exit code and the end of Docker's stderr."""

    def __str__(self) -> str:
        said = (self.stderr or "").strip()[-2000:] or (self.stdout or "").strip()[-2000:]
        return f"{' '.join(self.cmd)}: exit {self.returncode}: {said}"


def docker(
    *args: str,
    timeout: float = 60,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """``docker ARGS``, to its end; ``DockerFailed`` if it exits non-zero and ``check``."""
    out = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, errors="replace"
    )
    if check and out.returncode != 0:
        raise DockerFailed(out.returncode, out.args, out.stdout, out.stderr)
    return out


def compose(
    project: str,
    env: Mapping[str, str],
    *args: str,
    timeout: float = 300,
    check: bool = True,
    plain: bool = False,
) -> subprocess.CompletedProcess:
    """``docker compose -p PROJECT ARGS`` in the checkout with ``env``: every ``DDP_*`` of it reaches the workers
    through an env file (``make up``'s way), or, ``plain``, only the ones compose.yaml names (a user's shell)."""
    if plain:
        run_env = {k: v for k, v in env.items() if k != FILE_ENV}  # `make e2e` exports make up's; a shell has none
    else:
        run_env = with_env_file(dict(env), Path(tempfile.gettempdir()) / f"{project}.cluster.env")
    return docker("compose", "-p", project, *args, timeout=timeout, check=check, env=run_env, cwd=ROOT)


def stamp(line: str) -> float | None:
    """Unix time of Docker's RFC 3339 stamp in ``line`` (nanoseconds cut to microseconds), or None if it has none."""
    m = STAMP.search(line)
    if not m:
        return None
    whole = dt.datetime.fromisoformat(m[1]).replace(tzinfo=dt.timezone.utc).timestamp()
    return whole + float("0." + (m[2] or "0"))
