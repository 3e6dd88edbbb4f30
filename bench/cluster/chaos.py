"""The chaos proof: a cluster that loses a worker and gets it back trains to the same parameters as one that did not.

    make chaos                       # = python -m bench.cluster.chaos (Docker; builds the image once, ~5-10 min here)
    python -m bench.cluster.chaos --steps 200 --kill-at 60 --victim rank1
    python -m bench.cluster.chaos --parallel zero2   # the same proof under ZeRO stage 2: bench/results/chaos-zero2.json
    python -m bench.cluster.chaos --workers 3 --max-workers 3 --steps 120 --kill-at 20   # tests/e2e/test_chaos.py

Two compose projects of the same image and the same settings (global batch fixed in samples, so any world size
trains the same steps on the same samples):

- run A: 4 workers, untouched, to the last step;
- run B: 4 workers; at step ``--kill-at`` the container holding ``--victim`` (rank 0 by default: the hardest case,
  the checkpoint writer and the trainers' store host) is killed (``docker kill``: no restart policy applies), the
  other 3 re-form and resume from the newest checkpoint; once the world of 3 has trained, ``docker compose up -d
  --scale worker=4 --no-recreate`` brings a fourth back and the world re-forms at 4 (at once where ``--max-workers``
  is 4: a full world needs no last call).

Verdict PASS when every container of A exits 0, B's survivors and its returning worker exit 0, B really trained on
3 and then on 4 again, and B's final parameters (the last checkpoint, loaded and digest-checked) equal A's within
``--tolerance`` (the world-size invariance tolerance of tests/integration/test_invariance.py). Both runs train in
float64 (``--dtype``): the world of 3 adds in another order than the world of 4, and in float32 that rounding
(1e-7) tips the odd ReLU over hundreds of steps, so even two failure-free runs on 4 and on 3 ranks drift apart
(docs/cluster.md); in float64 they agree to ~1e-15 and what remains is the recovery's own doing. Printed: the verdict,
the recovery times (failure -> first step of the new world; scale-up -> first step of the world of 4), the steps
redone, the cost of a checkpoint. Written: bench/results/chaos.json (with provenance) and chaos.png (the two loss
curves, B's world size underneath).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.docker_cli import compose, docker, stamp

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"\[rank 0\] INFO step (\d+)/\d+ \| loss ([-\d.naif]+)")
WORLD = re.compile(r"\[rank 0\] INFO training .* world_size (\d+)")
RESUMED = re.compile(r"\[rank 0\] INFO resumed from \S+ \(step (\d+)")
JOINED = re.compile(r"\[launch (\w+)\] INFO joined a world of (\d+) as rank (\d+)")
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
        from app.worker.checkpoint.files import load_checkpoint

        container = self.workers()[0]["ID"]
        with tempfile.TemporaryDirectory() as tmp:
            docker("cp", f"{container}:/checkpoints/.", tmp, timeout=120)  # the whole volume: ZeRO's shards too
            if (Path(tmp) / "manifest.json").exists():
                return consolidated(Path(tmp), step)
            return load_checkpoint(Path(tmp) / f"step-{step:08d}.pt")["model"]

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "-t", "10", check=False, timeout=300)


def consolidated(directory: Path, step: int) -> dict:
    """A ZeRO checkpoint's parameters, whole (name -> tensor): each shard's pieces (elements [lo, hi) of a flattened
    parameter, app.parallel.zero.checkpoint) copied into place; every shard's digest checked on the way."""
    import torch

    from app.parallel.zero.checkpoint import _read_shard, read_manifest

    manifest = read_manifest(directory)
    if manifest["extra"].get("step") != step:
        raise RuntimeError(f"{directory}: the last checkpoint is of step {manifest['extra'].get('step')}, not {step}")
    shapes = manifest["params"]
    flat = {n: torch.zeros(int(torch.Size(s).numel()), dtype=torch.float64) for n, s in shapes.items()}
    covered = {n: torch.zeros(v.numel(), dtype=torch.int64) for n, v in flat.items()}
    for shard in manifest["shards"]:
        for name, piece in _read_shard(directory, shard)["pieces"].items():
            flat[name][piece["lo"] : piece["hi"]] = piece["tensors"]["param"].double()
            covered[name][piece["lo"] : piece["hi"]] += 1
    if any((c != 1).any() for c in covered.values()):  # a gap or an overlap: the shards are not one model
        raise RuntimeError(f"{directory}: the shards do not cover every parameter element exactly once")
    return {n: v.reshape(shapes[n]) for n, v in flat.items()}


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


