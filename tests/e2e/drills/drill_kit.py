"""The harness every failure drill of tests/e2e/drills/drills.py shares: start a compose project, wait for a step,
note when the fault came, wait for the end, and collect the same measurements from Docker and the logs.

Measured for every drill (``Drill.collect``): fault -> the first step of a new world, the last step logged before
the fault and the step resumed from (their difference: steps redone), every container's exit code and Docker's
RestartCount, the FINISHED lines (one per rank of the final world, never a second world's), tracebacks, the first
error lines after the fault, and the alerts the project's own Prometheus had pending or firing (polled every
``ALERT_POLL_S`` from the start: docker/prometheus/alerts.yml, evaluated every 5 s). There is no Alertmanager image
on this project's machines (compose.local.yaml builds one from Debian's package, slowly): the alerts are read from
Prometheus' /api/v1/alerts, which is what Alertmanager would be sent.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

from tools.compose_project import RESUMED, STEP, WORLD, Project, project_env, steps_redone
from tools.docker_cli import STAMP, docker

FINISHED = re.compile(r"FINISHED rank=(\d+) world_size=(\d+) step=(\d+)")
PROBLEM = re.compile(r" (ERROR|WARNING) |config error: ")  # the trainer says its refusal bare, one line
HERE = Path(__file__).resolve().parent
OVERRIDE = HERE / "drills.compose.yaml"  # Prometheus on an ephemeral port of 127.0.0.1: beside other projects
SMALL_DISK = HERE / "drills.small-disk.yaml"  # the checkpoint volume on a 16 MiB tmpfs: a disk that can fill
ALERT_POLL_S = 5.0
MAX_LINES = 6


def inspect(container: str) -> dict:
    """Docker's own account of a container: state, exit code, restarts (what `docker compose ps` leaves out)."""
    info = json.loads(docker("inspect", container).stdout)[0]
    return {
        "name": info["Name"].lstrip("/").split("-", 1)[-1],  # without the project name: worker-1, rendezvous-1
        "id": info["Id"][:12],
        "state": info["State"]["Status"],
        "exit_code": info["State"]["ExitCode"],
        "restart_count": info["RestartCount"],
    }


def message(line: str) -> str:
    """A compose log line without the project prefix and Docker's timestamp: '<replica>: HH:MM:SS [who] LEVEL ...'."""
    name, _, text = line.partition(" | ")
    replica = "-".join(name.strip().rsplit("-", 2)[-2:])
    return f"{replica}: {STAMP.sub('', text, count=1).strip()}"


def wait_for(predicate, bound_s: float, poll_s: float = 1.0) -> bool:
    """Like Project.wait_until, but a bound passing is a measurement ("hung"), not an error."""
    deadline = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


