"""The seed's problem, run for real (issue 37): a user's model that ddp cannot fit in its containers trains under ZeRO.

    make memory-demo                 # = python -m bench.memory_demo (Docker; the image of `make image`)
    python -m bench.memory_demo --kinds ddp,zero3 --memory 700m

A model file written to a temporary folder outside the checkout (a residual stack of square Linear layers, AdamW:
its state dominates a rank's memory) is mounted into the workers as docs/your-model.md mounts a package: a compose
override of the user's own, the folder read-only at /opt/user_model, on PYTHONPATH. 4 containers of
``WORKER_MEMORY`` each (``--scale worker=4``; one compose project per run, one after the other) train it under each
kind in turn, then 4 with no limit (``WORKER_MEMORY=0``) under ddp: the reference. Printed: one row per run, with
the limit, each container's peak (the kernel's own count, read from the host's cgroup while it runs; for a killed
run, from its one line) and how it ended, with the sharded runs' results against the reference; then PASS or FAIL
for each claim: every ddp container killed for memory with one line and exit 1; every zero3 rank finished with the
reference's parameters to ``TOLERANCE``; exit 1 on a FAIL. zero2 is shown too; on this model it fits with less
room (see ``WORKER_MEMORY``).

tests/e2e/test_memory_sharding.py runs the same scenario (ddp and zero3) and asserts it line by line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from tools.compose_project import ROOT, Project
from tools.docker_cli import docker

WORKERS = 4
# bench/results/memory.json's model (bench.models.residual:ResidualStack, width 1536), 12 blocks instead of 16 to
# keep zero3's all-gathers short on 2 cores: Ψ = 28.4M parameters.
WIDTH, DEPTH = 1536, 12
# `python -m app.plan bench.models.residual:ResidualStack --model-kwargs '{"width":1536,"depth":12}' --data
# teacher_classification --data-kwargs '{"size":512,"seed":0}' --world 4` predicts per rank (VmHWM, from the measured
# bases of bench/results/memory.json): ddp 710 MiB, zero2 561, zero3 440. What the limit holds is the container's
# cgroup count, a little under the trainer's VmHWM where the image's libraries were paged in by an earlier container:
# with no limit this demo saw ddp 668 (the save's page cache adds ~330 in rank 0's), zero2 552, zero3 ~453 MiB
# (at 3056d70, 2 cores). 600 MiB sits between: ddp ~70 over, zero2 ~50 under, zero3 ~150 under. ddp needs its AdamW
# state (2Ψ floats) on top of Ψ parameters and Ψ gradients at the first optimizer step, the same moment on every
# rank: each is killed there by its own limit, not one first and the others by a broken collective.
WORKER_MEMORY = "600m"
STEPS = 2  # the first step allocates the optimizer state (ddp's peak); the second repeats it (every kind's peak)
# The rule of tests/integration/test_train_sharded.py (TOLERANCE): zero3 reduce-scatters and adds in another order
# than ddp's all-reduce, so its parameters differ from ddp's by float rounding (~1e-8) and its FINISHED checksum, a
# hash of the bytes, differs; zero1 and zero2 reduce as ddp does and match it bit for bit (equal checksums).
TOLERANCE = 1e-5
KINDS = ("ddp", "zero2", "zero3")
FINISHED = re.compile(r"FINISHED rank=(\d+) world_size=(\d+) step=(\d+) checksum=([0-9a-f]{16})")
KILLED = re.compile(r"was killed for memory: over its container's limit of (\d+) MiB \(peak (\d+) MiB\)")
MIB = 1 << 20

MODEL = '''"""A user's model, outside the cluster's checkout: residual blocks of square Linear layers."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.linear(x))


class Stack(nn.Module):
    def __init__(self, width, depth, in_features=32, classes=8):
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, classes)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build(width=1536, depth=12):
    return Stack(width, depth)
