"""A compose project of the worker image, driven from Python: what the chaos proof, the failure drills
(tests/e2e/drills/) and the start-up bench (bench/startup.py) share.

    p = Project("chaos-a", project_env("chaos-a", args))   # args: workers, steps, effective_batch, ... (argparse)
    p.compose("up", "-d", "--no-build", "--scale", "worker=3", "worker")
    p.wait_until(lambda: p.last_step() >= 20, 600, "step 20")
    p.lines()                                              # every worker log line as (unix time, text)
    p.down()

Here, not in tests/ or bench/, because both use it and bench/ never imports tests/ (tests/unit/test_layout.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.docker_cli import compose, docker, stamp

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"\[rank 0\] INFO step (\d+)/\d+ \| loss ([-\d.naif]+)")
WORLD = re.compile(r"\[rank 0\] INFO training .* world_size (\d+)")
RESUMED = re.compile(r"\[rank 0\] INFO resumed from \S+ \(step (\d+)")
JOINED = re.compile(r"\[launch (\w+)\] INFO joined a world of (\d+) as rank (\d+)")
# heal=in_place (app.worker.heal): rank 0 of each world the trainers heal to, lost ranks or a newcomer later; no
# torchrun world starts, so no "training" line says the new size.
HEALED_WORLD = re.compile(r"\[rank 0\] WARNING rank 0 of (\d+) \(was \d+ of \d+\): world \d+ healed")


def world_size_in(line: str) -> int | None:
    """The world size a line of rank 0 announces: a world torchrun started, or one the trainers healed to."""
    m = WORLD.search(line) or HEALED_WORLD.search(line)
    return int(m[1]) if m else None


CHECKPOINT_MS = re.compile(r"checkpoint \S+ written in (\d+) ms")


@dataclass
class Project:
    """One compose project (its own network, store, checkpoint volume) of the worker service only."""

    name: str
    env: dict[str, str]
    log: list[str] = field(default_factory=list)

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return compose(self.name, self.env, *args, timeout=timeout, check=check)

    def workers(self) -> list[dict]:
        out = self.compose("ps", "-a", "--format", "json").stdout.strip()
        rows = json.loads(out) if out.startswith("[") else [json.loads(x) for x in out.splitlines() if x.strip()]
        return [r for r in rows if r["Service"] == "worker"]

    def lines(self) -> list[tuple[float, str]]:
        """Every worker log line as (unix time, text), in time order across containers."""
        out = self.compose("logs", "--no-color", "--timestamps", "worker", check=False).stdout
        found = [(stamp(line), line) for line in out.splitlines()]
        return sorted((t, line) for t, line in found if t is not None)

    def last_step(self) -> int:
        steps = [int(m[1]) for _, line in self.lines() if (m := STEP.search(line))]
        return max(steps, default=0)

    def rank_container(self, rank: int) -> str | None:
        """The container id holding ``rank`` in the newest world (from app.cluster.launch's join lines)."""
        held = None
        for _, line in self.lines():
            if (m := JOINED.search(line)) and int(m[3]) == rank:
                held = m[1]
        return held

    def wait_until(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: {what} did not happen within {timeout_s:g} s")
            # Each look runs `docker compose logs` or `ps` (a fraction of a CPU-second each on a busy machine, taken
            # from the workers): every 2 s is soon enough for phases of tens of seconds.
            time.sleep(2.0)

    def all_exited(self, count: int) -> bool:
        rows = self.workers()
        return len(rows) >= count and all(r["State"] == "exited" for r in rows)

    def final_parameters(self, step: int) -> dict:
        """The run's last checkpoint (copied out of its volume, loaded and digest-checked): name -> tensor."""
        from app.checkpoint_dir import SHARDED, find_checkpoints
        from app.worker.checkpoint.files import load_checkpoint

        container = self.workers()[0]["ID"]
        with tempfile.TemporaryDirectory() as tmp:
            docker("cp", f"{container}:/checkpoints/.", tmp, timeout=120)  # the whole volume: ZeRO's shards too
            newest = next(iter(find_checkpoints(tmp)), None)
            if newest is not None and newest.kind == SHARDED:
                return consolidated(newest.path, step)
            return load_checkpoint(Path(tmp) / f"step-{step:08d}.pt")["model"]

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "-t", "10", check=False, timeout=300)


def steps_redone(last_logged: int, resumed_from: int) -> int:
    """Steps the new world trains again: those logged before the fault past the checkpoint it resumed from. A log
    line is stamped when Docker receives it, so the last line stamped before the fault can trail a step whose
    checkpoint is already written: the world then resumes past it, and none were redone."""
    return max(last_logged - resumed_from, 0)


def consolidated(directory: Path, step: int) -> dict:
    """A ZeRO checkpoint's parameters, whole (name -> float64 tensor), every shard's digest checked on the way
    (app.parallel.zero.checkpoint.consolidate); a checkpoint of another step is an error."""
    from app.parallel.zero.checkpoint import consolidate

    whole = consolidate(directory)
    if whole.extra.get("step") != step:
        raise RuntimeError(f"{directory}: the last checkpoint is of step {whole.extra.get('step')}, not {step}")
    return {name: whole.model[name].double() for name in whole.optimizer}


def project_env(name: str, args) -> dict[str, str]:
    base = os.environ.get("BASE_IMAGE") or (
        "local/python:3.11-slim" if (ROOT.parent / "shared/docker").exists() else ""
    )
    env = {
        **os.environ,
        "COMPOSE_BAKE": "false",
        "RUN_ID": name,
        # One image for every project of a run (and the one `make image` builds, for --no-build): compose would
        # otherwise name it after each project, and a project started with --no-build would find none.
        "IMAGE_NAME": os.environ.get("IMAGE_NAME", "ddp-cluster"),
        "WORKERS": str(args.workers),
        "DDP_STEPS": str(args.steps),
        "DDP_EFFECTIVE_BATCH": str(args.effective_batch),
        "DDP_MICRO_BATCH": str(args.micro_batch),
        "DDP_DTYPE": args.dtype,
        "DDP_CHECKPOINT_EVERY": str(args.checkpoint_every),
        "DDP_LOG_EVERY": "1",
        "DDP_METRICS_LINGER_SECONDS": "0",
        "DDP_MIN_STEP_SECONDS": str(getattr(args, "min_step_seconds", 0.0)),
    }
    if getattr(args, "heal", "restart") == "in_place":  # the compose store is the one that outlives every rank
        env |= {"DDP_HEAL": "in_place", "DDP_HEAL_STORE": "rendezvous:29400"}
    if getattr(args, "parallel", "ddp") != "ddp":  # the ZeRO stages of issue 22: the same proof, sharded
        env["DDP_PARALLEL"] = args.parallel
    if getattr(args, "max_workers", None):  # compose.yaml's MAX_WORKERS (--nnodes=1:MAX), 8 unless set
        env["MAX_WORKERS"] = str(args.max_workers)
    if base:
        env["BASE_IMAGE"] = base
        env.setdefault(
            "COMPOSE_FILE", "compose.yaml:compose.local.yaml" if base.startswith("local/") else "compose.yaml"
        )
    return env


def first_step_after(lines, since: float, world: int) -> float | None:
    current = None
    for t, line in lines:
        if (size := world_size_in(line)) is not None:
            current = size
        elif t > since and current == world and STEP.search(line):
            return t
    return None
