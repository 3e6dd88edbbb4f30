"""What a launcher leaves in the shared volume for the containers after it: refusals, and the job's finish.

Docker's restart policy cannot tell exit codes apart: ``restart: on-failure:3`` restarts a container that exited 2
(a bad configuration, which no retry fixes) exactly like one that crashed, and restarts a container that arrived
when the world was already full. And a container that Docker restarts after its job has finished would find an
empty store, form a new world of its own, resume at the last step and print a second FINISHED. So the launcher
(``app.cluster.launch``) keeps two records under ``LAUNCH_STATE_DIR`` (compose.yaml: the checkpoint volume), per
job (``--rdzv-id``)::

    <LAUNCH_STATE_DIR>/<run id>/refused/<container>.json   this container was refused (exit 2) with these inputs
    <LAUNCH_STATE_DIR>/<run id>/seen/<container>           when this container first came to the job
    <LAUNCH_STATE_DIR>/<run id>/finished.json              when the job finished, at which step

A starting launcher that finds itself refused before (same container, same settings) or finds that the job finished
after it came says so in one line and exits 0, which the restart policy leaves alone. A new container (a fresh
``docker compose up`` after a change: Compose recreates them) was never refused and came after the finish: it runs.
Without ``LAUNCH_STATE_DIR`` nothing is kept (plain torchrun, the tests of one process). Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from app.files import write_text_atomically
from app.worker.config import ENV_PREFIX


def fingerprint(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """A digest of what decides a launch: its arguments and every ``DDP_*`` variable (Compose's env file)."""
    settings = sorted((k, v) for k, v in environ.items() if k.startswith(ENV_PREFIX))
    return hashlib.sha256(json.dumps([list(argv), settings]).encode()).hexdigest()[:16]


def _write(path: Path, text: str) -> None:
    # Whole or not at all: a container killed mid-write must not leave a record the next one misreads.
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, text)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent, or written by something else: no record
    return data if isinstance(data, dict) else None


class JobState:
    """The records of one job (``run_id``) as one container (``container``, its hostname) sees them."""

    def __init__(self, root: Path | None, run_id: str, container: str, digest: str):
        self.dir = root / run_id if root is not None else None
        self.container, self.digest = container, digest

    @classmethod
    def in_dir(cls, state_dir: str, run_id: str, container: str, digest: str) -> JobState:
        """The records under ``state_dir`` (``LAUNCH_STATE_DIR``; "" keeps none)."""
        return cls(Path(state_dir) if state_dir else None, run_id, container, digest)

    def refused_before(self) -> str | None:
        """The reason this container was refused with these same settings, if it was."""
        if self.dir is None:
            return None
        record = _read_json(self.dir / "refused" / f"{self.container}.json")
        return record["reason"] if record and record.get("fingerprint") == self.digest else None

    def refuse(self, reason: str) -> None:
        """Record that this container exits 2 for ``reason``: its restarts end at once."""
        if self.dir is not None:
            record = {"fingerprint": self.digest, "reason": reason, "time": time.time()}
            self._try(_write, self.dir / "refused" / f"{self.container}.json", json.dumps(record))

    def arrived(self) -> None:
        """Note when this container first came to the job (kept across its restarts)."""
        if self.dir is not None and not (self.dir / "seen" / self.container).exists():
            self._try(_write, self.dir / "seen" / self.container, repr(time.time()))

    def finished_since_arrival(self) -> dict | None:
        """The job's finish record when the job finished after this container came to it (so it was part of it)."""
        if self.dir is None:
            return None
        finished = _read_json(self.dir / "finished.json")
        try:
            seen = float((self.dir / "seen" / self.container).read_text())
        except (OSError, ValueError):
            return None  # a container new to this job: a new run, not a restart
        return finished if finished and float(finished.get("time", 0)) >= seen else None

    def finish(self, step: int | None) -> None:
        """Record that the job finished (at ``step``, the configured last one)."""
        if self.dir is not None:
            self._try(_write, self.dir / "finished.json", json.dumps({"time": time.time(), "step": step}))

    @staticmethod
    def _try(write, path: Path, text: str) -> None:
        try:
            write(path, text)
        except OSError as e:  # a read-only or full volume: the run itself must not fail for a record
            logging.getLogger("app.cluster.launch").warning("cannot record %s (%s): restarts may repeat", path, e)