'''

# The user's compose override, as examples/user_model/compose.user.yaml mounts a package (docs/your-model.md), but
# with the specs left to the shell's DDP_* so that one file serves every kind.
OVERRIDE = """services:
  worker:
    volumes:
      - type: bind
        source: ${USER_MODEL_DIR}
        target: /opt/user_model
        read_only: true
        bind:
          create_host_path: false
    environment:
      PYTHONPATH: /app:/opt/user_model
"""


def write_package(folder: Path) -> Path:
    """The model file and its compose override in ``folder``, readable by the image's user (the mount is read-only)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory_model.py").write_text(MODEL)
    (folder / "compose.memory.yaml").write_text(OVERRIDE)
    for path in [folder, *folder.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


def settings(kind: str, memory: str, package: Path, name: str, image: str) -> dict[str, str]:
    """A project's environment: the user's model and the kind, as a user's shell would carry them to `make up`."""
    base = os.environ.get("BASE_IMAGE") or (
        "local/python:3.11-slim" if (ROOT.parent / "shared/docker").exists() else ""
    )
    files = os.environ.get("COMPOSE_FILE") or (
        "compose.yaml:compose.local.yaml" if base.startswith("local/") else "compose.yaml"
    )  # the Makefile's choice where it exports one; the user's override is added to it
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_") and k != "WORKERS"}
    return env | {
        "COMPOSE_BAKE": "false",
        "COMPOSE_FILE": f"{files}:{package}/compose.memory.yaml",
        "USER_MODEL_DIR": str(package),
        "RUN_ID": name,
        "IMAGE_NAME": image,
        "WORKER_MEMORY": memory,
        **({"BASE_IMAGE": base} if base else {}),
        "DDP_MODEL": "memory_model:build",
        "DDP_MODEL_KWARGS": json.dumps({"width": WIDTH, "depth": DEPTH}),
        "DDP_DATA": "teacher_classification",
        "DDP_DATA_KWARGS": '{"size": 512, "seed": 0}',
        "DDP_LOSS": "cross_entropy",
        "DDP_PARALLEL": kind,
        "DDP_STEPS": str(STEPS),
        "DDP_LR": "0.0001",  # the default 3e-3 makes 12 unnormalised blocks diverge, and rounding grow with it
        "DDP_CHECKPOINT_EVERY": str(STEPS),
        "DDP_METRICS_LINGER_SECONDS": "0",
    }


# Where the engine's cgroup driver puts a container's memory cgroup on this host, v1 and v2 (cgroupfs, systemd).
# Only a daemon on this machine has one here; elsewhere a finished run's peak is unknown (None).
PEAK_FILES = (
    "memory/docker/{id}/memory.max_usage_in_bytes",
    "memory/system.slice/docker-{id}.scope/memory.max_usage_in_bytes",
    "docker/{id}/memory.peak",
    "system.slice/docker-{id}.scope/memory.peak",
)


def read_peak(container_id: str, root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The container's peak memory in bytes as its cgroup counts it (what its limit is held to), while it exists."""
    for pattern in PEAK_FILES:
        try:
            return int((root / pattern.format(id=container_id)).read_text())
        except (OSError, ValueError):
            continue
    return None


def watch(ids: list[str], deadline_s: float) -> dict[str, int | None]:
    """Until every container of ``ids`` has exited: each one's cgroup peak, read every 0.2 s (the cgroup goes with
    the container, so the last reading is its peak up to 0.2 s before the end: a save and the checksum, no step)."""
    full = docker("inspect", "-f", "{{.Id}}", *ids).stdout.split()
    peaks: dict[str, int | None] = dict.fromkeys(full)
    deadline, next_look = time.monotonic() + deadline_s, 0.0
    while time.monotonic() < deadline:
        for i in peaks:
            if (now := read_peak(i)) is not None:
                peaks[i] = max(now, peaks[i] or 0)
        if time.monotonic() >= next_look:  # `docker inspect` takes a CPU share the workers need: every 2 s
            if set(docker("inspect", "-f", "{{.State.Status}}", *full).stdout.split()) == {"exited"}:
                return peaks
            next_look = time.monotonic() + 2.0
        time.sleep(0.2)
    raise TimeoutError(f"{len(ids)} workers not exited within {deadline_s:g} s")


def container_report(container_id: str, peak: int | None) -> dict:
    """How one container ended: exit code, Docker restarts, its ERROR lines, its FINISHED line, its peak in MiB."""
    state = json.loads(docker("inspect", container_id).stdout)[0]
    logs = docker("logs", container_id, check=False)
    text = logs.stdout + logs.stderr
    killed = [KILLED.search(line) for line in text.splitlines() if "ERROR" in line]
    if peak is None and killed and killed[-1]:  # the launcher's own line carries the cgroup's peak
        peak = int(killed[-1][2]) * MIB
    return {
        "container": container_id[:12],
        "exit_code": state["State"]["ExitCode"],
        "restarts": state["RestartCount"],
        "errors": [line for line in text.splitlines() if "ERROR" in line],
        "finished": FINISHED.findall(text),
        "traceback": "Traceback" in text,
        "peak_mib": None if peak is None else round(peak / MIB),
        "log_tail": text[-3000:],
        # (host folder, writable) of the user's model mount: docs/your-model.md mounts it read-only
        "model_mount": [(m["Source"], m["RW"]) for m in state["Mounts"] if m["Destination"] == "/opt/user_model"],
    }


def run(kind: str, memory: str, package: Path, name: str, image: str, deadline_s: float = 600) -> dict:
    """One project, 4 workers of ``memory`` each training the user's model under ``kind``, to their ends; then
    torn down. ``params``: the last checkpoint's parameters (name -> tensor) when every rank finished."""
    project = Project(name, settings(kind, memory, package, name, image))
    started = time.monotonic()
    try:
        project.compose("up", "-d", "--no-build", "--scale", f"worker={WORKERS}", "worker", timeout=300)
        ids = [r["ID"] for r in project.workers()]
        peaks = watch(ids, deadline_s)
        wall_s = round(time.monotonic() - started, 1)
        containers = [container_report(i, peak) for i, peak in peaks.items()]
        done = all(c["finished"] and c["exit_code"] == 0 for c in containers)
        params = project.final_parameters(STEPS) if done else None
    finally:
        project.down()
    return {"kind": kind, "memory": memory, "wall_s": wall_s, "containers": containers, "params": params}


def killed_for_memory(r: dict) -> bool:
    """Every container ended once, exit 1, with exactly one ERROR line, the one naming memory, and no FINISHED."""
    return len(r["containers"]) == WORKERS and all(
        (c["exit_code"], c["restarts"]) == (1, 0)
        and len(c["errors"]) == 1
        and "was killed for memory" in c["errors"][0]
        and not c["finished"]
        for c in r["containers"]
    )


def checksums(r: dict) -> set[str]:
    return {f[3] for c in r["containers"] for f in c["finished"]}


def trained(r: dict) -> bool:
    """Every rank of the world printed FINISHED at the last step, one checksum, and its container exited 0."""
    ranks = sorted((int(f[0]), int(f[1]), int(f[2])) for c in r["containers"] for f in c["finished"])
    codes = {(c["exit_code"], c["restarts"]) for c in r["containers"]}
    return ranks == [(rank, WORKERS, STEPS) for rank in range(WORKERS)] and len(checksums(r)) == 1 and codes == {(0, 0)}


def max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def scenario(kinds, memory: str, image: str, tag: str, folder: Path) -> dict:
    """Each kind in containers of ``memory``, then the reference: ddp with no limit. Returns the runs by label."""
    package = write_package(folder)
    runs = {kind: run(kind, memory, package, f"{tag}-{kind}", image) for kind in kinds}
    runs["reference"] = run("ddp", "0", package, f"{tag}-reference", image)  # WORKER_MEMORY=0: Docker's "none"
    return runs


def ending(r: dict, reference: dict) -> str:
    if killed_for_memory(r):
        return "killed for memory: one line, exit 1, in every container"
    if not trained(r):
        codes = sorted(c["exit_code"] for c in r["containers"])
        return f"FAILED: exit codes {codes}, {sum(len(c['errors']) for c in r['containers'])} ERROR lines"
    if r is reference or reference["params"] is None:
        return "FINISHED on every rank"
    same = "the same checksum" if checksums(r) == checksums(reference) else "another checksum (float rounding)"
    diff = max_param_diff(r["params"], reference["params"])
    return f"FINISHED on every rank; vs the reference: {same}, max |Δparam| {diff:.1e} (tolerance {TOLERANCE:g})"


def verdict(runs: dict) -> list[tuple[str, bool]]:
    """The demo's claims, each with whether it held, for the kinds that ran (zero2 is shown, not judged: it fits
    with less room, see WORKER_MEMORY)."""
    ref, checks = runs["reference"], []
    if "ddp" in runs:
        checks.append(("ddp killed for memory in every container, one line each", killed_for_memory(runs["ddp"])))
    if (zero3 := runs.get("zero3")) is not None:
        equal = trained(zero3) and trained(ref) and max_param_diff(zero3["params"], ref["params"]) <= TOLERANCE
        checks.append((f"zero3 FINISHED in the same containers, ddp's parameters within {TOLERANCE:g}", equal))
    return checks


def show(runs: dict) -> None:
    print(f"\n{WORKERS} containers (--scale worker={WORKERS}), a user model of Ψ = {psi():,} parameters, AdamW, fp32")
    print(f"{'kind':<10} {'WORKER_MEMORY':<14} {'peak per container, MiB':<26} {'wall s':>6}  ending")
    for label, r in runs.items():
        kind = r["kind"] + (" (ref)" if label == "reference" else "")
        peaks = ", ".join("?" if c["peak_mib"] is None else str(c["peak_mib"]) for c in r["containers"])
        limit = "none" if r["memory"] == "0" else r["memory"]
        print(f"{kind:<10} {limit:<14} {peaks:<26} {r['wall_s']:>6}  {ending(r, runs['reference'])}")


def psi() -> int:
    return WIDTH * 32 + WIDTH + DEPTH * (WIDTH * WIDTH + WIDTH) + WIDTH * 8 + 8


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.memory_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of kinds to run (default {KINDS})")
    parser.add_argument("--memory", default=WORKER_MEMORY, help=f"WORKER_MEMORY of each run (default {WORKER_MEMORY})")
    parser.add_argument(
        "--image", default=os.environ.get("IMAGE_NAME", "ddp-cluster"), help="IMAGE_NAME (make image's)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    with tempfile.TemporaryDirectory(prefix="user-model-") as folder:  # outside the checkout, as a user's own
        runs = scenario(kinds, args.memory, args.image, f"memory-demo-{os.getpid()}", Path(folder))
    show(runs)
    checks = verdict(runs)
    print()
    for claim, held in checks:
        print(f"{'PASS' if held else 'FAIL'}: {claim}")
    return 0 if all(held for _, held in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
