"""The failure drills of docs/cluster.md's table, measured with the real Docker engine, one compose project each.

    make drills                               # = pytest -m drill tests/e2e/test_failure_drills.py (image built)
    make drills DRILL=store-crash             # one drill again: its row of bench/results/drills.json replaced
    make drills DRILL_ARGS="--no-alerts"      # other settings: a trial, written to runs/drills.json
    pytest -m drill tests/e2e/test_failure_drills.py --collect-only -q      # every drill's name
    IMAGE_NAME=ddp-drills make drills ...     # an image of your own beside other checkouts'

Each drill is a compose project of ``--workers`` (3) containers and the project's Prometheus, training ``--steps``
steps of a global batch of ``--effective-batch`` samples (large, so that a step is not instant), logging every step,
checkpointing every ``--checkpoint-every`` (the flags of ``DRILL_ARGS``). The scenarios (drill_faults.py) wait for step
``--at-step``, inject their fault (a kill, a crash of the store, a full disk, a corrupt checkpoint, a stop, a scale
change, a pause, a network cut, a bad setting, one container too many) and any repair; then every worker must exit
within ``--bound`` s (else "hung"). Measured for each (drill_kit.py): fault -> first step of a new
world, steps redone, every container's exit code and restart count, the FINISHED lines, the alerts fired.

A drill passes when its run finished (one FINISHED per rank of one world) or ended the way its scenario says (the exit
code and its one line), no container restarted more often than the scenario allows, no traceback was printed, and the
alerts told the truth: nothing on the healthy run, ``DDPRankDown`` naming the lost rank within ``ALERT_WITHIN_S`` of a
fault that takes one (``Scenario.pages``) and naming no other rank in any drill. Each drill is one test; it prints
its measurements and writes its row of bench/results/drills.json (provenance; a run cut short keeps what it
measured; a drill never run is absent and the docs table says "not run"). Each project is taken down (``docker
compose down -v``) whatever happens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tests.e2e.drills.drill_faults import PACED_STEP_SECONDS, Scenario, scenarios
from tests.e2e.drills.drill_kit import Drill, message
from tools.compose_project import Project, project_env
from tools.provenance import output_path, provenance

# Issue 23's bar: the page names the rank that is gone within a minute of the fault.
ALERT_WITHIN_S = 60
# A finished job pages nobody (DDPRankDown is quiet after it), so a drill that must page trains this many times
# --steps: its run outlasts the page's deadline (at --steps alone a run could end before the page was due to be
# judged).
PAGE_STEPS_FACTOR = 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="DRILL_ARGS", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=3, help="containers of each drill")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps of each drill's run")
    p.add_argument("--at-step", type=int, default=20, help="the fault comes once rank 0 has logged this step")
    p.add_argument("--effective-batch", type=int, default=4096, help="global batch in samples: steps take time")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--collective-timeout", type=float, default=30, help="DDP_COLLECTIVE_TIMEOUT_SECONDS (compose's)")
    p.add_argument("--store-wait", type=float, default=30, help="LAUNCH_STORE_WAIT_SECONDS (compose's)")
    p.add_argument("--bound", type=float, default=300, help="seconds each phase after a fault may take: else hung")
    p.add_argument("--settle", type=float, default=6, help="seconds every worker must stay exited to have ended")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds to reach --at-step")
    p.add_argument("--no-alerts", dest="alerts", action="store_false", help="without Prometheus (lighter)")
    p.add_argument("--no-build", action="store_true", help="use the image as built (make image)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/drills.json for the documented run)")
    return p


def judge(r: dict, s: Scenario, problem_lines: list[str], alerts: bool = True) -> dict[str, bool]:
    """The checks of one drill: what a user of the cluster would notice."""
    rows = r["containers"]
    checks = {f"every worker exited within {r['bound']:g} s": r["ended"]}
    if s.expect == "finish":
        checks["one FINISHED per rank of one world"] = r["one_finish"]
        clean = [c for c in rows if c["exit_code"] == 0]
        checks["every container but the fault's exited 0"] = len(clean) >= len(rows) - s.victims
        if s.victim_exit is not None:
            ended = [c for c in rows if c["exit_code"] == s.victim_exit]
            checks[f"the fault's {s.victims} container(s) exited {s.victim_exit}"] = len(ended) == s.victims
    else:
        said = [m for m in problem_lines if s.says in m]
        replicas = {m.split(":", 1)[0] for m in said}
        judged = len(rows) - s.victims  # a container the fault killed says nothing and exits 137
        checks[f"each worker said `{s.says}`"] = len(replicas) >= judged
        checks[f"each ended with exit {s.expect}"] = sum(c["exit_code"] == s.expect for c in rows) >= judged
        checks["no FINISHED"] = r["finished"]["lines"] == 0
    checks[f"no container restarted more than {s.max_restarts}x"] = all(
        c["restart_count"] <= s.max_restarts for c in rows
    )
    checks["no traceback"] = r["traceback_lines"] == 0
    if s.checks is not None:
        checks.update(s.checks(r))
    if alerts:
        checks.update(alert_checks(r, s))
    return checks


def alert_checks(r: dict, s: Scenario) -> dict[str, bool]:
    """What the alerts told the person on call: the lost rank by its number, soon, and nobody else."""
    fired = [a for a in r["alerts"] if a["fired"]]
    if s.control:
        return {"no alert fired": not fired}
    victim = r.get("victim_rank")
    named = {a["rank"] for a in fired if a["alert"] == "DDPRankDown"}
    checks = {}
    if s.pages:
        soon = [a for a in fired if a["alert"] == "DDPRankDown" and a["after_fault_s"] is not None]
        on_time = any(a["rank"] == str(victim) and a["after_fault_s"] <= ALERT_WITHIN_S for a in soon)
        finished = r.get("fault_to_finished_s")
        checks[f"the run lasted {ALERT_WITHIN_S} s past the fault (a page was due)"] = (
            finished is None or finished > ALERT_WITHIN_S
        )
        checks[f"DDPRankDown named rank {victim} within {ALERT_WITHIN_S} s"] = on_time
    # Two faults in a row (heal-in-place-two-kills) lose two ranks: each may be named.
    victims = {str(v) for v in r.get("victim_ranks") or ([victim] if victim is not None else [])}
    checks["DDPRankDown named no other rank"] = named <= victims
    return checks


def drill_env(s: Scenario, args) -> dict[str, str]:
    """The scenario's settings, and a longer, paced run for one that must page (PAGE_STEPS_FACTOR, PACED_STEP_SECONDS):
    counted in steps alone, a run on an idle machine finished before the page was due."""
    longer = {"DDP_STEPS": str(args.steps * PAGE_STEPS_FACTOR)} if s.pages and args.alerts else {}
    if s.pages and args.alerts:
        longer["DDP_MIN_STEP_SECONDS"] = str(PACED_STEP_SECONDS)
    return {**longer, **s.env}


def run_drill(name: str, s: Scenario, args) -> dict:
    d = Drill(name, args, env=drill_env(s, args), small_disk=s.small_disk)
    started = time.monotonic()
    try:
        s.inject(d)
        ended = d.wait_end()
        if s.after is not None and ended:
            s.after(d)
        result = d.collect(ended)
    except Exception as e:  # noqa: BLE001 - one drill failing to start must not hide the others' numbers
        tail = [message(line) for _, line in d.p.lines()[-30:]]
        result = {"error": f"{type(e).__name__}: {e}", "log_tail": tail}
    finally:
        d.down()
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())  # drills of one file may be added later
    result["what"], result["expect"], result["bound"] = s.what, s.expect, args.bound
    if "error" in result:
        result["checks"], result["passed"] = {"the drill ran": False}, False
        return result
    result["checks"] = judge(result, s, result.pop("problem_lines"), alerts=args.alerts)
    result["passed"] = all(result["checks"].values())
    return result


def show(name: str, r: dict) -> None:
    print(f"\n== {name}: {'PASS' if r['passed'] else 'FAIL'} ({r['wall_s']} s) {r['what']}")
    for check, ok in r["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {check}")
    skip = {"checks", "passed", "what", "containers", "store", "problems", "log_tail", "alerts"}
    for key, value in r.items():
        if key not in skip:
            print(f"  {key:30} {value}")
    for row in r.get("containers", []) + r.get("store", []):
        print(f"  {row['name']:30} {row['state']}, exit {row['exit_code']}, restarts {row['restart_count']}")
    for a in r.get("alerts", []):
        print(f"  alert {a['alert']} rank={a['rank']} fired={a['fired']} after_fault_s={a['after_fault_s']}")
    for line in r.get("problems", {}).get("first", []) + r.get("log_tail", []):
        print(f"    {line}")


def build_images(args) -> None:
    """The worker's image unless ``--no-build``, and Prometheus' whatever it says (`make image` builds the worker's
    only): where no registry is reachable compose.local.yaml builds it from Debian's package, and the drills'
    `up --no-build` would find none. Cached after the first build; nothing to do where the image is pulled."""
    builder = Project("drill-build", project_env("drill-build", args))
    if not args.no_build:
        builder.compose("build", "worker", timeout=1800)
    builder.compose("build", "prometheus", timeout=1800)


def results_path(parser: argparse.ArgumentParser, args) -> Path:
    # --no-build (make drills, after make image) measures the same image: still the documented run.
    return output_path(parser, argparse.Namespace(**{**vars(args), "no_build": False}), "drills")


def write_row(path: Path, name: str, result: dict, args, load_before: list[float]) -> None:
    """Replace drill ``name``'s row of the results file, keep the other drills' rows (each with its own commit and
    time), and drop rows of drills that no longer exist."""
    planned = {n: s.what for n, s in scenarios(args.workers).items()}  # the docs table lists the others "not run"
    rows = json.loads(path.read_text()).get("drills", {}) if path.exists() else {}
    rows = {n: r for n, r in rows.items() if n in planned} | {name: result | {"commit": provenance(args)["commit"]}}
    doc = {"schema": "drills/2", **provenance(args, load_before=load_before), "planned": planned}
    doc |= {"page_steps_factor": PAGE_STEPS_FACTOR, "drills": {n: rows[n] for n in planned if n in rows}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
