"""Two failure drills of docs/cluster.md's table, measured with the real Docker engine: a peer hangs, the store dies.

    make drills                      # = python -m bench.cluster.drills (Docker; builds the image once, ~10 min here)
    python -m bench.cluster.drills --no-build --drill pause
    python -m bench.cluster.drills --no-build --drill store --bound 420

Each drill is a compose project of ``--workers`` (3) containers training ``--steps`` steps of a global batch of
``--effective-batch`` samples (large, so that a step is not instant), logging every step, checkpointing every
``--checkpoint-every``. Once rank 0 has logged step ``--at-step``:

- **pause**: ``docker pause`` a worker that does not hold rank 0. Measured: pause -> the survivors' first step in a
  world of 2 (their collectives time out after DDP_COLLECTIVE_TIMEOUT_SECONDS, then they re-form); then
  ``docker unpause`` it: unpause -> the first step in a world of 3 again (or never, within ``--bound``); every
  container's exit code and restart count once the run ends.
- **store**: ``docker kill`` the ``rendezvous`` store (``docker kill``: its ``unless-stopped`` policy does not bring
  it back). Measured: kill -> each worker's first exit, kill -> every worker exited for good (``restart:
  on-failure:3`` starts them again, each to wait LAUNCH_STORE_WAIT_SECONDS for a store that stays away), the state,
  exit code and RestartCount Docker reports for each, and the one-line cause each printed.

A drill that does not end (or recover) within ``--bound`` seconds of its failure is "hung". Printed: a table of the
measurements and the one-line messages. Written: bench/results/drills.json (with provenance). Exit 0 when every drill
recovered or ended with a clear message, else 1. The projects run one after the other and are always taken down
(``docker compose down -v --remove-orphans``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from bench.cluster.chaos import STAMP, STEP, WORLD, Project, first_step_after, project_env, stamp

PAUSE_MESSAGES = re.compile(r"left the world|went away|stopped answering|re-form|joined a world|giving up")
STORE_MESSAGES = re.compile(r"rendezvous store|unreachable|lost|giving up")
MAX_MESSAGES = 10
# A launcher's last line before it exits (app/cluster/launch.py): its cause and "exit N", or the store it waited
# for in vain.
EXITING = re.compile(r"\[launch \w+\] \w+ .*(exit \d|unreachable)")
RECOVERED, HUNG = "recovered", "hung"


def ended_clearly(seconds: float) -> str:
    return f"ended with a clear message within {seconds:.0f} s"


# -- what Docker and the logs say ----------------------------------------------------------------------------------
def docker(*args: str, timeout: float = 60) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:  # Docker's own reason, not CalledProcessError's bare exit status
        raise RuntimeError(f"docker {' '.join(args)}: exit {out.returncode}: {out.stderr.strip()[-500:]}")
    return out.stdout


def inspect(container: str) -> dict:
    """Docker's own account of a container: state, exit code, restarts (what `docker compose ps` leaves out)."""
    info = json.loads(docker("inspect", container))[0]
    state = info["State"]
    return {
        "name": info["Name"].lstrip("/"),
        "id": info["Id"][:12],
        "state": state["Status"],
        "exit_code": state["ExitCode"],
        "restart_count": info["RestartCount"],
        "finished_at": state["FinishedAt"],
    }


def finished_at(row: dict) -> float | None:
    """FinishedAt as unix time; Docker's zero time (0001-01-01) for a container that never stopped."""
    return None if row["finished_at"].startswith("0001") else stamp(row["finished_at"])


def service_containers(p: Project, service: str) -> list[str]:
    return p.compose("ps", "-a", "-q", service).stdout.split()


def message(line: str) -> str:
    """A compose log line without the project prefix and Docker's timestamp: '<replica>: HH:MM:SS [who] LEVEL ...'."""
    name, _, text = line.partition(" | ")
    replica = name.strip().rsplit("-", 2)[-2:]
    return f"{'-'.join(replica)}: {STAMP.sub('', text, count=1).strip()}"


def matching(lines, pattern: re.Pattern, since: float, until: float = float("inf")) -> list[str]:
    return [message(line) for t, line in lines if since < t <= until and pattern.search(line)]


def messages(found: list[str]) -> dict:
    return {"count": len(found), "lines": found[:MAX_MESSAGES]}


def last_step(lines) -> int:
    return max((int(m[1]) for _, line in lines if (m := STEP.search(line))), default=0)


def container_of(row_id: str, short_id: str | None) -> bool:
    return bool(short_id) and (row_id.startswith(short_id) or short_id.startswith(row_id))


def seconds(t: float | None, since: float) -> float | None:
    return round(t - since, 1) if t is not None else None


