"""Out of memory, said in one line: the container's memory limit and its kills, read from the kernel's cgroup.

A trainer over its container's limit (compose's ``WORKER_MEMORY``, a pod's ``resources.limits.memory``) is killed
by the kernel with SIGKILL, which alone says nothing: a restart trains the same model at the same batch and is
killed again, a loop that ends minutes later with the restart budget. The kernel counts each such kill in the
container's memory cgroup, so the launcher can tell a kill for memory from any other SIGKILL, say so once, with the
limit, the peak and what to change, and restart nothing. Both cgroup versions, as Docker and Kubernetes mount them:

- v2: ``/sys/fs/cgroup/memory.max`` (``max``: none), ``memory.peak``, ``memory.events`` (``oom_kill N``);
- v1: ``/sys/fs/cgroup/memory/memory.limit_in_bytes``, ``memory.max_usage_in_bytes``, ``memory.oom_control``.

Torch-free, stdlib only; ``python -m app.cluster.memory`` prints what it reads here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned 64-bit value; anything this large is none.
NO_LIMIT_V1 = 1 << 62
MIB = 1 << 20


@dataclass(frozen=True)
class CgroupMemory:
    """What the kernel says of this container's memory: limit and peak in bytes (None: none, or not told)."""

    limit: int | None
    peak: int | None
    oom_kills: int


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _oom_kills(path: Path) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    counts = dict(line.split(None, 1) for line in lines if " " in line)
    return int(counts.get("oom_kill", "0").strip() or 0)


def read_cgroup(root: Path = CGROUP_ROOT) -> CgroupMemory | None:
    """This container's memory cgroup, v2 or v1; None where neither is mounted (not Linux, no memory controller)."""
    if (root / "memory.events").exists():
        return CgroupMemory(
            _number(root / "memory.max"), _number(root / "memory.peak"), _oom_kills(root / "memory.events")
        )
    v1 = root / "memory"
    if (v1 / "memory.oom_control").exists():
        limit = _number(v1 / "memory.limit_in_bytes")
        limit = None if limit is None or limit >= NO_LIMIT_V1 else limit
        return CgroupMemory(limit, _number(v1 / "memory.max_usage_in_bytes"), _oom_kills(v1 / "memory.oom_control"))
    return None


class OomWatch:
    """Kills for memory since the last look: ``kills()`` is the cgroup's state when there were new ones, else None."""

    def __init__(self, root: Path = CGROUP_ROOT):
        self.root = root
        first = read_cgroup(root)
        self.seen = first.oom_kills if first else 0

    def kills(self) -> CgroupMemory | None:
        state = read_cgroup(self.root)
        if state is None or state.oom_kills <= self.seen:
            return None
        self.seen = state.oom_kills
        return state


# What lowers a rank's peak, by the kind it runs now (docs/sharding.md has the formula per stage).
LIGHTER_KINDS = {"ddp": "parallel=zero2 or zero3", "zero1": "parallel=zero2 or zero3", "zero2": "parallel=zero3"}


def oom_line(rank: int, container: str, state: CgroupMemory, config=None) -> str:
    """The one line a kill for memory ends with: the rank, the limit, the peak and the likely fixes.

    ``config`` (a TrainConfig, when the launcher knows it) makes the advice concrete: its micro-batch and kind.
    """
    limit = f"its container's limit of {state.limit // MIB} MiB" if state.limit else "the machine's memory"
    peak = f" (peak {state.peak // MIB} MiB)" if state.peak else ""
    fixes = ["more memory (WORKER_MEMORY in compose, resources.limits.memory in Kubernetes)"]
    if config is not None:
        fixes.append(f"a smaller micro_batch than {config.micro_batch} with more grad_accum_steps")
        if kind := LIGHTER_KINDS.get(config.parallel):
            fixes.append(kind)
    else:
        fixes += ["a smaller micro_batch with more grad_accum_steps", "parallel=zero2 or zero3"]
    if config is None or config.activation_checkpointing == "off":
        fixes.append("activation_checkpointing=units (recomputes each block's activations in backward)")
    return (
        f"rank {rank} (this container, {container}) was killed for memory: over {limit}{peak}, and a restart "
        f"would be killed again, so none follows; fix: {', '.join(fixes[:-1])}, or {fixes[-1]}"
    )


def main() -> int:
    state = read_cgroup()
    print(state if state else "no memory cgroup here (cgroup v1 or v2 with the memory controller)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
