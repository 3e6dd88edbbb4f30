"""The scaling model (bench/scaling_fit.py): its fit recovers a known alpha and beta, its step and bubble terms reduce
to the textbook cases, and docs/scaling.md is the rendering of the committed bench/results/scaling.json.

    .venv/bin/python -m pytest tests/unit/test_scaling.py   # after `make scaling`: bench.scaling --render-docs
"""

from __future__ import annotations

import json
import math

import pytest

from bench import scaling, scaling_fit
from bench.provenance import RESULTS

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
    doc["fit"]["all_reduce"]["alpha_s"] *= 2
    assert scaling.rendered_page(page, doc) != page


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--worlds", "1"], ["--sizes", "4X"], ["--check-batch", "3"]])
def test_a_bad_flag_is_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        scaling.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench.scaling:"), err