# -- the two runs --------------------------------------------------------------------------------------------------
def run_a(p: Project, args, out: dict) -> None:
    p.compose("up", "-d", "--no-build", "--scale", f"worker={args.workers}", "worker")
    p.wait_until(lambda: p.all_exited(args.workers), args.timeout, "run A finishing")
    out["lines"], out["workers"] = p.lines(), p.workers()


def run_b(p: Project, args, out: dict) -> None:
    p.compose("up", "-d", "--no-build", "--scale", f"worker={args.workers}", "worker")
    p.wait_until(lambda: p.last_step() >= args.kill_at, args.timeout, f"run B reaching step {args.kill_at}")
    rank = int(args.victim.removeprefix("rank"))
    victim = p.rank_container(rank)
    out["killed_step_seen"] = p.last_step()
    out["kill_time"] = time.time()
    docker("kill", victim)
    out["victim"] = victim

    def trained_on(world: int, since: float) -> bool:
        current = None
        for t, line in p.lines():
            if m := WORLD.search(line):
                current = int(m[1])
            elif t > since and current == world and STEP.search(line):
                return True
        return False

    p.wait_until(lambda: trained_on(args.workers - 1, out["kill_time"]), args.timeout, "run B training on 3")
    out["scale_time"] = time.time()
    p.compose("up", "-d", "--no-build", "--scale", f"worker={args.workers}", "--no-recreate", "worker")
    p.wait_until(lambda: p.all_exited(args.workers), args.timeout, "run B finishing")
    out["lines"], out["workers"] = p.lines(), p.workers()


# -- what the logs say ---------------------------------------------------------------------------------------------
def curve(lines: list[tuple[float, str]]) -> list[dict]:
    """Rank 0's step lines as {step, loss, world, t}; a step trained again after a resume keeps its last value."""
    world, points = None, {}
    for t, line in lines:
        if m := WORLD.search(line):
            world = int(m[1])
        elif m := STEP.search(line):
            points[int(m[1])] = {"step": int(m[1]), "loss": float(m[2]), "world": world, "t": t}
    return [points[s] for s in sorted(points)]


def first_step_after(lines, since: float, world: int) -> float | None:
    current = None
    for t, line in lines:
        if m := WORLD.search(line):
            current = int(m[1])
        elif t > since and current == world and STEP.search(line):
            return t
    return None


