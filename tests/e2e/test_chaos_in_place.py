"""The chaos proof under ``heal=in_place`` (issue 41): the same two compose projects as tests/e2e/test_chaos.py, but
B's killed container heals in instead of restarting the world.

A module of its own so that it runs in the first Docker lane (tests/conftest.py ``SECOND_LANE`` holds
test_chaos.py's shared run): both lanes then end about together. ``make chaos CHAOS_ARGS="--heal in_place"`` is the
documented run's counterpart.
"""

from __future__ import annotations

import pytest

from tests.e2e.drills.chaos import build_parser, chaos
from tests.e2e.test_chaos import CHECKPOINT_EVERY, KILL_AT, PACE_SECONDS, STEPS, WORKERS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


def test_a_run_healed_in_place_equals_the_uninterrupted_run():
    """heal=in_place (issue 41): the same proof, B's rank-0 container killed and started again, but no world restarts:
    the survivors heal to 2 and the returning container joins the live world as a newcomer, given the state by a
    peer. B's final float64 parameters equal A's to round-off (max |Δparam| <= 1e-9: the heal drills' bar),
    no step is redone beyond the failed one, and every container ends with exit code 0."""
    args = build_parser().parse_args(
        [
            *("--workers", str(WORKERS), "--max-workers", str(WORKERS), "--heal", "in_place", "--tolerance", "1e-9"),
            *("--steps", str(STEPS), "--kill-at", str(KILL_AT), "--checkpoint-every", str(CHECKPOINT_EVERY)),
            *("--min-step-seconds", PACE_SECONDS, "--timeout", "600"),
        ]
    )
    result = chaos(args)
    print(f"\nchaos, heal=in_place: {result['checks']}; max |Δparam| {result['max_abs_param_diff']:.3g}")
    assert result["verdict"] == "PASS", [name for name, ok in result["checks"].items() if not ok]
    assert result["dtype"] == "float64" and result["max_abs_param_diff"] <= 1e-9, result["max_abs_param_diff"]
    assert result["steps_redone"] == 0 and result["resumed_from_step"] is None, result
    victim = result["victim"]["container"]
    assert all(code == 0 for name, code in result["exit_codes"]["B"].items() if name != victim), result["exit_codes"]