def wait_for(predicate, bound_s: float, poll_s: float = 1.0) -> bool:
    """Like Project.wait_until, but a bound passing is a measurement ("hung"), not an error."""
    deadline = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def start(p: Project, args) -> None:
    p.compose("up", "-d", "--no-build", "--scale", f"worker={args.workers}", "worker")
    p.wait_until(lambda: p.last_step() >= args.at_step, args.start_timeout, f"rank 0 logging step {args.at_step}")


# -- drill 1: a peer hangs -----------------------------------------------------------------------------------------
def drill_pause(p: Project, args) -> dict:
    start(p, args)
    rank0 = p.rank_container(0)
    victim = next(r["ID"] for r in p.workers() if r["State"] == "running" and not container_of(r["ID"], rank0))
    at_step = p.last_step()
    paused, refused = pause(victim)
    trained = {}

    def on(world: int, since: float):
        def check() -> bool:
            trained[world] = first_step_after(p.lines(), since, world)
            return trained[world] is not None

        return check

    try:
        wait_for(on(args.workers - 1, paused), args.bound)
    finally:
        unpaused = time.time()
        docker("unpause", victim)
    if trained.get(args.workers - 1) is not None:
        wait_for(on(args.workers, unpaused), args.bound)
    finished = wait_for(lambda: p.all_exited(args.workers), args.bound)
    lines = p.lines()
    rows = [inspect(r["ID"]) for r in p.workers()]
    to_smaller, to_full = trained.get(args.workers - 1), trained.get(args.workers)
    if to_smaller is None:
        verdict = HUNG
    elif finished and all(r["exit_code"] == 0 for r in rows):
        verdict = RECOVERED
    elif finished:
        verdict = ended_clearly(args.bound)
    else:
        verdict = HUNG
    return {
        "verdict": verdict,
        "paused": {"container": next((r["name"] for r in rows if container_of(r["id"], victim)), victim)},
        "paused_at_step": at_step,
        "pause_refused": refused,
        "pause_to_step_in_smaller_world_s": seconds(to_smaller, paused),
        "paused_for_s": round(unpaused - paused, 1),
        "unpause_to_step_in_full_world_s": seconds(to_full, unpaused),
        "grew_back": to_full is not None,
        "run_finished": finished,
        "last_step": last_step(lines),
        "worlds": worlds(lines, paused),
        "containers": rows,
        "traceback_lines": sum("Traceback" in line for _, line in lines),  # app's promise: one line, no traceback
        "messages_after_pause": messages(matching(lines, PAUSE_MESSAGES, paused, unpaused)),
        "messages_after_unpause": messages(matching(lines, PAUSE_MESSAGES, unpaused)),
    }


def pause(container: str, tries: int = 3) -> tuple[float, list[str]]:
    """``docker pause``, tried again: one try of the first runs here failed (the freezer of cgroup v1 can refuse a
    busy container) and the drill is about the peers' reaction, not the freezer. Returns (time, refusals)."""
    refused = []
    for _ in range(tries - 1):
        try:
            when = time.time()
            docker("pause", container)
            return when, refused
        except RuntimeError as e:
            refused.append(str(e))
            time.sleep(1.0)
    when = time.time()
    docker("pause", container)
    return when, refused


def worlds(lines, since: float) -> list[int]:
    """The world sizes rank 0 trained in from ``since`` on, in order (repeats collapsed)."""
    sizes = []
    for t, line in lines:
        if t > since and (m := WORLD.search(line)) and (not sizes or sizes[-1] != int(m[1])):
            sizes.append(int(m[1]))
    return sizes


# -- drill 2: the store dies ---------------------------------------------------------------------------------------
def drill_store(p: Project, args) -> dict:
    start(p, args)
    store = service_containers(p, "rendezvous")[0]
    at_step = p.last_step()
    killed = time.time()
    docker("kill", store)
    quiet = {"since": None, "seen": None}

    def settled() -> bool:
        # Exited for good: every worker exited and nothing changed for --settle s (a poll can fall between an exit
        # and Docker's on-failure restart of it).
        rows = [inspect(c) for c in service_containers(p, "worker")]
        seen = [(r["id"], r["state"], r["restart_count"]) for r in rows]
        if not rows or any(r["state"] != "exited" for r in rows) or seen != quiet["seen"]:
            quiet["since"], quiet["seen"] = time.monotonic(), seen
            return False
        return time.monotonic() - quiet["since"] >= args.settle

    ended = wait_for(settled, args.bound, poll_s=2.0)
    lines = p.lines()
    rows = [inspect(c) for c in service_containers(p, "worker")]
    causes = matching(lines, STORE_MESSAGES, killed)
    first_exit = first_exits(lines, killed)
    last_exit = max((t for r in rows if (t := finished_at(r)) is not None), default=None)
    if not ended:
        verdict = HUNG
    elif all(any(m.startswith(f"{replica}:") for m in causes) for replica in first_exit):
        verdict = ended_clearly(args.bound)
    else:
        verdict = "ended without a clear message"  # a replica exited without naming the store
    return {
        "verdict": verdict,
        "killed_at_step": at_step,
        "store": inspect(store),
        "kill_to_first_exit_s": {c: seconds(t, killed) for c, t in first_exit.items()},
        "kill_to_all_exited_s": seconds(last_exit, killed) if ended else None,
        "last_step": last_step(lines),
        "containers": rows,
        "traceback_lines": sum("Traceback" in line for _, line in lines),
        "messages": messages(causes),
    }


