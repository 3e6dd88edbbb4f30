"""The failure drills' scenarios: each one a small function that starts the project, waits for a step, injects its
fault (and any repair), returning once the fault is in; tests/e2e/drills/drills.py then waits for the end and judges.

Each ``Scenario`` says what a user should see: ``expect="finish"`` (a finished run: one FINISHED per rank of the
final world) or an exit code with the one line that names the cause (``says``); ``victims``' exit codes are not
judged (a killed container exits 137) unless ``victim_exit`` names the one they must end with; ``max_restarts`` is the
most restarts Docker may make of one container (0: compose.yaml restarts no worker, the launcher does).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from tests.e2e.drills.drill_kit import Drill, inspect, message, wait_for
from tools.compose_project import JOINED, Project, first_step_after
from tools.docker_cli import docker

# Kills the store's own python (not its init, PID 1, which ignores signals from inside): a crash, which the store's
# `restart: unless-stopped` brings back. `docker kill` would be a manual stop: Docker restarts nothing after it.
CRASH_STORE = (
    "import os\n"
    "for p in filter(str.isdigit, os.listdir('/proc')):\n"
    "    cmd = open(f'/proc/{p}/cmdline', 'rb').read()\n"
    "    if int(p) != os.getpid() and b'rendezvous_store' in cmd and b'--check' not in cmd and int(p) > 1:\n"
    "        os.kill(int(p), 9)\n"
)
# Flips 64 bytes in the middle of the newest checkpoint: a torn or rotted file that still has its name.
CORRUPT_NEWEST = (
    "import glob\n"
    "f = sorted(glob.glob('/checkpoints/step-*.pt'))[-1]\n"
    "b = bytearray(open(f, 'rb').read())\n"
    "m = len(b) // 2\n"
    "b[m : m + 64] = bytes(x ^ 0xFF for x in b[m : m + 64])\n"
    "open(f, 'wb').write(b)\n"
    "print(f)\n"
)
# The same damage to a shard of the newest complete sharded (ZeRO) checkpoint, a sharded-step-* directory holding its
# manifest (app.checkpoint_dir): the manifest's digest no longer matches the shard.
CORRUPT_NEWEST_SHARD = CORRUPT_NEWEST.replace(
    "sorted(glob.glob('/checkpoints/step-*.pt'))[-1]",
    "sorted(glob.glob('/checkpoints/sharded-step-*/manifest.json'))[-1].replace('manifest.json', '')\n"
    "f = sorted(glob.glob(f + 'shard-*.pt'))[-1]",
)
FILL_DISK = "dd if=/dev/zero of=/checkpoints/.fill bs=1M 2>/dev/null; df -k /checkpoints | tail -1"
# SIGSTOPs this container's trainer (the launcher's largest child; the launcher itself, its agent's heartbeat and the
# container all stay up): a rank that stops making progress without dying, which no keep-alive notices.
FIND_TRAINER = (
    "import os, signal, time\n"
    "def read(p, f): return open(f'/proc/{p}/{f}', 'rb').read()\n"
    "def parent(p): return int(read(p, 'stat').rsplit(b')', 1)[1].split()[1])\n"
    "pids = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]\n"
    "launchers = {p for p in pids if b'app.cluster.launch' in read(p, 'cmdline') and parent(p) == 1}\n"
    "kids = [p for p in pids if parent(p) in launchers]\n"
    "trainer = max(kids, key=lambda p: int(read(p, 'statm').split()[1]))\n"
)
STOP_TRAINER = FIND_TRAINER + "os.kill(trainer, signal.SIGSTOP)\nprint(trainer)\n"
# SIGKILLs this container's trainer the moment a shard's temporary file is on the volume (app.files.write_atomically
# writes sharded-step-*/.shard-*.pt.tmp-<pid>, then renames it): a worker lost in the middle of a sharded save.
KILL_DURING_SHARD_WRITE = (
    FIND_TRAINER
    + "import glob\n"
    + (
        "deadline = time.time() + 300\n"
        "while time.time() < deadline:\n"
        "    writing = glob.glob('/checkpoints/sharded-step-*/.shard-*.tmp-*')\n"
        "    if writing:\n"
        "        os.kill(trainer, signal.SIGKILL)\n"
        "        print(trainer, 'killed while writing', writing[0])\n"
        "        break\n"
        "    time.sleep(0)\n"  # no nap: on a loaded machine a 1 ms sleep oversleeps the whole write
    )
)
# A model whose training needs more than OOM_MEMORY (mini_mlp at hidden 8000: 64M parameters, ~1.3 GB of parameters,
# gradients, buckets and AdamW state), while the launcher and an idle trainer fit.
OOM_MEMORY, OOM_MODEL = "900m", '{"hidden": 8000}'


# Each step takes at least this long (DDP_MIN_STEP_SECONDS) where a drill's verdict needs the run to outlast a deadline
# (a page due within ALERT_WITHIN_S, the spare's refusal after its grace): counted in steps alone, the run's length
# follows the machine's speed and load, and on an idle machine it ended before the deadline.
PACED_STEP_SECONDS = 0.1


@dataclass
class Scenario:
    what: str  # the table's first column
    inject: object  # (Drill) -> None
    expect: str | int = "finish"
    says: str = ""  # the one line a clear ending prints (a substring)
    env: dict[str, str] = field(default_factory=dict)
    small_disk: bool = False
    max_restarts: int = 0
    victims: int = 0  # how many containers the fault takes (their exit codes are not judged)
    victim_exit: int | None = None  # unless given here: the victims' own exit code (one too many: 2)
    pages: bool = False  # the fault must page DDPRankDown naming the victim's rank within ALERT_WITHIN_S
    control: bool = False  # no fault at all: no alert may fire
    after: object = None  # (Drill) -> None: measures taken once every worker has exited, before the project goes
    checks: object = None  # (result) -> {check: ok}: the scenario's own checks, beside every drill's


def survivor(d: Drill, *not_these: str) -> str:
    return next(c for c in d.containers() if inspect(c)["state"] == "running" and c not in not_these)


def rank_of(d: Drill, container: str) -> int | None:
    """The rank ``container`` holds in the newest world it joined (app.cluster.launch's join lines)."""
    held = None
    for _, line in d.p.lines():
        if (m := JOINED.search(line)) and (container.startswith(m[1]) or m[1].startswith(container)):
            held = int(m[3])
    return held


def kill_rank(rank: int):
    def inject(d: Drill) -> None:
        d.start(at_step=d.args.at_step)
        victim = d.rank_container(rank)
        d.notes["victim"], d.notes["victim_rank"] = inspect(victim)["name"], rank
        docker("kill", victim)
        d.fault()  # once Docker has done it: a busy machine can take seconds to run the command

    return inject


def crash_store(d: Drill) -> None:
    d.start(at_step=d.args.at_step)
    store = d.containers("rendezvous")[0]
    docker("exec", store, "python", "-c", CRASH_STORE, check=False)  # the exec dies with the store: no exit code
    d.fault()
    back = wait_for(lambda: inspect(store)["restart_count"] >= 1 and inspect(store)["state"] == "running", 120)
    d.notes["store_back_s"] = round(time.time() - d.fault_t, 1) if back else None


def fill_disk(d: Drill) -> None:
    d.start(at_step=d.args.at_step)
    d.notes["disk_after_fill"] = docker("exec", survivor(d), "sh", "-c", FILL_DISK).stdout.strip()
    d.fault()


def corrupt_newest(script: str = CORRUPT_NEWEST):
    def inject(d: Drill) -> None:
        d.start(at_step=d.args.at_step)
        victim = d.rank_container(0)  # the writer: nothing writes a newer checkpoint over the damaged one
        d.notes["victim"], d.notes["victim_rank"] = inspect(victim)["name"], 0
        docker("kill", victim)
        d.fault()
        d.notes["corrupted"] = docker("exec", survivor(d, victim), "python", "-c", script).stdout.strip()

    return inject


def kill_during_shard_write(d: Drill) -> None:
    d.start(at_step=d.args.at_step)
    victim = next(c for c in d.containers() if c != d.rank_container(0))
    d.notes["victim"], d.notes["victim_rank"] = inspect(victim)["name"], rank_of(d, victim)
    d.notes["killed"] = docker("exec", victim, "python", "-c", KILL_DURING_SHARD_WRITE, timeout=330).stdout.strip()
    d.fault()


def stop_trainer(d: Drill) -> None:
    d.start(at_step=d.args.at_step)
    victim = next(c for c in d.containers() if c != d.rank_container(0))
    d.notes["victim"], d.notes["victim_rank"] = inspect(victim)["name"], rank_of(d, victim)
    d.notes["stopped_pid"] = docker("exec", victim, "python", "-c", STOP_TRAINER).stdout.strip()
    d.fault()
    d.notes["stop_to_next_world_s"] = wait_seconds(d, d.fault_t, d.workers - 1) or wait_seconds(d, d.fault_t, d.workers)


def stop_then_start(d: Drill) -> None:
    d.start(at_step=d.args.at_step)
    d.fault()
    d.p.compose("stop", "-t", "30", "worker", timeout=300)
    d.notes["stop_took_s"] = round(time.time() - d.fault_t, 1)
    d.notes["stopped_exit_codes"] = [inspect(c)["exit_code"] for c in d.containers()]
    started = time.time()
    d.p.compose("start", "worker", timeout=300)
    d.notes["start_to_step_s"] = wait_seconds(d, started, d.workers)


def scale_down_up(d: Drill) -> None:
    d.start(at_step=d.args.at_step)
    d.fault()
    d.p.compose("up", "-d", "--no-build", "--no-recreate", "--scale", f"worker={d.workers - 1}", "worker")
    d.notes["down_to_step_s"] = wait_seconds(d, d.fault_t, d.workers - 1)
    up = time.time()
    d.p.compose("up", "-d", "--no-build", "--no-recreate", "--scale", f"worker={d.workers}", "worker")
    d.notes["up_to_step_s"] = wait_seconds(d, up, d.workers)


def pause_peer(d: Drill) -> None:
    d.start(at_step=d.args.at_step)
    victim = next(c for c in d.containers() if c != d.rank_container(0))
    d.notes["victim"], d.notes["victim_rank"] = inspect(victim)["name"], rank_of(d, victim)
    docker("pause", victim)
    d.fault()
    try:
        d.notes["pause_to_smaller_world_s"] = wait_seconds(d, d.fault_t, d.workers - 1)
    finally:
        back = time.time()
        docker("unpause", victim)
    d.notes["unpause_to_full_world_s"] = wait_seconds(d, back, d.workers)


def partition_peer(d: Drill) -> None:
    d.start(at_step=d.args.at_step)
    victim = next(c for c in d.containers() if c != d.rank_container(0))
    d.notes["victim"], d.notes["victim_rank"] = inspect(victim)["name"], rank_of(d, victim)
    network = f"{d.p.name}_default"
    docker("network", "disconnect", network, victim)
    d.fault()
    try:
        d.notes["cut_to_smaller_world_s"] = wait_seconds(d, d.fault_t, d.workers - 1)
    finally:
        back = time.time()
        docker("network", "connect", network, victim, check=False)  # a container that exited meanwhile: no-op
    d.notes["reconnect_to_full_world_s"] = wait_seconds(d, back, d.workers)


def bad_setting(d: Drill) -> None:
    d.fault()  # the fault is there from the start
    d.start()


def one_too_many(d: Drill) -> None:
    d.fault()
    d.start()  # --workers containers for a world of at most --workers - 1 (MAX_WORKERS below)


def healthy(d: Drill) -> None:
    d.start()  # no fault: the control (no alert may fire)


def wait_seconds(d: Drill, since: float, world: int) -> float | None:
    """Seconds from ``since`` to rank 0's first step in a world of ``world`` (None: not within --bound)."""
    found = {}

    def trained() -> bool:
        found["t"] = first_step_after(d.p.lines(), since, world)
        return found["t"] is not None

    return round(found["t"] - since, 1) if wait_for(trained, d.args.bound, poll_s=2.0) else None


# heal=in_place (app.worker.heal): the survivors agree on a new world at the compose store and redo only the failed
# step. float64: the healed world of 2 sums in another order than the world of 3, and only in float64 is that rounding
# far below what a wrong heal (a step lost or applied twice) would leave.
HEAL_IN_PLACE = {"DDP_HEAL": "in_place", "DDP_HEAL_STORE": "rendezvous:29400", "DDP_DTYPE": "float64"}
# Paced where a container is brought back: it must find the world still training once its own start-up is done.
HEAL_PACED = {**HEAL_IN_PLACE, "DDP_MIN_STEP_SECONDS": str(PACED_STEP_SECONDS)}
HEAL_WITHIN_S = 10  # issue 41's bar: kill -> the survivors' next finished step
# The final parameters against the uninterrupted run's, as tests/integration/test_heal.py compares them in float64.
HEAL_RTOL, HEAL_ATOL = 1e-9, 1e-12
# A survivor's launcher ends this soon after the last FINISHED: its exit barrier waits for the healed world's
# launchers (app.cluster.elastic), not for the lost one's, which torch's barrier would wait out (300 s).
EXIT_WITHIN_S = 30
HEALING = re.compile(r"WARNING rank (\d+): .* at step (\d+); healing in place")
HEALED = re.compile(r"rank (\d+) of (\d+) \(was (\d+) of \d+\): world (\d+) healed in ([\d.]+) s.*next step (\d+)")
HEAL_STEP = re.compile(r"WARNING heal: step (\d+) finished [\d.]+ s after (.*) \(at unix time ([\d.]+)\)")
NEWCOMER_JOINED = re.compile(r"WARNING rank (\d+) joined a world of (\d+) at step (\d+)")
NEWCOMER_LAUNCH = "joining its live world of"  # app.cluster.newcomer's line: this container did not enter torchrun's
ASKED = "this rank asked to join"  # a newcomer's own first finished step (app.worker.heal.Healer.after_step)


def replica(line: str) -> str:
    """The compose replica a log line came from (worker-2): a container keeps it across a restart."""
    return message(line).split(":", 1)[0]


def ranks_now(d: Drill) -> dict[str, int]:
    """Each worker replica's rank in the newest world it is in: torchrun's join line, then every heal in place and
    a newcomer's joining renumber them (the member with the most steps first, app.worker.heal.order)."""
    ranks: dict[str, int] = {}
    for _, line in d.p.lines():
        if m := (JOINED.search(line) or HEALED.search(line) or NEWCOMER_JOINED.search(line)):
            ranks[replica(line)] = int(m[3] if m.re is JOINED else m[1])
    return ranks


def replica_of(container: str) -> str:
    """A container's compose replica (worker-2), as ``replica`` reads it off its log lines."""
    return "-".join(inspect(container)["name"].rsplit("-", 2)[-2:])


def container_of(d: Drill, name: str) -> str:
    return next(c for c in d.containers() if replica_of(c) == name)


def started_at(container: str) -> float:
    """When Docker last started ``container`` (unix time; its State.StartedAt, nanoseconds cut to microseconds)."""
    import datetime
    import json

    raw = json.loads(docker("inspect", container).stdout)[0]["State"]["StartedAt"]
    whole, _, frac = raw.rstrip("Z").partition(".")
    stamp = datetime.datetime.fromisoformat(f"{whole}.{(frac + '000000')[:6]}+00:00")
    return stamp.timestamp()


def run_reference(d: Drill) -> None:
    """The uninterrupted run: its own project, the same settings; its final parameters are the drill's reference."""
    ref = Project(f"{d.p.name}-ref", {**d.p.env})
    ref.env["RUN_ID"] = ref.name
    try:
        ref.compose("up", "-d", "--no-build", "--scale", f"worker={d.workers}", "worker", timeout=600)
        ref.wait_until(lambda: ref.all_exited(d.workers), d.args.start_timeout, "the uninterrupted run finishing")
        d.notes["reference_exit_codes"] = sorted(r["ExitCode"] for r in ref.workers())
        d.reference = ref.final_parameters(int(d.p.env["DDP_STEPS"]))
    finally:
        ref.down()


def kill_holder(rank: int | None):
    """A heal fault: ``docker kill`` of the container holding ``rank`` now (None: the highest rank, so that the
    healed world's ranks are the same numbers but one and a page can name only the lost one)."""

    def fault(d: Drill, world: int) -> dict:
        ranks = ranks_now(d)
        running = {replica_of(c) for c in d.containers() if inspect(c)["state"] == "running"}
        held = {r: name for name, r in ranks.items() if name in running}
        name = held[max(held) if rank is None else rank]
        at = time.time()  # before the command: the survivors may see the loss before it returns
        docker("kill", container_of(d, name))
        return {"fault": f"kill rank {ranks[name]} ({name})", "kind": "kill", "at": at, "world": world - 1,
                "healers": world - 1, "container": name}  # fmt: skip

    return fault


def bring_back(d: Drill, world: int) -> dict:
    """A heal fault: the killed container started again (``docker compose up -d --scale worker=N --no-recreate``):
    it must heal into the live world as a newcomer, given the state by a peer, no survivor restarted."""
    gone = [c for c in d.containers() if inspect(c)["state"] == "exited"]
    d.p.compose("up", "-d", "--no-build", "--no-recreate", "--scale", f"worker={d.workers}", "worker")
    name = replica_of(gone[0])
    return {"fault": f"{name} started again", "kind": "up", "at": started_at(gone[0]), "world": world + 1,
            "healers": world, "container": name}  # fmt: skip


def pause_holder(d: Drill, world: int) -> dict:
    """A heal fault: the highest rank's container ``docker pause``d: its peers' collective times out
    (collective_timeout_seconds), they heal without it; it stays paused until the next fault."""
    held = {r: name for name, r in ranks_now(d).items() if inspect(container_of(d, name))["state"] == "running"}
    name = held[max(held)]
    at = time.time()
    docker("pause", container_of(d, name))
    return {"fault": f"pause rank {max(held)} ({name})", "kind": "pause", "at": at, "world": world - 1,
            "healers": world - 1, "container": name, "bound_s": d.args.collective_timeout + HEAL_WITHIN_S}  # fmt: skip


def unpause(d: Drill, world: int) -> dict:
    """A heal fault: the paused container unpaused. Its trainer finds its collective failed and heals too: too late
    for the world its peers formed, it asks for the next and is taken in with a live peer's state (its own is stale)."""
    paused = next(c for c in d.containers() if inspect(c)["state"] == "paused")
    at = time.time()
    docker("unpause", paused)
    return {"fault": f"{replica_of(paused)} unpaused", "kind": "unpause", "at": at, "world": world + 1,
            "healers": world + 1, "container": replica_of(paused)}  # fmt: skip


def heal_in_place(*faults):
    """heal=in_place: the uninterrupted run first, then this one with ``faults`` one after the other, each once the
    world has healed from the one before (every member of the new world finished a step after it)."""

    def inject(d: Drill) -> None:
        run_reference(d)
        d.start(at_step=d.args.at_step)
        world, done = d.workers, []
        for fault in faults:
            if done:
                wait_healed(d, done[-1])
            done.append(fault(d, world))
            world = done[-1]["world"]
            if len(done) == 1:
                d.fault()
                first = done[0]
                d.notes["kill_sent_at"], d.notes["victim"] = first["at"], first["container"]
                d.notes["victim_rank"] = int(first["fault"].split()[2]) if first["kind"] != "up" else None
        d.notes["faults"] = done
        d.notes["victim_ranks"] = [int(f["fault"].split()[2]) for f in done if f["kind"] in ("kill", "pause")]

    return inject


def wait_healed(d: Drill, fault: dict) -> None:
    """Until every member of the world after ``fault`` has logged its first finished step after it."""

    def healed() -> bool:
        return sum(t > fault["at"] and bool(HEAL_STEP.search(line)) for t, line in d.p.lines()) >= fault["world"]

    d.p.wait_until(healed, d.args.bound, f"the world healing after: {fault['fault']}")


def measure_heal(d: Drill) -> None:
    """Per fault, what the heal lines say (each member logs them, tagged with its rank); then the final parameters
    against the uninterrupted run's."""
    lines = d.p.lines()
    faults = d.notes["faults"]
    ends = [f["at"] for f in faults[1:]] + [float("inf")]
    for fault, end in zip(faults, ends, strict=True):
        measure_one_heal(fault, [(t, line) for t, line in lines if fault["at"] < t <= end])
    kills = [f["fault_to_next_step_s"] for f in faults if f["kind"] == "kill"]
    ups = [f["start_to_newcomer_step_s"] for f in faults if f["kind"] == "up"]
    if kills:
        d.notes["kill_to_next_step_s"] = None if None in kills else max(kills)
    if ups:
        d.notes["start_to_newcomer_step_s"] = None if None in ups else max(ups)
    for kind, note in (("pause", "pause_to_next_step_s"), ("unpause", "unpause_to_step_s")):
        if found := [f["fault_to_next_step_s"] for f in faults if f["kind"] == kind]:
            d.notes[note] = None if None in found else max(found)
    d.notes["heal_s"] = max((f["heal_s"] or 0 for f in faults), default=None)
    redone = [f["redone"] for f in faults]
    d.notes["steps_redone_beyond_failed"] = None if None in redone else max(redone)
    d.notes["healed"] = all(f["healed_members"] == f["healers"] for f in faults)
    finished = [t for t, line in lines if "FINISHED rank=" in line]
    done = [t for t, line in lines if "INFO the workers finished: exit 0" in line]
    d.notes["finished_to_exit_s"] = round(max(done) - max(finished), 1) if finished and done else None
    d.notes["new_torchrun_world"] = any(JOINED.search(line) for t, line in lines if t > faults[0]["at"])
    d.notes["newcomer_launches"] = sum(NEWCOMER_LAUNCH in line for _, line in lines)
    compare_parameters(d)


def measure_one_heal(fault: dict, lines: list[tuple[float, str]]) -> None:
    """One heal: its members' first finished steps (the unix time each logs), the steps it redid beyond the failed
    one (the world resumes at the failed step, or past it where a survivor had completed it), the heal's seconds."""
    steps = [(m[2], float(m[3]), replica(line)) for _, line in lines if (m := HEAL_STEP.search(line))]
    healed = [(replica(line), int(m[6]), float(m[5])) for _, line in lines if (m := HEALED.search(line))]
    failed = [int(m[2]) for _, line in lines if (m := HEALING.search(line))]
    fault["healed_members"], fault["heal_s"] = len(healed), max((s for *_, s in healed), default=None)
    members = [t for why, t, _ in steps if why != ASKED]
    complete = len(members) >= fault["healers"]
    fault["fault_to_next_step_s"] = round(max(members) - fault["at"], 2) if complete else None
    if fault["kind"] == "up":
        mine = [t for why, t, name in steps if why == ASKED and name == fault["container"]]
        fault["start_to_newcomer_step_s"] = round(mine[0] - fault["at"], 2) if mine else None
    resumed = [n for _, n, _ in healed]
    fault["redone"] = max(0, max(failed) - min(resumed)) if failed and resumed else None


def compare_parameters(d: Drill) -> None:
    import torch

    got = d.p.final_parameters(int(d.p.env["DDP_STEPS"]))
    ref = d.reference
    diff = max((got[k].double() - ref[k].double()).abs().max().item() for k in ref)
    close = all(torch.allclose(got[k].double(), ref[k].double(), rtol=HEAL_RTOL, atol=HEAL_ATOL) for k in ref)
    d.notes["max_abs_param_diff"], d.notes["params_equal"] = diff, close and got.keys() == ref.keys()


def heal_checks(r: dict) -> dict[str, bool]:
    faults = r.get("faults") or []
    kills, ups = [f for f in faults if f["kind"] == "kill"], [f for f in faults if f["kind"] == "up"]
    checks = {
        "the uninterrupted run: every worker exited 0": r.get("reference_exit_codes") == [0] * len(r["containers"]),
        "every member of each new world healed in place (no new torchrun world, no resume)": (
            r.get("healed") is True and r.get("new_torchrun_world") is False and r["resumed_from_step"] is None
        ),
        "0 steps redone beyond the failed one": r.get("steps_redone_beyond_failed") == 0,
        f"the survivors' launchers exited within {EXIT_WITHIN_S} s of the last FINISHED": (
            r.get("finished_to_exit_s") is not None and r["finished_to_exit_s"] <= EXIT_WITHIN_S
        ),
        f"final parameters equal the uninterrupted run's (float64, rtol {HEAL_RTOL:g}, atol {HEAL_ATOL:g})": (
            r.get("params_equal") is True
        ),
    }
    for f in kills:
        next_s = f.get("fault_to_next_step_s")
        checks[f"{f['fault']} -> survivors' next finished step <= {HEAL_WITHIN_S} s"] = (
            next_s is not None and next_s <= HEAL_WITHIN_S
        )
    for f in ups:
        first_s = f.get("start_to_newcomer_step_s")
        checks[f"{f['fault']}: container start -> its first finished step as a newcomer <= {HEAL_WITHIN_S} s"] = (
            first_s is not None and first_s <= HEAL_WITHIN_S
        )
    for f in [f for f in faults if f["kind"] == "pause"]:
        next_s = f.get("fault_to_next_step_s")
        checks[f"{f['fault']} -> the others' next finished step <= {f['bound_s']:g} s (the collective timeout + "
               f"{HEAL_WITHIN_S} s)"] = next_s is not None and next_s <= f["bound_s"]  # fmt: skip
    for f in [f for f in faults if f["kind"] == "unpause"]:
        checks[f"{f['fault']}: it rejoined (every member of the world of {f['world']} finished a step after it), "
               "and every container exited 0"] = f.get("fault_to_next_step_s") is not None and all(
            c["exit_code"] == 0 for c in r["containers"])  # fmt: skip
    if ups:
        checks["each container brought back joined as a newcomer, and every container exited 0"] = r.get(
            "newcomer_launches"
        ) == len(ups) and all(c["exit_code"] == 0 for c in r["containers"])
    return checks


def scenarios(workers: int) -> dict[str, Scenario]:
    """Every drill, in the order ``make drills`` runs them."""
    return {
        "healthy": Scenario("no fault (the control: no alert may fire)", healthy, control=True),
        "worker-kill": Scenario("a worker killed (`docker kill`, rank 1)", kill_rank(1), victims=1, pages=True),
        "rank0-kill": Scenario("rank 0's container killed", kill_rank(0), victims=1, pages=True),
        "store-crash": Scenario(
            "the store's process killed (SIGKILL: a crash; `docker kill` is a manual stop, never restarted)",
            crash_store,
        ),
        "full-disk": Scenario(
            "the checkpoint volume filled (16 MiB tmpfs, `dd`)",
            fill_disk,
            expect=1,
            says="could not take the checkpoint",
            small_disk=True,
        ),
        "corrupt-checkpoint": Scenario(
            "the newest checkpoint corrupted, rank 0 killed", corrupt_newest(), victims=1, pages=True
        ),
        "bad-setting": Scenario(
            "a bad setting (`DDP_LR=-1`)", bad_setting, expect=2, says="config error: lr=-1", env={"DDP_LR": "-1"}
        ),
        "one-too-many": Scenario(
            f"{workers} containers, MAX_WORKERS={workers - 1}",
            one_too_many,
            # Paced: the spare is refused after the launcher's 20 s grace, and an unpaced world could finish first.
            env={"MAX_WORKERS": str(workers - 1), "WORKERS": "", "DDP_MIN_STEP_SECONDS": str(PACED_STEP_SECONDS)},
            victims=1,
            victim_exit=2,
        ),
        "stop-start": Scenario("every worker stopped, then started", stop_then_start),
        "scale-down-up": Scenario(f"scaled to {workers - 1}, then back to {workers}", scale_down_up, victims=1),
        "pause": Scenario("a peer paused (`docker pause`), unpaused later", pause_peer),
        "partition": Scenario("a peer cut off its network, reconnected later", partition_peer, victims=1, pages=True),
        "trainer-sigstop": Scenario(
            "a peer's trainer SIGSTOPped (its launcher and container stay up): a hang", stop_trainer, pages=True
        ),
        "out-of-memory": Scenario(
            f"every worker over its memory (WORKER_MEMORY={OOM_MEMORY}, a 64M-parameter model under ddp)",
            bad_setting,
            expect=1,
            says="was killed for memory",
            env={"WORKER_MEMORY": OOM_MEMORY, "DDP_MODEL_KWARGS": OOM_MODEL},
        ),
        **heal_scenarios(workers),
        **sharded_scenarios(),
    }


def heal_scenarios(workers: int) -> dict[str, Scenario]:
    """The heal=in_place drills (issue 41): each fault, then measured and checked as one heal per fault."""

    def heal(text: str, *faults, env=HEAL_IN_PLACE, victims: int = 1, victim_exit: int | None = 137) -> Scenario:
        return Scenario(text, heal_in_place(*faults), env=env, victims=victims, victim_exit=victim_exit,
                        after=measure_heal, checks=heal_checks)  # fmt: skip

    last = workers - 1
    return {
        "heal-in-place-kill": heal(
            f"heal=in_place: the last worker killed (rank {last}); the survivors heal, compared with an uninterrupted "
            "run",
            kill_holder(None),
        ),
        "heal-in-place-scale-up": heal(
            f"heal=in_place: {workers} → {last} → {workers}: the last worker killed, then its container started "
            "again; it heals in as a newcomer (no survivor restarted)",
            kill_holder(None),
            bring_back,
            env=HEAL_PACED,
            victim_exit=None,
        ),
        "heal-in-place-rank0": heal("heal=in_place: rank 0's container killed; the survivors heal", kill_holder(0)),
        "heal-in-place-two-kills": heal(
            f"heal=in_place: two kills in a row ({workers} → {last} → {workers - 2}), the second after the first heal",
            kill_holder(None),
            kill_holder(None),
            env=HEAL_PACED,
            victims=2,
        ),
        "heal-in-place-pause": heal(
            f"heal=in_place: a worker paused (`docker pause`, rank {last}) past the collective timeout, the others "
            "heal without it; unpaused, it rejoins with a live peer's state",
            pause_holder,
            unpause,
            env={**HEAL_PACED, "DDP_STEPS": "1000"},  # paced: still training after the 30 s timeout and the rejoin
            victim_exit=None,
        ),
    }


def sharded_scenarios() -> dict[str, Scenario]:
    """The drills of the ZeRO stages and of the recipe: the same faults, other kinds of run."""
    zero2, zero3 = {"DDP_PARALLEL": "zero2"}, {"DDP_PARALLEL": "zero3"}
    recipe = {"DDP_AUTOCAST": "bf16", "DDP_LR_SCHEDULE": "cosine", "DDP_WARMUP_STEPS": "5", "DDP_GRAD_CLIP_NORM": "1"}
    return {
        "zero2-kill": Scenario("a worker killed under parallel=zero2", kill_rank(1), env=zero2, victims=1, pages=True),
        "zero3-kill": Scenario(
            "a worker killed under parallel=zero3",
            kill_rank(1),
            env={**zero3, "DDP_STEPS": "300"},  # zero3's steps are slower: a run that pages still ends in --bound
            victims=1,
            pages=True,
        ),
        "zero3-bf16-kill": Scenario(
            "a worker killed under parallel=zero3 with bf16 autocast, a cosine schedule and clipping",
            kill_rank(1),
            env={**zero3, **recipe},
            victims=1,
        ),
        "zero3-kill-while-saving": Scenario(
            "a worker's trainer killed while a zero3 sharded checkpoint is being written",
            kill_during_shard_write,
            # Shards that take a while to write (mini_mlp at hidden 2048: 4.3M parameters, ~17 MB a shard) and short
            # steps (a global batch of 96), so that a save comes every few seconds.
            env={**zero3, "DDP_MODEL_KWARGS": '{"hidden": 2048}', "DDP_EFFECTIVE_BATCH": "96"},
        ),
        "zero3-corrupt-shard": Scenario(
            # The resume sets the damaged checkpoint aside (a warning naming the shard) and resumes the one before.
            "the newest shard corrupted under parallel=zero3, rank 0 killed",
            corrupt_newest(CORRUPT_NEWEST_SHARD),
            env=zero3,
            victims=1,
        ),
        "zero2-full-disk": Scenario(
            "the checkpoint volume filled under parallel=zero2",
            fill_disk,
            expect=1,
            says="could not take the checkpoint",
            env=zero2,
            small_disk=True,
        ),
    }