def analyse(a: dict, b: dict, args, params_a: dict, params_b: dict) -> dict:
    lines_b = b["lines"]
    before_kill = [int(m[1]) for t, line in lines_b if t <= b["kill_time"] and (m := STEP.search(line))]
    resumed = [int(m[1]) for t, line in lines_b if t > b["kill_time"] and (m := RESUMED.search(line))]
    first_on_3 = first_step_after(lines_b, b["kill_time"], args.workers - 1)
    first_on_4 = first_step_after(lines_b, b["scale_time"], args.workers)
    worlds = [p["world"] for p in curve(lines_b)]
    diff = max((params_a[k].double() - params_b[k].double()).abs().max().item() for k in params_a)
    # Reported, not judged: the whole vector's relative distance (in float32 it shows how far rounding took B).
    sq = sum((params_a[k].double() - params_b[k].double()).pow(2).sum().item() for k in params_a)
    norm = sum(params_a[k].double().pow(2).sum().item() for k in params_a)
    rel = (sq / norm) ** 0.5 if norm else 0.0
    codes_a = {r["Name"]: r["ExitCode"] for r in a["workers"]}
    codes_b = {r["Name"]: r["ExitCode"] for r in b["workers"]}
    victim_name = next((r["Name"] for r in b["workers"] if r["ID"].startswith(b["victim"])), None)
    ckpt_ms = [int(m[1]) for _, line in a["lines"] + lines_b if (m := CHECKPOINT_MS.search(line))]
    checks = {
        "run A: every worker exited 0": all(c == 0 for c in codes_a.values()) and len(codes_a) == args.workers,
        "run B: every worker exited 0 at the end": all(c == 0 for c in codes_b.values()),
        f"run B trained on {args.workers - 1} after the loss": first_on_3 is not None,
        f"run B trained on {args.workers} again after the scale-up": first_on_4 is not None,
        "run B reached the last step": bool(worlds) and curve(lines_b)[-1]["step"] == args.steps,
        f"B's parameters equal A's: max |Δparam| <= {args.tolerance:g} ({args.dtype})": diff <= args.tolerance,
    }
    return {
        "verdict": "PASS" if all(checks.values()) else "FAIL",
        "checks": checks,
        "max_abs_param_diff": diff,
        "relative_param_distance": rel,
        "tolerance": args.tolerance,
        "dtype": args.dtype,
        "final_loss": {"A": curve(a["lines"])[-1]["loss"], "B": curve(lines_b)[-1]["loss"]},
        "victim": {"rank": args.victim, "container": victim_name},
        "killed_at_step": max(before_kill, default=None),
        "resumed_from_step": resumed[0] if resumed else None,
        "steps_redone": (max(before_kill) - resumed[0]) if before_kill and resumed else None,
        "failure_to_next_step_s": round(first_on_3 - b["kill_time"], 1) if first_on_3 else None,
        "scale_up_to_next_step_s": round(first_on_4 - b["scale_time"], 1) if first_on_4 else None,
        "checkpoint_ms_median": statistics.median(ckpt_ms) if ckpt_ms else None,
        "checkpoints_written": len(ckpt_ms),
        "exit_codes": {"A": codes_a, "B": codes_b},
        "curves": {"A": curve(a["lines"]), "B": curve(lines_b)},
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = result["curves"]["A"], result["curves"]["B"]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5), height_ratios=[3, 1])
    top.plot([p["step"] for p in a], [p["loss"] for p in a], label="A: 4 workers, untouched", lw=2)
    top.plot([p["step"] for p in b], [p["loss"] for p in b], "--", label="B: worker lost, then back", lw=1.5)
    if result["killed_at_step"]:
        top.axvline(result["killed_at_step"], color="red", lw=0.8, label=f"B: {result['victim']['rank']} killed")
    top.set_ylabel("loss (rank 0)")
    top.set_title(
        f"chaos: {result['verdict']}, max |Δparam| = {result['max_abs_param_diff']:.2e}, "
        f"relative {result['relative_param_distance']:.1e}"
    )
    top.legend()
    bottom.step([p["step"] for p in b], [p["world"] for p in b], where="post", color="C1")
    bottom.set_ylabel("B world size")
    bottom.set_xlabel("step")
    bottom.set_ylim(0, max(p["world"] or 0 for p in b) + 1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4, help="world size of both runs (B drops to one fewer)")
    # At --workers, B's world of 4 is full once the fourth is back: it forms at once, not a last call (15 s) later.
    p.add_argument("--max-workers", type=int, default=None, help="MAX_WORKERS of both runs (default compose's 8)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of each run")
    p.add_argument("--kill-at", type=int, default=40, help="B loses its victim once rank 0 has logged this step")
    p.add_argument("--victim", default="rank0", choices=["rank0", "rank1", "rank2", "rank3"])
    # Large enough that the world of 3 is still training when the fourth container has started and joined.
    p.add_argument("--effective-batch", type=int, default=4096, help="global batch in samples (fixed across worlds)")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints (lost work bound)")
    p.add_argument(
        "--tolerance", type=float, default=1e-5, help="max |Δparam| allowed (tests/integration/test_invariance.py)"
    )
    # float64: the world of 3 sums in another order than the world of 4; in float32 that 1e-7 of rounding tips the
    # odd ReLU over hundreds of steps and B drifts from A (docs/cluster.md measures it); in float64 it stays ~1e-15,
    # so any difference left is the recovery's own.
    p.add_argument(
        "--min-step-seconds",
        type=float,
        default=0.0,
        help="DDP_MIN_STEP_SECONDS: pace each step, so that a short run on a fast machine still outlasts the "
        "returning container's start",
    )
    p.add_argument("--dtype", default="float64", choices=["float32", "float64"], help="precision of both runs")
    p.add_argument("--parallel", default="ddp", choices=["ddp", "zero1", "zero2", "zero3"], help="DDP_PARALLEL")
    p.add_argument("--timeout", type=float, default=900, help="seconds each phase may take")
    p.add_argument("--no-build", action="store_true", help="use the image as built (make image)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/chaos.json for the documented run)")
    return p


