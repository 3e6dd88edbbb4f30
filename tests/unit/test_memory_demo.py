"""bench/memory_demo.py's choices, checked without Docker (tests/e2e/test_memory_sharding.py runs it).

- Its ``WORKER_MEMORY`` splits the kinds as the planner predicts for its model at 4 ranks: ddp well over, zero2
  under, zero3 well under; a change of the model, the limit or the measured bases that closes a gap fails here in
  seconds, not in a minute and a half of containers.
- A container's peak is read from where each cgroup version and driver puts it, and is None where there is none.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from app import plan
from bench import memory_demo as demo


def test_the_limit_splits_the_kinds_as_the_planner_predicts(tmp_path, monkeypatch):
    demo.write_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    facts = plan.model_facts(
        "memory_model:build",
        {"width": demo.WIDTH, "depth": demo.DEPTH},
        "teacher_classification",
        {"size": 512, "seed": 0},
        32,  # compose's effective_batch of 128 over 4 ranks
        None,  # the planner's default for integer targets: cross-entropy, as DDP_LOSS=cross_entropy
    )
    assert facts.psi == demo.psi()
    bases, limit = plan.measured_base(), plan.parse_memory(demo.WORKER_MEMORY)
    peak = {k: plan.predict(k, demo.WORKERS, facts, plan.base_for(k, demo.WORKERS, bases)).peak for k in demo.KINDS}
    mib = {k: v >> 20 for k, v in peak.items()}
    # ddp over by more than the container's own few tens of MiB; zero3 under by more than a base's spread.
    assert peak["ddp"] > 1.1 * limit and peak["zero2"] < limit and peak["zero3"] < 0.8 * limit, (mib, limit >> 20)


@pytest.mark.parametrize("pattern", demo.PEAK_FILES)
def test_a_containers_peak_is_read_where_its_cgroup_is(tmp_path, pattern):
    path = tmp_path / pattern.format(id="abc")
    path.parent.mkdir(parents=True)
    path.write_text("629145600\n")
    assert demo.read_peak("abc", root=tmp_path) == 629145600
    assert demo.read_peak("other", root=tmp_path) is None


def test_no_cgroup_no_peak(tmp_path: Path):
    assert demo.read_peak("abc", root=tmp_path) is None