class Drill:
    """One drill's compose project and what it noted: the fault's time, drill-specific measures (``notes``)."""

    def __init__(self, name: str, args, env: dict[str, str] | None = None, small_disk: bool = False):
        self.args, self.workers = args, args.workers
        self.p = Project(f"drill-{name}-{int(time.time()) % 100000}", {})
        self.p.env = {
            **project_env(self.p.name, args),
            "DDP_COLLECTIVE_TIMEOUT_SECONDS": f"{args.collective_timeout:g}",
            "LAUNCH_STORE_WAIT_SECONDS": f"{args.store_wait:g}",
            "DDP_METRICS_LINGER_SECONDS": "6",  # scraped once more at the end (5 s): no false DDPRankDown
            **(env or {}),
        }
        files = [self.p.env.get("COMPOSE_FILE", "compose.yaml"), str(OVERRIDE)] + (
            [str(SMALL_DISK)] if small_disk else []
        )
        self.p.env["COMPOSE_FILE"] = ":".join(files)
        self.fault_t: float | None = None
        self.notes: dict = {}
        self.reference: dict | None = None  # an uninterrupted run's final parameters, where a scenario compares
        self.alerts: dict[tuple[str, str], dict] = {}
        self._polling = threading.Event()
        self._prometheus_port: str | None = None

    # -- the project -------------------------------------------------------------------------------------------
    def start(self, workers: int | None = None, at_step: int | None = None) -> None:
        services = ["worker"] + (["prometheus"] if self.args.alerts else [])
        n = workers or self.workers
        self.p.compose("up", "-d", "--no-build", "--scale", f"worker={n}", *services, timeout=600)
        if self.args.alerts:
            threading.Thread(target=self._poll_alerts, daemon=True, name="alerts").start()
        if at_step is not None:
            self.wait_step(at_step)
        if self.args.alerts and at_step is not None:
            # A page can name only a rank Prometheus has scraped: rank 0 killed seconds after its trainer started,
            # before any scrape had seen its ddp_rank_info, left DDPRankDown nothing to name, and the drill failed.
            self.p.wait_until(lambda: self.ranks_seen() >= n, self.args.start_timeout, f"Prometheus seeing {n} ranks")

    def ranks_seen(self) -> int:
        """How many ranks the project's Prometheus has a ``ddp_rank_info`` of (0 while it starts)."""
        found = self._prometheus("/api/v1/query?query=count(ddp_rank_info)")
        return int(float(found["data"]["result"][0]["value"][1])) if found and found["data"]["result"] else 0

    def _prometheus(self, path: str) -> dict | None:
        try:
            if self._prometheus_port is None:  # published on an ephemeral port (drills.compose.yaml)
                published = self.p.compose("port", "prometheus", "9090").stdout.strip()
                self._prometheus_port = published.rpartition(":")[2] or None
            with urllib.request.urlopen(f"http://127.0.0.1:{self._prometheus_port}{path}", timeout=5) as r:
                return json.load(r)
        except Exception:  # noqa: BLE001 - Prometheus starting, or gone at the end: the caller asks again
            return None

    def wait_step(self, step: int) -> None:
        self.p.wait_until(lambda: self.p.last_step() >= step, self.args.start_timeout, f"rank 0 logging step {step}")

    def fault(self) -> float:
        self.fault_t = time.time()
        return self.fault_t

    def containers(self, service: str = "worker") -> list[str]:
        return self.p.compose("ps", "-a", "-q", service).stdout.split()

    def rank_container(self, rank: int) -> str:
        found = self.p.rank_container(rank)
        if found is None:
            raise RuntimeError(f"no container holds rank {rank}")
        return next(c for c in self.containers() if c.startswith(found) or found.startswith(c))

    def wait_end(self) -> bool:
        """Every worker exited and nothing changed for ``--settle`` s (a poll can fall between an exit and Docker's
        on-failure restart of it), within ``--bound`` s; False: hung."""
        quiet = {"since": 0.0, "seen": None}

        def settled() -> bool:
            rows = [inspect(c) for c in self.containers()]
            seen = [(r["id"], r["state"], r["restart_count"]) for r in rows]
            if not rows or any(r["state"] != "exited" for r in rows) or seen != quiet["seen"]:
                quiet["since"], quiet["seen"] = time.monotonic(), seen
                return False
            return time.monotonic() - quiet["since"] >= self.args.settle

        return wait_for(settled, self.args.bound, poll_s=2.0)

    def down(self) -> None:
        self._polling.set()
        self.p.down()

    # -- alerts --------------------------------------------------------------------------------------------------
    def _poll_alerts(self) -> None:
        while not self._polling.wait(ALERT_POLL_S):
            found = self._prometheus("/api/v1/alerts")
            if found is None:
                continue
            now = time.time()
            for a in found["data"]["alerts"]:
                key = (a["labels"]["alertname"], a["labels"].get("rank", ""))
                seen = self.alerts.setdefault(key, {"alert": key[0], "rank": key[1], "pending_at": now})
                if a["state"] == "firing" and "firing_at" not in seen:
                    seen["firing_at"] = now

    def fired(self) -> list[dict]:
        since = self.fault_t or 0.0
        rows = []
        for a in self.alerts.values():
            t = a.get("firing_at")
            rows.append(
                {
                    "alert": a["alert"],
                    "rank": a["rank"],
                    "fired": t is not None,
                    "after_fault_s": round(t - since, 1) if t and self.fault_t else None,
                    # When it first went pending: a page late by its rule's `for:` or late to start at all.
                    "pending_after_fault_s": round(a["pending_at"] - since, 1) if self.fault_t else None,
                }
            )
        return rows

    # -- what every drill reports --------------------------------------------------------------------------------
    def collect(self, ended: bool) -> dict:
        lines = self.p.lines()
        since = self.fault_t or 0.0
        before = [int(m[1]) for t, line in lines if t <= since and (m := STEP.search(line))]
        resumed = [int(m[1]) for t, line in lines if t > since and (m := RESUMED.search(line))]
        finished = [(int(m[1]), int(m[2])) for _, line in lines if (m := FINISHED.search(line))]
        rows = [inspect(c) for c in self.containers()]
        store = [inspect(c) for c in self.containers("rendezvous")]
        problems = [message(line) for t, line in lines if t > since and PROBLEM.search(line)]
        return {
            "ended": ended,
            "fault_to_new_world_step_s": first_new_world_step(lines, since) if self.fault_t else None,
            # A finished job pages nobody (DDPRankDown is quiet after it): a page missing after an early finish
            # is the rule working, one missing long before it is not.
            "fault_to_finished_s": first_finished(lines, since) if self.fault_t else None,
            "last_step_before_fault": max(before, default=None),
            "resumed_from_step": resumed[0] if resumed else None,
            "steps_redone": steps_redone(max(before), resumed[0]) if before and resumed else None,
            "last_step": max((int(m[1]) for _, line in lines if (m := STEP.search(line))), default=0),
            "finished": {"lines": len(finished), "worlds": sorted({w for _, w in finished}), "ranks": len(finished)},
            "one_finish": one_finish(finished),
            "containers": rows,
            "store": store,
            "traceback_lines": sum("Traceback" in line for _, line in lines),
            "problems": {"count": len(problems), "first": problems[:MAX_LINES], "last": problems[-MAX_LINES:]},
            "problem_lines": problems,  # every one, for the judge (not written)
            "alerts": self.fired(),
            **self.notes,
        }


def first_finished(lines, since: float) -> float | None:
    """Seconds from ``since`` to the first FINISHED line after it (None: the job did not finish after it)."""
    return next((round(t - since, 1) for t, line in lines if t > since and FINISHED.search(line)), None)


def first_new_world_step(lines, since: float) -> float | None:
    """Seconds from ``since`` to rank 0's first step in a world formed after it (a new trainer's "training" line)."""
    new_world = False
    for t, line in lines:
        if t <= since:
            continue
        if WORLD.search(line):
            new_world = True
        elif new_world and STEP.search(line):
            return round(t - since, 1)
    return None


def one_finish(finished: list[tuple[int, int]]) -> bool:
    """One FINISHED per rank of one world: a second world (or a rank twice) would be a second finish."""
    worlds = {w for _, w in finished}
    ranks = [r for r, _ in finished]
    return len(worlds) == 1 and sorted(ranks) == list(range(next(iter(worlds))))