def first_exits(lines, since: float) -> dict[str, float | None]:
    """Per replica, the time of its first launcher line naming a cause after ``since`` (it exits right after)."""
    found: dict[str, float | None] = {}
    for t, line in lines:
        replica = message(line).split(":", 1)[0]
        found.setdefault(replica, None)
        if t > since and found[replica] is None and EXITING.search(line):
            found[replica] = t
    return found


# -- the run -------------------------------------------------------------------------------------------------------
DRILLS = {"pause": drill_pause, "store": drill_store}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.drills", description=__doc__.splitlines()[0])
    p.add_argument("--drill", default="all", choices=["pause", "store", "all"])
    p.add_argument("--workers", type=int, default=3, help="containers of each drill (pause leaves one fewer)")
    # Long enough that the world of 2 still has steps to train when the paused worker comes back.
    p.add_argument("--steps", type=int, default=600, help="optimizer steps of each drill's run")
    p.add_argument("--at-step", type=int, default=20, help="the failure comes once rank 0 has logged this step")
    p.add_argument("--effective-batch", type=int, default=4096, help="global batch in samples: steps take time")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--collective-timeout", type=float, default=30, help="DDP_COLLECTIVE_TIMEOUT_SECONDS (compose's)")
    p.add_argument("--store-wait", type=float, default=30, help="LAUNCH_STORE_WAIT_SECONDS (compose's)")
    p.add_argument("--bound", type=float, default=300, help="seconds each phase after a failure may take: else hung")
    p.add_argument("--settle", type=float, default=6, help="store: seconds every worker must stay exited")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds to reach --at-step")
    p.add_argument("--no-build", action="store_true", help="use the image as built (make image)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/drills.json for the documented run)")
    return p


def run_drill(name: str, args) -> dict:
    p = Project(f"drill-{name}-{os.getpid()}", {})
    p.env = {
        **project_env(p.name, args),
        "DDP_COLLECTIVE_TIMEOUT_SECONDS": f"{args.collective_timeout:g}",
        "LAUNCH_STORE_WAIT_SECONDS": f"{args.store_wait:g}",
    }
    started = time.monotonic()
    try:
        result = DRILLS[name](p, args)
    except Exception as e:  # noqa: BLE001 - one drill failing to start must not hide the other's numbers
        tail = [message(line) for _, line in p.lines()[-30:]]
        result = {"verdict": HUNG, "error": f"{type(e).__name__}: {e}", "log_tail": tail}
    finally:
        p.down()
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def show(results: dict) -> None:
    for name, r in results.items():
        print(f"\n== {name}: {r['verdict']} ({r['wall_s']} s)")
        for key, value in r.items():
            if key in ("verdict", "wall_s", "containers", "log_tail") or key.startswith("messages"):
                continue
            print(f"  {key:34} {value}")
        for row in r.get("containers", []):
            print(f"  {row['name']:34} {row['state']}, exit {row['exit_code']}, restarts {row['restart_count']}")
        for key in [k for k in r if k.startswith("messages")] + (["log_tail"] if "log_tail" in r else []):
            found = r[key] if key == "log_tail" else r[key]["lines"]
            more = "" if key == "log_tail" else f" ({r[key]['count']} in all)"
            print(f"  {key}{more}:")
            for line in found:
                print(f"    {line}")


def main(argv: list[str] | None = None) -> int:
    from bench.provenance import describe_output, load_average, output_path, provenance

    parser = build_parser()
    args = parser.parse_args(argv)
    before = load_average()
    if not args.no_build:
        Project("drill-build", project_env("drill-build", args)).compose("build", "worker", timeout=1800)
    names = list(DRILLS) if args.drill == "all" else [args.drill]
    results = {name: run_drill(name, args) for name in names}  # one after the other: 2 cores
    path = output_path(parser, args, "drills")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": "drills/1", **provenance(args, load_before=before), **results}, indent=1))
    show(results)
    print(describe_output(path))
    ok = all(r["verdict"] == RECOVERED or r["verdict"].startswith("ended with a clear") for r in results.values())
    print(f"drills: {'every drill recovered or ended with a clear message' if ok else 'a drill hung'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
