"""The chaos proof as a test: a worker lost mid-run and brought back changes neither the outcome nor the parameters.

tests/e2e/drills/chaos.py runs two compose projects of the real image, one after the other: A, 3 workers untouched;
B, 3 workers whose rank-0 container is killed (``docker kill``) at a step, continuing on 2 from the newest
checkpoint, then scaled back to 3 (``up --scale worker=3 --no-recreate``). `make chaos` runs the same proof with 4
workers; here fewer containers start (each imports torch), MAX_WORKERS is the world size, so the world re-forms at
once when the third is back instead of a last call later, and the run is shorter, with the kill early enough that
B still trains on 2, then on 3 again. A has B's final world size: the loss compared below is rank 0's, of its share
of the batch. Asserted here, on one shared run:

- every container of both runs ends with exit code 0 (the victim excepted: killed);
- B trained on 2 after the loss and on 3 again after the scale-up, to the last step, with no manual step between;
- B's final parameters equal A's within the world-size invariance tolerance (tests/integration/test_invariance.py),
  both trained in float64 so that float32 rounding cannot tip a ReLU differently on 2 ranks (docs/cluster.md);
- lost work stays within one checkpoint interval.

Minutes on a loaded 2-core machine (two clusters and their restarts); Docker prerequisites as in
tests/e2e/conftest.py. The documented run (4 workers, 300 steps: bench/results/chaos.json, rendered into
docs/cluster.md) is ``test_the_documented_chaos_run``, marked ``chaos`` and left out of ``make test``: ``make chaos``.
"""

from __future__ import annotations

import os
import shlex

import pytest

from tests.e2e.drills.chaos import build_parser, chaos, summary, write
from tools.provenance import load_average

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

CHECKPOINT_EVERY = 5
WORKERS = 3  # B's world: 3, then 2 after the loss, then 3 again
# The kill comes after a few checkpoints; from there B's world of 2 keeps training while the returning container
# starts, and the world of 3 must still have steps left after that. Each further step is only cost, in A and in B.
STEPS, KILL_AT = 120, 20
# Counted in steps, the world of 2 lasts as long as its steps take, and on a fast machine the run could end before
# the third container is back. Paced, the steps after the kill span a time of their own; where steps are slower than
# the pace it adds nothing.
PACE_SECONDS = "0.25"


@pytest.fixture(scope="module")
def result() -> dict:
    # The image as the other e2e tests build it (compose's pull_policy: build caches it): build once here too.
    args = build_parser().parse_args(
        [
            *("--workers", str(WORKERS), "--max-workers", str(WORKERS)),
            *("--steps", str(STEPS), "--kill-at", str(KILL_AT), "--checkpoint-every", str(CHECKPOINT_EVERY)),
            *("--min-step-seconds", PACE_SECONDS, "--timeout", "600"),
        ]
    )
    result = chaos(args)
    worlds = [p["world"] for p in result["curves"]["B"]]
    print(
        f"\nchaos: killed at step {result['killed_at_step']}, resumed from {result['resumed_from_step']}; failure -> "
        f"next step {result['failure_to_next_step_s']} s, scale-up -> next step {result['scale_up_to_next_step_s']} s; "
        f"B's steps per world size {dict((w, worlds.count(w)) for w in sorted(set(worlds), key=str))}"
    )
    return result


def test_every_container_ends_with_exit_code_zero(result):
    victim = result["victim"]["container"]
    assert all(code == 0 for code in result["exit_codes"]["A"].values()), result["exit_codes"]
    survivors = {name: code for name, code in result["exit_codes"]["B"].items() if name != victim}
    assert survivors and all(code == 0 for code in survivors.values()), result["exit_codes"]


def test_the_world_shrinks_and_grows_back_without_a_manual_step(result):
    checks = result["checks"]
    assert all(ok for name, ok in checks.items() if "trained on" in name or "last step" in name), checks
    worlds = [p["world"] for p in result["curves"]["B"]]
    assert WORKERS - 1 in worlds and worlds[-1] == WORKERS, worlds


def test_final_parameters_equal_the_uninterrupted_run(result):
    # Both runs in float64 (tests/e2e/drills/chaos.py --dtype): the other orders of additions of the worlds of 2 and 3
    # cost ~1e-15 there, so a replayed or skipped step, a lost optimizer state or a wrong share of the global batch
    # shows up far above it.
    assert result["dtype"] == "float64", result["dtype"]
    assert result["max_abs_param_diff"] <= result["tolerance"], (result["max_abs_param_diff"], result["tolerance"])
    assert result["final_loss"]["A"] == result["final_loss"]["B"], result["final_loss"]


def test_lost_work_is_at_most_one_checkpoint_interval(result):
    assert result["steps_redone"] is not None and 0 <= result["steps_redone"] <= CHECKPOINT_EVERY + 1, result


@pytest.mark.chaos
def test_the_documented_chaos_run():
    """`make chaos`: every flag at its default (or CHAOS_ARGS: a trial, written to runs/), result written first."""
    parser = build_parser()
    args = parser.parse_args(shlex.split(os.environ.get("CHAOS_ARGS", "")))
    before = load_average()
    result = chaos(args)
    print("\n" + summary(result, write(parser, args, result, before)))
    assert result["verdict"] == "PASS", [name for name, ok in result["checks"].items() if not ok]
