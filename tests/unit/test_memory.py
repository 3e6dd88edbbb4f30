"""app.cluster.memory: a trainer killed for memory is told from any other SIGKILL by the kernel's own count, and the
launcher ends with one line naming the rank, the limit, the peak and the fix, restarting nothing.

The cgroup files are written as the kernel lays them out (v1 as Docker mounts it on this machine, v2 as on newer
hosts and Kubernetes nodes); a real kill in a real memory-limited container runs in tests/e2e (the OOM drill)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.cluster.elastic import Reporter
from app.cluster.launch import outcome_of_failure
from app.cluster.memory import CgroupMemory, OomWatch, oom_line, read_cgroup
from app.exit_codes import FAILED

MIB = 1 << 20


def v2(root: Path, limit: str = str(1300 * MIB), peak: int = 1299 * MIB, kills: int = 0) -> Path:
    root.mkdir(exist_ok=True)
    (root / "memory.max").write_text(limit + "\n")
    (root / "memory.peak").write_text(f"{peak}\n")
    (root / "memory.events").write_text(f"low 0\nhigh 0\nmax 12\noom {kills}\noom_kill {kills}\noom_group_kill 0\n")
    return root


def v1(root: Path, limit: int = 700 * MIB, peak: int = 699 * MIB, kills: int = 0) -> Path:
    mem = root / "memory"
    mem.mkdir(parents=True, exist_ok=True)
    (mem / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (mem / "memory.max_usage_in_bytes").write_text(f"{peak}\n")
    (mem / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")
    return root


def test_both_cgroup_versions_are_read(tmp_path):
    assert read_cgroup(v2(tmp_path / "a", kills=3)) == CgroupMemory(1300 * MIB, 1299 * MIB, 3)
    assert read_cgroup(v1(tmp_path / "b", kills=1)) == CgroupMemory(700 * MIB, 699 * MIB, 1)
    assert read_cgroup(v2(tmp_path / "c", limit="max")).limit is None  # v2's "no limit"
    assert read_cgroup(v1(tmp_path / "d", limit=9223372036854771712)).limit is None  # v1's
    assert read_cgroup(tmp_path / "none") is None  # no memory controller: nothing to tell


def test_only_kills_since_the_last_look_count(tmp_path):
    root = v1(tmp_path, kills=2)  # two kills before this launcher started: not its trainer's
    watch = OomWatch(root)
    assert watch.kills() is None
    v1(root, kills=3)
    assert watch.kills().oom_kills == 3
    assert watch.kills() is None, "the same kill counted twice"


def test_the_line_names_rank_limit_peak_and_fixes_by_the_kind_that_runs():
    config = SimpleNamespace(micro_batch=32, parallel="ddp", activation_checkpointing="off")
    line = oom_line(2, "a1b2c3d4e5f6", CgroupMemory(1300 * MIB, 1299 * MIB, 1), config)
    assert line.startswith("rank 2 (this container, a1b2c3d4e5f6) was killed for memory: over its container's limit")
    for part in (
        "1300 MiB",
        "peak 1299 MiB",
        "WORKER_MEMORY",
        "smaller micro_batch than 32",
        "parallel=zero2 or zero3",
        "activation_checkpointing=units",
    ):
        assert part in line, (part, line)
    assert "\n" not in line
    config = SimpleNamespace(micro_batch=8, parallel="zero3", activation_checkpointing="units")
    zero3 = oom_line(0, "c", CgroupMemory(None, None, 1), config)
    assert "the machine's memory" in zero3
    assert "parallel=zero" not in zero3 and "activation_checkpointing" not in zero3  # nothing lighter to suggest


def test_a_kill_for_memory_ends_the_launch_in_one_line_and_no_restart(tmp_path, caplog):
    reporter = Reporter(
        store=None,
        run_id="job",
        workers=None,
        config=SimpleNamespace(micro_batch=16, parallel="zero1", activation_checkpointing="off"),
    )
    reporter.memory = OomWatch(v2(tmp_path, kills=0))
    v2(tmp_path, kills=1)
    failures = {0: SimpleNamespace(exitcode=-9)}
    with caplog.at_level(logging.INFO, logger="app.cluster.launch"):
        reporter.workers_failed(failures)
        assert outcome_of_failure(failures, reporter) == FAILED
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR, [r.getMessage() for r in lines]
    assert "killed for memory" in lines[0].getMessage() and lines[0].getMessage().endswith(": exit 1")


@pytest.mark.parametrize("exitcode", [-9, 1])
def test_a_sigkill_or_failure_with_no_kill_counted_is_the_usual_warning(tmp_path, caplog, exitcode):
    reporter = Reporter(store=None, run_id="job", workers=None)
    reporter.memory = OomWatch(v2(tmp_path, kills=0))
    if exitcode == 1:
        v2(tmp_path, kills=1)  # a kill for memory of another process, while this trainer failed on its own
    with caplog.at_level(logging.INFO, logger="app.cluster.launch"):
        reporter.workers_failed({0: SimpleNamespace(exitcode=exitcode)})
    assert reporter.out_of_memory is None
    assert "rank 0 (this container" in caplog.text and "killed for memory" not in caplog.text


def test_a_count_the_kernel_does_not_let_us_read_is_no_kill_then_or_later(tmp_path):
    """memory.events there but unreadable (here: not a file) says no kill; once readable with no kill counted, the
    watch started meanwhile reports none either: only kills counted after its first look are a trainer's."""
    root = tmp_path / "cg"
    (root / "memory.events").mkdir(parents=True)
    assert read_cgroup(root).oom_kills == 0
    watch = OomWatch(root)
    (root / "memory.events").rmdir()
    v2(root, kills=0)
    assert watch.kills() is None
    v2(root, kills=1)
    assert watch.kills().oom_kills == 1
