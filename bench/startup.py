"""Where `docker compose up --scale worker=4` spends its time before the first training step, phase by phase.

    make bench-startup                             # make image, then python -m bench.startup (its build: cached)
    python -m bench.startup                        # builds its own image (ddp-startup) first
    python -m bench.startup --repeats 5            # more interleaved repeats
    python -m bench.startup --variant now --repeats 1 --no-build   # one quick look
    IMAGE_NAME=my-image python -m bench.startup     # an image name of your own beside other checkouts'

Each run is a fresh compose project (its own name, network, store and checkpoint volume) of ``--workers`` worker
containers and the rendezvous store, training ``--steps`` steps; the run is timed from the moment ``docker compose
up`` is called. The phases come from Docker (``docker inspect``: each container's State.StartedAt) and from the
containers' own log lines (``docker compose logs --timestamps``: Docker's nanosecond stamp of each line):

    container start       up -> the last worker container running (Docker; and the store first, if waited for)
    launcher import       -> the last launcher's "trainer settings" line (Python, torch, the trainer's config check)
    agent + store         -> the last "waiting until every replica" (the store reached, torchrun's agent built)
    peers ready           -> the last "joining a world of job" (every replica's launcher ready: app.cluster.elastic)
    rendezvous            -> the last "joined a world" (torch's c10d rendezvous rounds, the world formed)
    trainer spawn         -> rank 0's trainer process created (the agent starting it)
    <trainer phases>      rank 0's "start-up:" line (app/worker/startup.py): its interpreter, config, torch import,
                          workload check (the model's first build), imports, metrics endpoint, process group,
                          endpoints, torch._dynamo import (torch.optim's), model build (the second), checkpoint probe
    first step            -> rank 0's "step 1/" line

Each milestone is the last container's (the world waits for the slowest); so the phases add up to the total. The
store's own start (its container, then its torch import until "listening") is reported beside them: it lies on the
path only when the workers wait for a healthy store.

Variants (``--variant``, repeatable) are compose settings toggled by environment variable: ``before`` undoes the
start-up fixes (STORE_CONDITION=service_healthy: the workers start once the store is healthy;
TRAINER_DEFER_DYNAMO=0: the trainer imports torch._dynamo, as torch.optim does; LAUNCH_FORK=0: the launcher
starts its trainer as a new interpreter, which imports torch again, instead of forking it,
app/cluster/forked_trainer.py), ``store_healthy`` only the first, ``eager_dynamo`` only the second,
``exec_trainer`` only the third, ``now`` is compose.yaml as it is: each trick's saving is its variant's total
minus ``now``'s. (The first world's held last call, LAUNCH_FIRST_WORLD_HOLD_SECONDS, is on in all of them:
without it a loaded machine formed partial first worlds, tests/unit/test_first_world.py.) They run
interleaved (each repeat runs every variant, in an order that alternates) so that the machine's load hits them
alike; the table gives each phase's median over the repeats and the ratio of the totals.
Written after every repeat: bench/results/startup.json (provenance: ``tools/provenance.py``) for the documented run
(every flag at its default), otherwise runs/startup.json; rendered into docs/cluster.md by ``make bench-report``.
Each project is taken down (``docker compose down -v``) whatever happens.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

from app.cli import first_line
from tools.compose_project import Project, project_env
from tools.docker_cli import STAMP, docker, stamp
from tools.provenance import describe_output, load_average, write_result
from tools.renderers.startup import phase_names

# name -> (what it is, the environment that makes it)
VARIANTS = {
    "before": (
        "the measured fixes undone: workers wait for a healthy store, the trainer is a new interpreter that "
        "imports torch and torch._dynamo",
        {"STORE_CONDITION": "service_healthy", "TRAINER_DEFER_DYNAMO": "0", "LAUNCH_FORK": "0"},
    ),
    "store_healthy": (
        "only the store fix undone (STORE_CONDITION=service_healthy)",
        {"STORE_CONDITION": "service_healthy"},
    ),
    "exec_trainer": (
        "only the trainer's fork undone (LAUNCH_FORK=0): a new interpreter, which imports torch again",
        {"LAUNCH_FORK": "0"},
    ),
    "eager_dynamo": (
        "only the deferred torch._dynamo undone (TRAINER_DEFER_DYNAMO=0): the trainer imports it, as torch.optim does",
        {"TRAINER_DEFER_DYNAMO": "0"},
    ),
    "now": (
        "compose.yaml's defaults: workers start with the store, torch._dynamo deferred, the trainer forked",
        {},
    ),
}
DEFAULT_VARIANTS = ["before", "exec_trainer", "eager_dynamo", "now"]
LAUNCHER_MILESTONES = [  # (phase ending at the last container's line, the line)
    ("launcher import", "] INFO trainer settings:"),
    ("agent + store", "] INFO waiting until every replica"),
    ("peers ready", "] INFO joining a world of job"),
    ("rendezvous", "] INFO joined a world of"),
]
STARTUP = re.compile(r"\[rank 0\] INFO start-up: (.*) = ([\d.]+) s")
PHASE = re.compile(r"([^,]+?) ([\d.]+) s")
FIRST_STEP = re.compile(r"\[rank 0\] INFO step 1/")


def started_at(p: Project, service: str) -> list[float]:
    ids = p.compose("ps", "-a", "-q", service).stdout.split()
    if not ids:
        return []
    return [stamp(line) for line in docker("inspect", "-f", "{{.State.StartedAt}}", *ids).stdout.split()]


def service_lines(p: Project, service: str) -> list[tuple[str, float, str]]:
    """(container, unix time, text) of every log line of ``service``."""
    out = p.compose("logs", "--no-color", "--timestamps", service, check=False).stdout
    rows = []
    for line in out.splitlines():
        name, _, text = line.partition(" | ")
        if STAMP.match(text.strip()):
            rows.append((name.strip(), stamp(text), text))
    return rows


def phases_of_run(t_up: float, workers: list[float], store: list[float], lines, store_lines) -> dict:
    """The phases (seconds) of one run, in order, from its Docker states and log lines; raises if a line is missing."""
    phases = {"container start": max(workers) - t_up}
    last = max(workers)
    for phase, marker in LAUNCHER_MILESTONES:
        per_container: dict[str, float] = {}
        for container, t, text in lines:
            if marker in text:
                per_container.setdefault(container, t)
        if len(per_container) < len(workers):
            raise RuntimeError(f"{len(per_container)} of {len(workers)} containers logged {marker.strip()!r}")
        phases[phase], last = max(per_container.values()) - last, max(per_container.values())
    found = [(t, m) for _, t, text in lines if (m := STARTUP.search(text))]
    step = [t for _, t, text in lines if FIRST_STEP.search(text)]
    if not found or not step:
        raise RuntimeError("rank 0 logged no start-up line or no first step")
    t_line, m = found[0]
    trainer = [(name.strip(), float(s)) for name, s in PHASE.findall(m[1])]
    phases["trainer spawn"] = (t_line - float(m[2])) - last
    phases.update({f"trainer: {name}": s for name, s in trainer})
    phases["first step"] = step[0] - t_line
    listening = [t for _, t, text in store_lines if "store listening" in text]
    return {
        "phases": {k: round(v, 3) for k, v in phases.items()},
        "total_s": round(step[0] - t_up, 3),
        "store_started_s": round(min(store) - t_up, 3) if store else None,
        "store_listening_s": round(listening[0] - t_up, 3) if listening else None,
    }


def one_run(args, variant: str, index: int) -> dict:
    name = f"startup-{os.getpid()}-{index}-{variant.replace('_', '')}"
    p = Project(name, {})
    p.env = {
        **project_env(name, args),
        "DDP_CHECKPOINT_EVERY": str(10 * args.steps),  # only the final save: the start-up is what is measured
        **VARIANTS[variant][1],
    }
    t_up = time.time()
    try:
        p.compose("up", "-d", "--no-build", "--scale", f"worker={args.workers}", "worker", timeout=args.timeout)
        up_returned = time.time() - t_up
        p.wait_until(lambda: p.all_exited(args.workers), args.timeout, "every worker finishing")
        run = phases_of_run(
            t_up,
            started_at(p, "worker"),
            started_at(p, "rendezvous"),
            service_lines(p, "worker"),
            service_lines(p, "rendezvous"),
        )
        codes = [r["ExitCode"] for r in p.workers()]
        return {"variant": variant, "repeat": index, "up_returned_s": round(up_returned, 3), "exit_codes": codes, **run}
    except (RuntimeError, TimeoutError, subprocess.SubprocessError) as e:  # a run that failed is a result too
        why = first_line(e)[:300]
        return {"variant": variant, "repeat": index, "failed": why, "after_s": round(time.time() - t_up, 1)}
    finally:
        p.down()


def summary(all_runs: list[dict]) -> dict:
    """Each phase's median over the runs of one variant that finished (and of the total), the total's spread."""
    runs = [r for r in all_runs if "failed" not in r]
    if not runs:
        return {
            "phases": {},
            "total_s": None,
            "total_min_s": None,
            "total_max_s": None,
            "store_listening_s": None,
            "repeats": 0,
            "failed": len(all_runs),
        }
    names = list(runs[0]["phases"])
    totals = [r["total_s"] for r in runs]
    return {
        "phases": {n: round(statistics.median(r["phases"].get(n, 0.0) for r in runs), 3) for n in names},
        "total_s": round(statistics.median(totals), 3),
        "total_min_s": min(totals),
        "total_max_s": max(totals),
        "store_listening_s": round(statistics.median(r["store_listening_s"] or 0.0 for r in runs), 3),
        "repeats": len(runs),
        "failed": len(all_runs) - len(runs),
    }


def print_table(result: dict) -> None:
    summary = result["summary"]
    variants = list(summary)

    def row(label: str, values) -> None:
        print(f"{label:<34}" + "".join(f"{v:>16.2f}" if v is not None else f"{'-':>16}" for v in values))

    print(f"\nup -> first step, {result['workers']} workers, median of {result['repeats']} interleaved repeats (s)")
    print(f"{'phase':<34}" + "".join(f"{v:>16}" for v in variants))
    for phase in phase_names(summary):
        row(phase, [summary[v]["phases"].get(phase) for v in variants])
    row("total (up -> first step)", [summary[v]["total_s"] for v in variants])
    row("(store listening at)", [summary[v]["store_listening_s"] for v in variants])
    print("runs failed: " + ", ".join(f"{v} {summary[v]['failed']}" for v in variants))
    totals = [summary[v]["total_s"] for v in variants]
    if len(variants) == 2 and None not in totals:
        print(f"ratio {variants[1]} / {variants[0]}: {totals[1] / totals[0]:.2f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.splitlines()[0])
    p.add_argument(
        "--variant", action="append", choices=list(VARIANTS), help="repeatable; default: " + ", ".join(DEFAULT_VARIANTS)
    )
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant, interleaved")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="steps of each run (the first one is what is timed)")
    p.add_argument("--timeout", type=float, default=600, help="seconds each run may take to start, then to finish")
    p.add_argument("--no-build", action="store_true", help="use the image as built")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/startup.json for the documented run)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # The fields project_env reads that this bench does not vary.
    args.effective_batch, args.micro_batch, args.dtype, args.checkpoint_every = 128, 32, "float32", 1000
    os.environ.setdefault("IMAGE_NAME", "ddp-startup")  # not the shared ddp-cluster tag other checkouts may use
    variants = args.variant or DEFAULT_VARIANTS
    if not args.no_build:
        Project(f"startup-{os.getpid()}-build", project_env(f"startup-{os.getpid()}-build", args)).compose(
            "build", "worker", timeout=1800
        )
    before = load_average()
    runs: list[dict] = []
    for i in range(args.repeats):
        for variant in variants if i % 2 == 0 else variants[::-1]:
            run = one_run(args, variant, i)
            said = run.get("failed") or f"{run['total_s']:.1f} s up -> first step"
            print(f"repeat {i} {variant}: {said}", flush=True)
            runs.append(run)
        # Rewritten after every repeat: a run cut short keeps the repeats it completed.
        result = {
            "workers": args.workers,
            "repeats": i + 1,
            "variants": {v: VARIANTS[v][0] for v in variants},
            "runs": runs,
            "summary": {v: summary([r for r in runs if r["variant"] == v]) for v in variants},
        }
        path, _ = write_result(parser, args, "startup", result, before)
    print_table(result)
    print(describe_output(path))
    return 0 if all(set(r.get("exit_codes", [1])) == {0} for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