def chaos(args) -> dict:
    """Run A, then B (two projects), compare, and return the result (also what ``main`` writes)."""
    tag = f"chaos-{os.getpid()}"
    a, b = Project(f"{tag}-a", {}), Project(f"{tag}-b", {})
    a.env, b.env = project_env(a.name, args), project_env(b.name, args)
    if not args.no_build:
        a.compose("build", "worker", timeout=1800)
    out_a, out_b, errors = {}, {}, []

    def guarded(fn, project, out):
        try:
            fn(project, args, out)
        except Exception as e:  # noqa: BLE001 - reported in the verdict, after both projects are down
            errors.append(f"{project.name}: {e}")

    try:
        # One after the other: two clusters at once on a small machine starve each other's heartbeats.
        guarded(run_a, a, out_a)
        if not errors:
            guarded(run_b, b, out_b)
        if errors:
            tail = "\n".join(line for _, line in (b.lines() + a.lines())[-60:])
            raise RuntimeError("; ".join(errors) + "\n" + tail)
        result = analyse(out_a, out_b, args, a.final_parameters(args.steps), b.final_parameters(args.steps))
    finally:
        a.down()
        b.down()
    return result


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from bench.provenance import describe_output, load_average, output_path, provenance

    parser = build_parser()
    args = parser.parse_args(argv)
    before = load_average()
    started = time.monotonic()
    result = chaos(args)
    result["wall_s"] = round(time.monotonic() - started, 1)
    # The documented runs: bench/results/chaos.json (ddp) and chaos-<stage>.json, each with every other default.
    name = "chaos" if args.parallel == "ddp" else f"chaos-{args.parallel}"
    path = output_path(parser, argparse.Namespace(**{**vars(args), "parallel": "ddp"}), name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": "chaos/1", **provenance(args, load_before=before), **result}, indent=1))
    plot(result, path.with_suffix(".png"))
    for name, ok in result["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    print(
        f"killed {result['victim']['rank']} ({result['victim']['container']}) at step {result['killed_at_step']}; "
        f"resumed from step {result['resumed_from_step']} ({result['steps_redone']} steps redone); "
        f"failure -> next step {result['failure_to_next_step_s']} s; "
        f"scale-up -> next step {result['scale_up_to_next_step_s']} s; "
        f"checkpoint {result['checkpoint_ms_median']} ms (median of {result['checkpoints_written']}); "
        f"max |Δparam| {result['max_abs_param_diff']:.3g} (tolerance {result['tolerance']:g}), "
        f"|θA-θB|/|θA| {result['relative_param_distance']:.3g} ({result['dtype']}); "
        f"final loss A {result['final_loss']['A']} B {result['final_loss']['B']}"
    )
    print(describe_output(path))
    print(f"chaos: {result['verdict']}")
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
