"""The scaling model (bench/scaling_fit.py): its fit recovers a known alpha and beta, its step and bubble terms reduce
to the textbook cases, and docs/scaling.md is the rendering of the committed bench/results/scaling.json.

    .venv/bin/python -m pytest tests/unit/test_scaling.py   # after `make scaling`: bench.scaling --render-docs
"""

from __future__ import annotations

import json
import math

import pytest

from bench import scaling, scaling_fit
from tools.provenance import RESULTS

RESULT = RESULTS / "scaling.json"


@pytest.mark.parametrize("collective", sorted(scaling_fit.TERMS))
def test_the_fit_recovers_a_synthetic_alpha_and_beta(collective):
    alpha, beta = 37e-6, 1.7e9  # 37 µs, 1.7 GB/s: nothing the fit could guess
    points = [
        (n, size, scaling_fit.predict(collective, n, size, alpha, beta))
        for n in (2, 3, 4)
        for size in (4096, 65536, 1 << 20, 16 << 20)
    ]
    fitted = scaling_fit.fit(collective, points)
    assert math.isclose(fitted["alpha_s"], alpha, rel_tol=1e-9)
    assert math.isclose(fitted["beta_bytes_per_s"], beta, rel_tol=1e-9)
    assert max(abs(e) for e in fitted["errors"]) < 1e-9


def test_the_terms_are_the_textbook_ring_and_point_to_point_costs():
    alpha, beta, size = 1e-5, 1e9, 1 << 20
    assert math.isclose(scaling_fit.predict("all_reduce", 4, size, alpha, beta), 6 * alpha + 1.5 * size / beta)
    assert math.isclose(scaling_fit.predict("reduce_scatter", 4, size, alpha, beta), 3 * alpha + 0.75 * size / beta)
    assert math.isclose(scaling_fit.predict("all_gather", 8, size, alpha, beta), 7 * alpha + 0.875 * size / beta)
    assert math.isclose(scaling_fit.predict("send_recv", 64, size, alpha, beta), alpha + size / beta)


def test_the_fit_uses_each_collectives_own_terms():
    """All-reduce moves twice what all-gather moves: its points, read as all-gather, give half the bandwidth."""
    points = [(n, s, scaling_fit.predict("all_reduce", n, s, 0.0, 1e9)) for n in (2, 4) for s in (1 << 16, 1 << 22)]
    assert math.isclose(scaling_fit.fit("all_gather", points)["beta_bytes_per_s"], 0.5e9, rel_tol=1e-6)


def test_overlap_hides_up_to_the_backward_but_never_the_last_bucket():
    compute = {"forward": 0.01, "backward": 0.02, "optimizer": 0.001}
    buckets = [1 << 20, 25 << 20]
    alpha, beta = 1e-4, 1e9
    total, last = scaling_fit.ddp_comm(buckets, 8, alpha, beta)
    step = scaling_fit.ddp_step(compute, buckets, 8, alpha, beta)
    assert math.isclose(step["step_s"], 0.031 + total)
    assert math.isclose(step["step_overlap_s"], 0.031 + max(total - 0.02, last))
    assert step["step_overlap_s"] < step["step_s"]


def test_the_reducer_and_sync_terms_are_paid_with_or_without_overlap():
    compute = {"forward": 0.01, "backward": 0.02, "optimizer": 0.001}
    buckets, alpha, beta = [1 << 20, 25 << 20], 1e-4, 1e9
    bare = scaling_fit.ddp_step(compute, buckets, 8, alpha, beta)
    step = scaling_fit.ddp_step(compute, buckets, 8, alpha, beta, reducer_s=0.004, sync_s=0.003)
    assert math.isclose(step["step_s"], bare["step_s"] + 0.007)
    assert math.isclose(step["step_overlap_s"], bare["step_overlap_s"] + 0.007)
    # The sync wait is communication (waiting on peers); the reducer's copies are not.
    assert math.isclose(step["share"], (bare["comm_s"] + 0.003) / step["step_s"])


def points_of(alpha_by_world: dict, beta: float) -> list[dict]:
    return [
        {"collective": c, "world_size": n, "bytes": s, "measured_s": scaling_fit.predict(c, n, s, a, beta)}
        for c in scaling_fit.TERMS
        for n, a in alpha_by_world.items()
        for s in (4096, 1 << 20, 16 << 20)
    ]


