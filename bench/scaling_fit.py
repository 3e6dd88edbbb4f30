"""The scaling model's arithmetic, apart from any measurement: the alpha-beta cost of each collective, its
least-squares fit, DDP's step time with and without overlap, the pipeline bubble with its send/recv term and the plot.
``bench/scaling.py`` measures and calls these; tools/renderers/scaling.py renders the docs page from the result.

The alpha-beta (latency-bandwidth) model: a collective on ``n`` ranks over ``S`` bytes takes
``a(n) * alpha + b(n) * S / beta``, with the standard algorithm terms below (ring all-reduce = reduce-scatter then
all-gather). ``b(n)`` is nccl-tests' bus-bandwidth factor (NVIDIA/nccl-tests doc/PERFORMANCE.md), so ``beta`` here is
what nccl-tests calls *busbw*, and a published busbw can be used as ``beta`` unchanged.
"""

from __future__ import annotations

import statistics

import numpy as np

# collective -> (a(n): latency terms, b(n): bandwidth factor); S = the whole buffer (all-gather: the output).
TERMS = {
    "all_reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "reduce_scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    "all_gather": (lambda n: n - 1, lambda n: (n - 1) / n),
    "send_recv": (lambda n: 1, lambda n: 1.0),
}


def predict(collective: str, n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Seconds for one ``collective`` of ``nbytes`` on ``n`` ranks: a(n)·alpha + b(n)·S/beta."""
    a, b = TERMS[collective]
    return a(n) * alpha + b(n) * nbytes / beta


def fit(collective: str, points: list[tuple[int, float, float]]) -> dict:
    """Least-squares alpha (s) and beta (bytes/s) from ``(n, bytes, seconds)`` points.

    The residuals are *relative* (each row divided by its measured time): a 4 KiB point of 0.3 ms and a 64 MiB point
    of 300 ms weigh the same, so the fit aims at the per-point error the model is judged by rather than at the
    largest messages only. A negative alpha (noise at the small sizes) is clamped to 0 and beta refitted alone.
    """
    a, b = TERMS[collective]
    t = np.array([s for _, _, s in points])
    rows = np.array([[a(n), b(n) * nbytes] for n, nbytes, _ in points]) / t[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(rows, np.ones(len(points)), rcond=None)
    if alpha < 0:
        alpha, inv_beta = 0.0, float(np.linalg.lstsq(rows[:, 1:], np.ones(len(points)), rcond=None)[0][0])
    if inv_beta <= 0:
        raise ValueError(f"{collective}: no positive bandwidth fits these points (times do not grow with size)")
    alpha, beta = float(alpha), float(1 / inv_beta)
    errors = [predict(collective, n, nbytes, alpha, beta) / s - 1 for n, nbytes, s in points]
    return {"alpha_s": alpha, "beta_bytes_per_s": beta, "errors": errors}


def ddp_comm(bucket_bytes: list[int], n: int, alpha: float, beta: float) -> tuple[float, float]:
    """(all buckets' all-reduce seconds, the last-launched bucket's): one ring all-reduce per bucket."""
    times = [predict("all_reduce", n, size, alpha, beta) for size in bucket_bytes]
    return sum(times), times[-1]


def ddp_step(
    compute: dict,
    bucket_bytes: list[int],
    n: int,
    alpha: float,
    beta: float,
    reducer_s: float = 0.0,
    sync_s: float = 0.0,
) -> dict:
    """Predicted step seconds of bucketed DDP, without and with overlap, and communication's share of each.

    ``compute``: seconds of ``forward``, ``backward``, ``optimizer`` for one rank's batch. ``reducer_s``: the
    wrapper's own local work per step (hooks, copies into and out of the buckets), measured with a comm hook that
    sends nothing. ``sync_s``: what a collective issued at the end of a backward costs more than one issued right
    after a barrier (waiting for the slowest peer, waking the communication threads), once per step. Both are CPU
    time or waiting on the critical path: overlap hides neither. Without overlap the all-reduces follow backward.
    With overlap a bucket is all-reduced while backward computes earlier layers, so backward hides up to its own
    duration, but never the last bucket: it is only full when backward ends.
    """
    comm, last = ddp_comm(bucket_bytes, n, alpha, beta)
    work = compute["forward"] + compute["backward"] + compute["optimizer"] + reducer_s + sync_s
    exposed = max(comm - compute["backward"], last)
    return {
        "comm_s": comm,
        "step_s": work + comm,
        "share": (comm + sync_s) / (work + comm),
        "step_overlap_s": work + exposed,
        "share_overlap": (exposed + sync_s) / (work + exposed),
    }


def bubble_with_comm(stages: int, micro: int, compute_s: float, sent_bytes: float, alpha: float, beta: float):
    """A stage's idle share when each micro-batch's transfer is on the critical path; returns (idle, transfer s).

    GPipe's (S−1)/(M+S−1) assumes free communication: M+S−1 slots of one micro-batch's work ``compute_s / M``.
    Here every slot also carries one send/recv of the micro-batch's activation (forward) and one of its gradient
    (backward), ``sent_bytes / M`` each: step = (M+S−1)·(compute/M + 2·transfer), idle = 1 − compute / step.
    """
    transfer = predict("send_recv", 2, sent_bytes / micro, alpha, beta)
    step = (micro + stages - 1) * (compute_s / micro + 2 * transfer)
    return 1 - compute_s / step, transfer


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line: per-step overhead and per-sample seconds, both kept >= 0 so that
    noise at the small batches cannot make a predicted compute time negative (flat: the mean; else through 0)."""
    x, y = np.array(xs, dtype=float), np.array(ys, dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    if slope < 0:
        return float(y.mean()), 0.0
    if intercept < 0:
        return 0.0, float(x @ y / (x @ x))
    return float(intercept), float(slope)


# -- from measured points to the model ------------------------------------------------------------------------------
def collective_points(per_world: dict) -> list[dict]:
    """Median over rounds of the slowest rank (send/recv: rank 0's half round trip)."""
    points = []
    for world, ranks in per_world.items():
        for (name, nbytes), _ in ranks[0]["collectives"].items():
            rounds = [r["collectives"][(name, nbytes)] for r in ranks]
            per_round = rounds[0] if name == "send_recv" else [max(t) for t in zip(*rounds)]
            median = statistics.median(per_round)
            q1, _, q3 = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else (median,) * 3
            points.append(
                {
                    **{"collective": name, "world_size": world, "bytes": nbytes, "measured_s": median},
                    "spread": (q3 - q1) / median,  # the rounds' interquartile range / median: the noise
                    "rounds": len(per_round),
                }
            )
    return points


def fit_all(points: list[dict], cores: int) -> dict:
    """alpha and beta per collective, and each point's model time and error (written into the point).

    The ring terms assume a core per rank. Worlds with more ranks than ``cores`` break that: each ring step also
    waits for a descheduled peer to get a core, a latency the ring's ``a(n)·alpha`` does not grow with. So the worlds
    with ``n <= cores`` are fitted together (``"ring"``: what the predictions use) and each larger world on its own
    (``"oversubscribed"``: n -> fits, what that world's points and DDP check use). With no world within ``cores``,
    all are fitted together.
    """
    within = {p["world_size"] for p in points if p["world_size"] <= cores} or {p["world_size"] for p in points}
    groups = {"ring": within, **{n: {n} for n in sorted({p["world_size"] for p in points} - within)}}
    fits: dict = {"ring": {}, "oversubscribed": {}}
    for group, worlds in groups.items():
        target = fits["ring"] if group == "ring" else fits["oversubscribed"].setdefault(str(group), {})
        for name in TERMS:
            mine = [p for p in points if p["collective"] == name and p["world_size"] in worlds]
            f = fit(name, [(p["world_size"], p["bytes"], p["measured_s"]) for p in mine])
            for p, err in zip(mine, f.pop("errors")):
                p["predicted_s"], p["error"], p["fit"] = p["measured_s"] * (1 + err), err, str(group)
            target[name] = f
    return fits


def fit_for(fits: dict, world: int) -> dict:
    """The fits that describe ``world``: its own if it was oversubscribed, else the ring fit."""
    return fits["oversubscribed"].get(str(world), fits["ring"])


def ddp_check(per_world: dict, fits: dict) -> tuple[list[dict], dict]:
    """The model against each measured DDP step, every term measured in the same world, interleaved with it.

    Per step the slowest rank counts (a synchronised step waits for it); per term the median over steps.
    compute: the ``no_sync()`` step's phases; reducer: the no-communication step minus the compute; sync: the
    compute followed by the one-float all-reduce, minus the compute, minus the fit's one-float all-reduce; comm: the
    fit, one all-reduce per bucket. Returns the rows and, per model, its bucket sizes.
    """
    rows, buckets = [], {}
    for world, ranks in per_world.items():
        ar = fit_for(fits, world)["all_reduce"]
        for name in ranks[0]["ddp"]:
            per_rank = [r["ddp"][name] for r in ranks]
            measured = statistics.median(max(s) for s in zip(*(r["synced"] for r in per_rank)))
            local = [max(phases, key=lambda p: sum(p[:3])) for phases in zip(*(r["local"] for r in per_rank))]
            compute = dict(zip(("forward", "backward", "optimizer"), (statistics.median(p) for p in zip(*local))))
            hooks_s = statistics.median(max(map(sum, s)) for s in zip(*(r["hooks"] for r in per_rank)))
            # The compute and the probe after it, per rank, then the slowest: the faster rank's probe includes its
            # wait for the slower one, whose compute is already counted (the max of the sums, not the sum of maxes).
            probed_s = statistics.median(max(map(sum, s)) for s in zip(*(r["local"] for r in per_rank)))
            local_s = statistics.median(sum(p[:3]) for p in local)
            reducer_s = max(0.0, hooks_s - sum(compute.values()))
            hot = predict("all_reduce", world, 4, ar["alpha_s"], ar["beta_bytes_per_s"])
            sync_s = max(0.0, probed_s - local_s - hot)
            buckets[name] = per_rank[0]["buckets"]
            pred = ddp_step(compute, buckets[name], world, ar["alpha_s"], ar["beta_bytes_per_s"], reducer_s, sync_s)
            rows.append(
                {
                    "model": name,
                    "world_size": world,
                    "per_rank_batch": ranks[0]["check_batch"] // world,
                    "compute_s": sum(compute.values()),
                    "reducer_s": reducer_s,
                    "sync_s": sync_s,
                    "comm_s": pred["comm_s"],
                    "measured_step_s": measured,
                    "predicted_step_s": pred["step_s"],
                    "predicted_step_overlap_s": pred["step_overlap_s"],
                    "error": pred["step_s"] / measured - 1,
                    "error_overlap": pred["step_overlap_s"] / measured - 1,
                }
            )
    return rows, buckets


def bubble_rows(doc: dict, fits: dict) -> dict:
    """pipeline-bubble.json's emulated rows: GPipe's formula and the formula + fitted send/recv term vs measured."""
    sr = fits["ring"]["send_recv"]
    rows = []
    # v2 results also hold PyTorch's own loop and longer emulated work: the rows of the default loop at the first
    # --stage-ms are the ones the training path runs (v1 rows have neither field: all of them).
    base_ms = doc["rows"][0].get("stage_ms")
    default = [r for r in doc["rows"] if r.get("engine", "overlapped") == "overlapped" and r.get("stage_ms") == base_ms]
    for r in (r for r in default if r["compute"] == "emulated"):
        compute = statistics.fmean(r["compute_ms_per_stage"]) / 1e3
        sent = min(r["activation_bytes_per_stage"])  # an end stage: one direction, one boundary
        idle, transfer = bubble_with_comm(
            r["stages"], r["micro_batches"], compute, sent, sr["alpha_s"], sr["beta_bytes_per_s"]
        )
        rows.append(
            {
                **{k: r[k] for k in ("schedule", "stages", "micro_batches")},
                "formula": r["theory"],
                "with_comm": idle,
                "transfer_s": transfer,
                "measured": r["measured_mean"],
                "formula_error": r["theory"] / r["measured_mean"] - 1,
                "error": idle / r["measured_mean"] - 1,
            }
        )
    return {
        "source": f"bench/results/pipeline-bubble.json (commit {doc['commit'][:10]}, {doc['date']})",
        "rows": rows,
        "mean_abs_error_formula": statistics.fmean(abs(r["formula"] - r["measured"]) for r in rows),
        "mean_abs_error_with_comm": statistics.fmean(abs(r["with_comm"] - r["measured"]) for r in rows),
        "errors": error_summary([r["error"] for r in rows]),
        "formula_errors": error_summary([r["formula_error"] for r in rows]),
    }


def error_summary(errors: list[float]) -> dict:
    """How a set of relative errors (model / measured - 1) meets the ±15% goal: count, mean and worst |error|."""
    magnitudes = [abs(float(e)) for e in errors]
    return {
        "points": len(errors),
        "within_15pct": sum(e <= 0.15 for e in magnitudes),
        "mean_abs_error": statistics.fmean(magnitudes),
        "max_abs_error": max(magnitudes),
    }


def plot(doc: dict, path) -> None:
    """The PNG: predicted step time vs ranks per model, gloo vs NCCL, with and without overlap; measured dots."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in doc["predictions"]))
    fig, axes = plt.subplots(1, len(models), figsize=(13, 4.2), sharey=False)
    for ax, name in zip(axes, models):
        rows = [r for r in doc["predictions"] if r["model"] == name]
        ranks = [r["ranks"] for r in rows]
        for net, color in (("gloo", "tab:blue"), ("nccl", "tab:green")):
            ax.plot(ranks, [r[net]["step_s"] * 1e3 for r in rows], "-", color=color, label=f"{net}, no overlap")
            ax.plot(ranks, [r[net]["step_overlap_s"] * 1e3 for r in rows], "--", color=color, label=f"{net}, overlap")
        checks = [r for r in doc["ddp_check"] if r["model"] == name]
        at = [r["world_size"] for r in checks]
        ax.plot(at, [r["measured_step_s"] * 1e3 for r in checks], "ko", label="measured (check batch)")
        ax.plot(at, [r["predicted_step_overlap_s"] * 1e3 for r in checks], "kx", label="model (check batch)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        batches = f"lines: global batch {doc['settings']['global_batch']}, points: {doc['settings']['check_batch']}"
        ax.set_title(f"{name} ({batches})", fontsize=9)
        ax.set_xlabel("ranks")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("step time, ms")
    axes[0].legend(fontsize=7)
    fig.suptitle("Predicted DDP step time: gloo (fitted here) vs NCCL (assumed); CPU compute", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
