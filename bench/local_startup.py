"""What each start-up trick saves a local world (app.world: the demos, ``app.check``, the benches, the tests).

    make bench-startup                                  # the compose start-up (bench/startup.py), then this
    python -m bench.local_startup                       # 2 ranks, 5 interleaved repeats of each variant
    python -m bench.local_startup --ranks 4 --repeats 3

Each run is ``spawn_world(first_step, ranks)``: fresh ranks that join a gloo group, build a small DDP model and take
one AdamW step (torch.optim's first optimizer is what imports torch._dynamo), timed from the call until every rank
has returned and ended. Variants, set in the environment the ranks are started with:

    fork            LAUNCH_FORK=1: each rank forked from a template that has imported torch (app/world/template.py)
    exec            LAUNCH_FORK=0: each rank a new interpreter, which imports torch itself
    eager_dynamo    forked, TRAINER_DEFER_DYNAMO=0: torch.optim imports the real torch._dynamo in every rank

The templates start once per process (one per rank slot, each importing torch); a warm-up world starts them before
the timed runs, as the first world of a test session does, and its time is reported apart (``template_start_s``).
Repeats are interleaved (each runs every variant, in an order that alternates) so the machine's load hits them alike;
the summary is each variant's median and the saving of each trick (its off variant's median minus ``fork``'s).
Written to bench/results/startup-local.json for the documented run (every flag at its default), else runs/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from tools.provenance import describe_output, load_average, write_result

VARIANTS = {  # name -> (what it is, the environment that makes it)
    "fork": ("ranks forked from a template that has imported torch (LAUNCH_FORK=1, the default)", {}),
    "exec": ("each rank a new interpreter that imports torch (LAUNCH_FORK=0)", {"LAUNCH_FORK": "0"}),
    "eager_dynamo": (
        "forked, but torch.optim imports torch._dynamo in every rank (TRAINER_DEFER_DYNAMO=0)",
        {"TRAINER_DEFER_DYNAMO": "0"},
    ),
}


def first_step(rank: int, world_size: int) -> str:
    """One AdamW step of a small model, gradients averaged by hand (torch's DDP would import torch._dynamo itself);
    which torch._dynamo the rank ended with: the stand-in (``DeferredDynamo``) or the real one (``module``)."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(16, 64)).square().mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
    optimizer.step()
    return type(sys.modules.get("torch._dynamo")).__name__


def one_run(variant: str, ranks: int) -> dict:
    from app.world import spawn_world

    env = VARIANTS[variant][1]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        started = time.perf_counter()
        dynamo = spawn_world(first_step, ranks, timeout=600)
        return {"variant": variant, "seconds": round(time.perf_counter() - started, 3), "dynamo": sorted(set(dynamo))}
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def summary(runs: list[dict], variants: list[str]) -> dict:
    medians = {v: round(statistics.median(r["seconds"] for r in runs if r["variant"] == v), 3) for v in variants}
    return {
        "median_s": medians,
        "min_s": {v: min(r["seconds"] for r in runs if r["variant"] == v) for v in variants},
        "max_s": {v: max(r["seconds"] for r in runs if r["variant"] == v) for v in variants},
        "saving_s": {v: round(medians[v] - medians["fork"], 3) for v in variants if v != "fork"},
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.local_startup", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks per world")
    p.add_argument("--repeats", type=int, default=5, help="runs of each variant, interleaved")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/startup-local.json, documented run)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read as the templates load torch's OpenMP runtime
    variants = list(VARIANTS)
    before = load_average()
    warm = one_run("fork", args.ranks)  # starts the templates: once per process, not per world
    print(f"warm-up (templates started): {warm['seconds']:.1f} s", flush=True)
    runs: list[dict] = []
    for i in range(args.repeats):
        for variant in variants if i % 2 == 0 else variants[::-1]:
            runs.append({**one_run(variant, args.ranks), "repeat": i})
            print(f"repeat {i} {variant}: {runs[-1]['seconds']:.2f} s ({runs[-1]['dynamo']})", flush=True)
    result = {
        "ranks": args.ranks,
        "repeats": args.repeats,
        "variants": {v: VARIANTS[v][0] for v in variants},
        "template_start_s": warm["seconds"],
        "runs": runs,
        "summary": summary(runs, variants),
    }
    path, _ = write_result(parser, args, "startup-local", result, before)
    s = result["summary"]
    print(f"\n{args.ranks} ranks, call -> one step -> ended, median of {args.repeats} interleaved repeats (s)")
    for v in variants:
        saved = f"   the trick saves {s['saving_s'][v]:+.2f} s" if v in s["saving_s"] else ""
        print(f"{v:<14}{s['median_s'][v]:>8.2f}  ({s['min_s'][v]:.2f}-{s['max_s'][v]:.2f}){saved}")
    print(describe_output(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