def test_worlds_with_more_ranks_than_cores_are_fitted_on_their_own():
    # World 4 on 2 cores: a latency per ring step ten times world 2's, which one ring fit cannot describe.
    points = points_of({2: 50e-6, 3: 50e-6, 4: 500e-6}, beta=1e9)
    fits = scaling_fit.fit_all(points, cores=3)
    assert math.isclose(fits["ring"]["all_reduce"]["alpha_s"], 50e-6, rel_tol=1e-6)
    assert math.isclose(fits["oversubscribed"]["4"]["send_recv"]["alpha_s"], 500e-6, rel_tol=1e-6)
    assert set(fits["oversubscribed"]) == {"4"}
    assert max(abs(p["error"]) for p in points) < 1e-6
    assert {p["fit"] for p in points if p["world_size"] == 4} == {"4"}
    assert scaling_fit.fit_for(fits, 4) is fits["oversubscribed"]["4"]
    assert scaling_fit.fit_for(fits, 3) is fits["ring"]
    together = points_of({2: 50e-6, 3: 50e-6, 4: 500e-6}, beta=1e9)
    scaling_fit.fit_all(together, cores=4)  # every world within the cores: one fit, which misses
    assert max(abs(p["error"]) for p in together) > 0.15


def test_the_check_adds_each_measured_term_once():
    """Per step the slowest rank counts, per term the median; the model is the hooks step + sync + all-reduces."""
    alpha, beta, buckets = 1e-4, 1e9, [1 << 20, 4 << 20]
    fits = {"ring": {"all_reduce": {"alpha_s": alpha, "beta_bytes_per_s": beta}}, "oversubscribed": {}}
    probe = 0.005  # the one-float all-reduce after the compute: 2 alpha of it is the all-reduce itself
    rank = {
        "local": [(0.01, 0.02, 0.001, probe + 0.002)] * 3,  # 31 ms of compute, then 2 ms waiting for rank 1
        "hooks": [(0.01, 0.025, 0.001)] * 3,  # 5 ms of hooks and copies on top of the compute
        "synced": [0.05] * 3,
        "buckets": buckets,
    }
    slower = {**rank, "local": [(0.01, 0.02, 0.003, probe)] * 3}  # rank 1: 33 ms, and the probe alone
    rows, got = scaling_fit.ddp_check({2: [{"ddp": {"m": rank}, "check_batch": 8}, {"ddp": {"m": slower}}]}, fits)
    (row,) = rows
    assert got == {"m": buckets}
    assert math.isclose(row["compute_s"], 0.033)  # the slowest rank's
    assert math.isclose(row["reducer_s"], 0.036 - 0.033)
    # Rank 0's wait for rank 1 is rank 1's longer compute, counted already: the sync term is the probe alone, less
    # the hot all-reduce the fit gives for one float.
    assert math.isclose(row["sync_s"], probe - scaling_fit.predict("all_reduce", 2, 4, alpha, beta))
    comm = sum(scaling_fit.predict("all_reduce", 2, b, alpha, beta) for b in buckets)
    assert math.isclose(row["predicted_step_s"], 0.036 + row["sync_s"] + comm)
    assert math.isclose(row["error"], row["predicted_step_s"] / 0.05 - 1)


def test_the_error_summary_counts_the_goal_and_the_worst():
    s = scaling_fit.error_summary([0.1, -0.15, 0.2, -0.4])
    assert s == {"points": 4, "within_15pct": 2, "mean_abs_error": pytest.approx(0.2125), "max_abs_error": 0.4}


def test_free_communication_gives_gpipes_bubble():
    for stages, micro in ((2, 1), (2, 8), (4, 4)):
        idle, _ = scaling_fit.bubble_with_comm(stages, micro, 0.12, 65536, alpha=0.0, beta=math.inf)
        assert math.isclose(idle, (stages - 1) / (micro + stages - 1))
    with_cost, _ = scaling_fit.bubble_with_comm(2, 8, 0.12, 65536, alpha=1e-3, beta=1e9)
    assert with_cost > 1 / 9


def test_the_compute_line_is_exact_on_a_line_and_never_negative():
    batches = [8, 32, 128]
    assert scaling_fit.linear_fit(batches, [0.002 + 1e-4 * b for b in batches]) == pytest.approx((0.002, 1e-4))
    # Noise can make a line fall with the batch or start below 0; neither may predict a negative time.
    assert scaling_fit.linear_fit([8, 32, 128], [0.003, 0.002, 0.001]) == pytest.approx((0.002, 0.0))
    intercept, slope = scaling_fit.linear_fit([8, 32, 128], [0.0001, 0.004, 0.016])
    assert intercept == 0.0 and slope > 0


def test_the_page_is_the_rendering_of_the_committed_result():
    page = scaling.DOC.read_text()
    assert scaling.rendered_page(page, json.loads(RESULT.read_text())) == page, (
        "docs/scaling.md differs from bench/results/scaling.json: run `python -m bench.scaling --render-docs`"
    )


def test_a_changed_result_changes_the_page():
    """The check above can fail: one fitted value edited in the result shows up on the page."""
    page = scaling.DOC.read_text()
    doc = json.loads(RESULT.read_text())
    doc["fit"]["ring"]["all_reduce"]["alpha_s"] *= 2
    assert scaling.rendered_page(page, doc) != page


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--worlds", "1"], ["--sizes", "4X"], ["--check-batch", "3"]])
def test_a_bad_flag_is_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        scaling.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench.scaling:"), err
