"""A scaling model fitted from measured collectives: what step time to expect past this machine's 2-4 ranks.

    make scaling                                  # measure, fit, predict, check: ~10 min at load ~50, 2 cores
    .venv/bin/python -m bench.scaling --worlds 2 --sizes 4K..1M --containers no   # a quick trial (runs/)
    .venv/bin/python -m bench.scaling --render-docs         # rewrite docs/scaling.md's block from the JSON

1. Measure: all-reduce, reduce-scatter, all-gather and send/recv (gloo, CPU) over 4 KiB-64 MiB on fresh local
   worlds of 2, 3 and 4 processes (``app.world.spawn_world``). Repeats are interleaved (every size and
   collective once per round, shuffled; more rounds below 4 MiB), a barrier precedes each timed call, a point is
   the slowest rank's time (send/recv: half a ping-pong between ranks 0 and 1), median over the rounds. In the same
   worlds: DDP steps of the project's models (``app.parallel.wrap_model``, ours, default buckets), interleaved, in
   three variants that measure the model's terms apart: under ``no_sync()`` (the compute; then a one-float
   all-reduce, what a collective costs right after compute), with a comm hook that sends nothing (the reducer's
   hooks and copies), and synchronised (what the model is checked against).
2. Fit alpha and beta per collective by least squares (``bench/scaling_fit.py``) and report every point's error;
   worlds with more ranks than cores are fitted on their own (their ring steps also wait for a core).
3. Predict DDP step time and communication share at 8-1024 ranks for a fixed global batch, with this machine's
   per-sample compute (one process, per-rank batches 8/32/128, a line per phase) and two networks: gloo as fitted
   here, NCCL with an assumed alpha and bus bandwidth. The pipeline bubble gets the fitted send/recv term and is
   compared with ``bench/results/pipeline-bubble.json``'s emulated rows.
4. Check the model on every point measured here; write ``bench/results/scaling.json`` (+ provenance) and ``.png``.

With Docker up and the image built (``make image``), the collectives are measured again between containers: one
``docker run`` of ``ddp-cluster:latest`` per rank on a user-defined bridge network, bench/ and tools/ mounted read-only,
fitted on their own (``--containers no`` skips them). Exit status 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import scaling_fit as model
from bench.pipeline_bubble import OneLineParser  # one-line errors, exit 2: the house rule for bad input
from tools.docker_cli import docker
from tools.provenance import REPO, RESULTS, describe_output, load_average, output_path, provenance

SCHEMA = "scaling.v2"
MODELS = ("mini_mlp", "deep_mlp", "tiny_transformer")
RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)
COMPUTE_BATCHES = (8, 32, 128)
# A MiniMLP step takes about a millisecond, so one descheduling moves it by 100%: ten times the rounds (a second).
ROUNDS = {"mini_mlp": 10}
SMALL = 4 << 20  # bytes: below this a collective point gets --small-repeats rounds
IMAGE = "ddp-cluster:latest"
RESULT_TAG = "SCALING_RESULT "  # a container rank's one line of results on stdout
DOC = REPO / "docs" / "scaling.md"
BUBBLE = REPO / "bench" / "results" / "pipeline-bubble.json"
# NCCL's figures are assumptions, not measurements (no GPU here): one 200 Gb/s InfiniBand HDR NIC per GPU, as in a
# DGX A100 (8 GPUs, 8 HDR NICs). HDR's 25 GB/s line rate at the ~80% that nccl-tests' busbw typically reaches
# across nodes; busbw is beta here by construction (doc/PERFORMANCE.md). alpha: a few µs per ring step over IB.
NCCL = {
    "alpha_s": 10e-6,
    "beta_bytes_per_s": 20e9,
    "source": "assumed: 1x InfiniBand HDR (200 Gb/s = 25 GB/s line rate) per GPU at 80% as busbw, 10 µs per "
    "ring step; busbw as defined by NVIDIA/nccl-tests doc/PERFORMANCE.md; ring terms overstate NCCL's latency at "
    "large n, where it uses trees",
}


def workload(name: str, batch: int):
    """The model (seed 0), one batch of ``batch`` samples and its loss: rows for the MLPs, 32-token sequences for
    the transformer."""
    from app.worker.models import MODELS as BUILD

    torch.manual_seed(0)
    net = BUILD[name]()
    if name == "tiny_transformer":
        tokens = torch.randint(64, (batch, 33))
        x, y = tokens[:, :-1], tokens[:, 1:]
        return (
            net,
            x,
            y,
            lambda out, t: torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1)),
        )
    width = 32 if name == "mini_mlp" else 512
    x = torch.randn(batch, width)
    y = torch.randint(8, (batch,)) if name == "mini_mlp" else torch.randn(batch, width)
    loss = F.cross_entropy if name == "mini_mlp" else F.mse_loss
    return net, x, y, loss


def timed_step(net, opt, x, y, loss_fn) -> tuple[float, float, float]:
    """(forward + loss, backward, optimizer) seconds of one training step."""
    t0 = time.perf_counter()
    loss = loss_fn(net(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def time_collectives(rank: int, world: int, cfg: dict) -> dict:
    """This rank's seconds per (collective, bytes), one per round, rounds interleaved over sizes and collectives."""
    import torch.distributed as dist

    ops = {}
    for nbytes in cfg["sizes"]:
        n = nbytes // 4  # float32 elements; a multiple of world (4 KiB = 1024 elements) for the reduce-scatter
        n -= n % world
        full, part = torch.ones(n), torch.ones(n // world)
        ops[("all_reduce", nbytes)] = lambda f=full: dist.all_reduce(f)
        ops[("reduce_scatter", nbytes)] = lambda f=full, p=part: dist.reduce_scatter_single(p, f)
        ops[("all_gather", nbytes)] = lambda f=full, p=part: dist.all_gather_single(f, p)
        ops[("send_recv", nbytes)] = lambda f=full: ping_pong(rank, f)
    times: dict = {key: [] for key in ops}
    # Small messages are cheap and, on a loaded machine, the noisiest: they get more rounds (still interleaved).
    rounds = {key: cfg["small_repeats"] if key[1] < SMALL else cfg["repeats"] for key in ops}
    for round_ in range(max(rounds.values()) + 1):  # round 0 warms up: connections, allocations
        # A new order each round, the same on every rank (seeded by the round): no point always follows the same one
        # (a 4 KiB all-reduce right after a 64 MiB transfer measured slower, every round, in a fixed order).
        order = list(ops)
        random.Random(round_).shuffle(order)
        for key in (k for k in order if round_ <= rounds[k]):
            op = ops[key]
            dist.barrier()
            start = time.perf_counter()
            op()
            seconds = time.perf_counter() - start
            if round_:
                times[key].append(seconds / 2 if key[0] == "send_recv" else seconds)
    return times


def ping_pong(rank: int, tensor: torch.Tensor) -> None:
    """Rank 0 sends, rank 1 sends back; the others idle. Half the round trip is one send/recv."""
    import torch.distributed as dist

    if rank == 0:
        dist.send(tensor, 1)
        dist.recv(tensor, 1)
    elif rank == 1:
        dist.recv(tensor, 0)
        dist.send(tensor, 0)


def no_comm_hook(state, bucket) -> torch.futures.Future:
    """A comm hook that communicates nothing: the bucket comes back as it went. With it our wrapper still runs every
    per-parameter hook, the copy into each bucket and the copy out into ``p.grad``: the reducer's local cost alone."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


DDP_VARIANTS = ("local", "hooks", "synced")  # no_sync(); the reducer without communication; a real DDP step


def time_ddp(rank: int, world: int, cfg: dict) -> dict:
    """Per model: this rank's seconds per step of each of ``DDP_VARIANTS``, interleaved; the bucket sizes.

    Each variant has its own copy of the model (seed 0) and optimizer. Steps run in rounds, one step of every
    variant per round in a new order (the same on every rank), a barrier before each: the three see the same load,
    and one step's rank skew is not billed to the next. ``hooks`` keeps (forward, backward, optimizer), ``local``
    the same and a fourth: the seconds of a one-float all-reduce issued right after its step.
    """
    import torch.distributed as dist

    from app.parallel import wrap_model

    out = {}
    for name in cfg["models"]:
        steps = {}
        for variant in DDP_VARIANTS:
            net, x, y, loss_fn = workload(name, cfg["check_batch"] // world)
            ddp = wrap_model(net, "ours")
            if variant == "hooks":
                ddp.register_comm_hook(None, no_comm_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
            steps[variant] = (ddp, opt, x, y, loss_fn)
        times: dict = {variant: [] for variant in DDP_VARIANTS}
        probe = torch.zeros(1)
        for round_ in range(2 + cfg["steps"] * ROUNDS.get(name, 1)):  # rounds 0 and 1 warm up
            order = list(DDP_VARIANTS)
            random.Random(round_).shuffle(order)
            for variant in order:
                ddp, opt, x, y, loss_fn = steps[variant]
                dist.barrier()
                if variant == "local":
                    with ddp.no_sync():
                        phases = timed_step(ddp, opt, x, y, loss_fn)
                    # A one-float all-reduce right after the compute: what a collective issued at the end of
                    # a backward costs (waiting for the slowest peer, waking gloo's threads), not one issued
                    # right after a barrier, as the collectives above are.
                    start = time.perf_counter()
                    dist.all_reduce(probe)
                    phases = (*phases, time.perf_counter() - start)
                else:
                    phases = timed_step(ddp, opt, x, y, loss_fn)
                if round_ >= 2:
                    times[variant].append(sum(phases) if variant == "synced" else phases)
        out[name] = {**times, "buckets": list(steps["synced"][0].bucket_sizes)}
    return out


def on_rank(rank: int, world: int, cfg: dict) -> dict:
    return {"collectives": time_collectives(rank, world, cfg), "ddp": time_ddp(rank, world, cfg)}


def compute_sweep(rank: int, world: int, cfg: dict) -> dict:
    """One process, no wrapper: median (forward, backward, optimizer) seconds per model and per-rank batch."""
    out = {}
    for name in cfg["models"]:
        out[name] = {}
        for batch in COMPUTE_BATCHES:
            net, x, y, loss_fn = workload(name, batch)
            opt = torch.optim.SGD(net.parameters(), lr=1e-3)
            steps = [timed_step(net, opt, x, y, loss_fn) for _ in range(2 + cfg["steps"])][2:]
            out[name][batch] = [statistics.median(phase) for phase in zip(*steps)]
    return out


def predictions(sweep: dict, buckets: dict, fits: dict, fixed: dict, global_batch: int) -> tuple[list[dict], dict]:
    """Step time and comm share per model and rank count: per-sample compute lines, gloo's fit, NCCL's assumption.
    ``fixed``: per model, the reducer's and the sync term's seconds (the check's, at its smallest world)."""
    lines, rows = {}, []
    ar = fits["ring"]["all_reduce"]
    for name, by_batch in sweep.items():
        batches = sorted(by_batch)
        fwd = model.linear_fit(batches, [by_batch[b][0] for b in batches])
        bwd = model.linear_fit(batches, [by_batch[b][1] for b in batches])
        opt = statistics.median(by_batch[b][2] for b in batches)
        lines[name] = {"forward_s": fwd, "backward_s": bwd, "optimizer_s": opt, "gradient_bytes": sum(buckets[name])}
        lines[name].update(fixed[name])
        for ranks in RANKS:
            b = global_batch / ranks
            compute = {"forward": fwd[0] + fwd[1] * b, "backward": bwd[0] + bwd[1] * b, "optimizer": opt}
            gloo = model.ddp_step(compute, buckets[name], ranks, ar["alpha_s"], ar["beta_bytes_per_s"], **fixed[name])
            nccl = model.ddp_step(compute, buckets[name], ranks, NCCL["alpha_s"], NCCL["beta_bytes_per_s"])
            rows.append({"model": name, "ranks": ranks, "per_rank_batch": b, "gloo": gloo, "nccl": nccl})
    return rows, lines


def measure(args) -> dict:
    from app.world import spawn_world

    cfg = {
        "sizes": args.sizes,
        "repeats": args.repeats,
        "small_repeats": args.small_repeats,
        "steps": args.steps,
        "models": list(MODELS),
        "check_batch": args.check_batch,
    }
    per_world = {}
    for world in args.worlds:
        print(f"world {world}: collectives and DDP steps ...", flush=True)
        # A world of 4 on 2 loaded cores ran past spawn_world's default 300 s: a slow machine is not a hang here.
        ranks = spawn_world(on_rank, world, cfg, timeout=1800)
        per_world[world] = [{**r, "check_batch": args.check_batch} for r in ranks]
    print("one process: compute per batch ...", flush=True)
    sweep = spawn_world(compute_sweep, 1, cfg, timeout=1800)[0]
    containers = measure_containers(args) if args.containers != "no" else {"skipped": "--containers no"}
    points = model.collective_points(per_world)
    fits = model.fit_all(points, usable_cores())
    check, buckets = model.ddp_check(per_world, fits)
    smallest = min(r["world_size"] for r in check)
    fixed = {r["model"]: {k: r[k] for k in ("reducer_s", "sync_s")} for r in check if r["world_size"] == smallest}
    preds, lines = predictions(sweep, buckets, fits, fixed, args.global_batch)
    return {
        "fit_method": "least squares on relative residuals; error = model / measured - 1",
        "point": "median over interleaved rounds of the slowest rank (send/recv: half a ping-pong, rank 0)",
        "cores": usable_cores(),
        "collectives": points,
        "fit": fits,
        "summary": {
            "collectives": model.error_summary([p["error"] for p in points]),
            "ddp_check": model.error_summary([r["error"] for r in check]),
            "ddp_check_overlap": model.error_summary([r["error_overlap"] for r in check]),
        },
        "ddp_check": check,
        "compute_lines": lines,
        "compute_note": "per-rank batch b: forward and backward = intercept + slope*b fitted at b = 8, 32, 128 in one "
        "process; optimizer = median; reducer and sync: the check's at its smallest world (per step, whatever b); "
        "the check uses the same world's no_sync() steps instead",
        "nccl_assumption": NCCL,
        "predictions": preds,
        "bubble": model.bubble_rows(json.loads(BUBBLE.read_text()), fits),
        "containers": containers,
    }


def usable_cores() -> int:
    """The cores this process may run on (what the ranks share), as tools.provenance records them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def in_container(args) -> int:
    """One rank of the container world (``--in-container``): env:// rendezvous, the collectives, a JSON line."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {"sizes": args.sizes, "repeats": args.repeats, "small_repeats": args.small_repeats}
    times = time_collectives(rank, world, cfg)
    dist.destroy_process_group()
    print(RESULT_TAG + json.dumps({"rank": rank, "times": [[*key, t] for key, t in times.items()]}), flush=True)
    return 0


def containers_ready() -> str | None:
    """None if Docker is up and has the project's image, else why the containers are skipped."""
    try:
        docker("image", "inspect", IMAGE, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return f"no Docker engine or no image {IMAGE} (make image)"
    return None


def measure_containers(args) -> dict:
    """The collectives between containers: N ``docker run`` on one user-defined bridge network, one rank each."""
    why = containers_ready()
    if why:
        print(f"containers skipped: {why}", flush=True)
        return {"skipped": why}
    tag = f"ddp-scaling-{os.getpid()}"  # unique names: other runs' containers and networks are left alone
    per_world = {}
    try:
        docker("network", "create", tag)
        for world in args.container_worlds:
            print(f"containers, world {world}: collectives ...", flush=True)
            names = [f"{tag}-{world}-{r}" for r in range(world)]
            rounds = ["--repeats", str(args.repeats), "--small-repeats", str(args.small_repeats)]
            entry = ["-m", "bench.scaling", "--in-container", "--sizes", ",".join(f"{s >> 10}K" for s in args.sizes)]
            for rank, name in enumerate(names):
                env = [f"RANK={rank}", f"WORLD_SIZE={world}", f"MASTER_ADDR={names[0]}", "MASTER_PORT=29500"]
                env += ["OMP_NUM_THREADS=1", "PYTHONDONTWRITEBYTECODE=1"]  # the mount is read-only
                # This bench and the tools/ it imports (provenance), over the image's app/.
                mounts = [f"--volume={REPO / d}:/app/{d}:ro" for d in ("bench", "tools")]
                flags = ["-d", "--name", name, "--network", tag, *mounts, *(f"--env={e}" for e in env)]
                docker("run", *flags, "--entrypoint", "python", IMAGE, *entry, *rounds)
            ranks = []
            for name in names:
                code = docker("wait", name, timeout=600).stdout.strip()
                logs = docker("logs", name, check=False)
                line = [s for s in logs.stdout.splitlines() if s.startswith(RESULT_TAG)]
                if code != "0" or not line:
                    tail = " | ".join((logs.stdout + logs.stderr).splitlines()[-2:])
                    return {"skipped": f"failed: container {name} exited {code}: {tail}"}
                ranks.append(
                    {"collectives": {(c, b): t for c, b, t in json.loads(line[0][len(RESULT_TAG) :])["times"]}}
                )
            per_world[world] = ranks
            docker("rm", "-f", *names)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"skipped": f"failed: {exc}"}
    finally:  # whatever happened: no container or network of this run is left behind
        leftover = docker("ps", "-aq", "--filter", f"name={tag}").stdout.split()
        if leftover:
            docker("rm", "-f", *leftover)
        docker("network", "rm", tag, check=False)
    points = model.collective_points(per_world)
    fits = model.fit_all(points, usable_cores())
    summary = {"collectives": model.error_summary([p["error"] for p in points])}
    return {"image": IMAGE, "network": "user-defined bridge", "collectives": points, "fit": fits, "summary": summary}


def sizes(text: str) -> list[int]:
    """'4K..64M' (powers of 4) or a comma list like '4K,1M'."""
    units = {"K": 1 << 10, "M": 1 << 20}

    def one(part: str) -> int:
        if part[-1:].upper() not in units or not part[:-1].isdigit() or int(part[:-1]) < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: give sizes like 4K or 64M (KiB, MiB)")
        return int(part[:-1]) * units[part[-1].upper()]

    if ".." in text:
        low, high = (one(p) for p in text.split("..", 1))
        return [s for s in (low * 4**k for k in range(20)) if s <= high]
    return [one(p) for p in text.split(",")]


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated world sizes >= 2, e.g. 2,3,4")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="bench.scaling", description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=positive_ints, default=[2, 3, 4], help="world sizes measured (default 2,3,4)")
    ap.add_argument("--sizes", type=sizes, default=sizes("4K..64M"), help="message sizes (default 4K..64M)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds per collective point (default 5)")
    ap.add_argument("--small-repeats", type=int, default=25, help="rounds for sizes below 4 MiB (default 25)")
    ap.add_argument("--containers", choices=("auto", "yes", "no"), default="auto", help="also between Docker "
                    f"containers: auto = when Docker has {IMAGE} (default auto)")  # fmt: skip
    ap.add_argument("--container-worlds", type=positive_ints, default=[2, 4], help="their world sizes (default 2,4)")
    ap.add_argument("--in-container", action="store_true", help=argparse.SUPPRESS)  # one rank inside a container
    ap.add_argument("--steps", type=int, default=6, help="timed DDP steps per model and world (default 6)")
    ap.add_argument("--check-batch", type=int, default=96, help="global batch of the measured DDP steps (default 96)")
    ap.add_argument("--global-batch", type=int, default=2048, help="global batch of the predictions (default 2048)")
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default: bench/results/scaling.json)")
    ap.add_argument("--render-docs", action="store_true", help="only rewrite docs/scaling.md from the JSON")
    return ap


def render(doc: dict) -> str:
    """The generated block of docs/scaling.md, provenance line first, as ``make bench-report`` writes it."""
    from tools import report  # here, not at the top: the report pulls in every renderer, which a rank never needs

    return report.render("scaling", doc)


def rendered_page(page: str, doc: dict) -> str:
    """``page`` with its ``scaling`` block replaced by ``render(doc)`` (``doc`` need not be the committed result)."""
    from tools import report

    pattern = report.block_pattern("scaling")
    if not pattern.search(page):
        raise ValueError("docs/scaling.md has no <!-- bench-report:scaling --> ... <!-- /bench-report:scaling -->")
    body = render(doc)
    return pattern.sub(lambda m: m[1] + body + "\n" + m[2], page)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for field in ("repeats", "small_repeats", "steps", "check_batch", "global_batch"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')}={getattr(args, field)}: give a positive integer")
    if args.check_batch < max(args.worlds):
        parser.error(f"--check-batch={args.check_batch}: give at least one sample per rank of the largest world")
    if args.in_container:
        return in_container(args)
    if args.containers == "yes" and containers_ready():
        parser.error(f"--containers yes: {containers_ready()}")
    if args.render_docs:  # from the committed result (or --out): the page shows what bench/results/ holds
        path = args.out or RESULTS / "scaling.json"
        if not path.exists():
            parser.error(f"--render-docs: {path} does not exist: run `make scaling` first")
        DOC.write_text(rendered_page(DOC.read_text(), json.loads(path.read_text())), encoding="utf-8")
        print(f"wrote {DOC.relative_to(REPO)} from {path}")
        return 0
    path = output_path(parser, args, "scaling")
    before = load_average()
    try:
        result = measure(args)
    except ValueError as exc:  # a fit with nothing to fit (e.g. two tiny sizes): say which, write nothing
        print(f"bench.scaling: {exc}; measure more sizes (--sizes 4K..64M)", file=sys.stderr)
        return 1
    doc = {"schema": SCHEMA, **provenance(args, load_before=before), **result}
    print("\n".join(render(doc).splitlines()[2:]))  # the docs' block, less its provenance line
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    model.plot(doc, path.with_suffix(".png"))
    print(describe_output(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
