"""The flight recorder, the desync check and the doctor on real gloo ranks: the drills that need no trainer.

Each drill trains our DDP on 3 ranks over a process group of its own with a short collective timeout, so that a
hang ends in seconds, and dumps the ranks' rings the way the trainer does (on a failure, on SIGUSR1); the doctor
then reads the dumps from disk:

- one rank issuing an extra collective: the doctor names the rank and both ops at the first sequence number where
  the ranks differ; with the desync check on, every rank stops there instead, with the same line;
- one rank slowed 3x: the doctor names it as the straggler, and its worst collective;
- one rank stuck in its own code before a collective, every rank sent SIGUSR1: the doctor names the rank that never
  entered it, and how long the others waited there;
- SIGUSR1 to a rank blocked inside a collective: it dumps at once, the collective shown in flight.

The SIGSTOP drill runs the real trainer: tests/integration/test_doctor_drill.py.

    .venv/bin/python -m pytest -q -n0 tests/integration/test_flight_recorder.py
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from app.diagnostics import collectives as recorded
from app.diagnostics import desync
from app.diagnostics.doctor import summary_line
from app.diagnostics.dumps import load
from app.diagnostics.recorder import RECORDER, failure_reason, install_dump_signal
from app.parallel.ddp import DistributedDataParallel as DDP
from app.world import run_world

TIMEOUT_S = 5  # the drills' collective timeout: a hang ends within it
EXTRA_AT_STEP = 3  # the step after whose backward rank 1 issues its extra collective
SLOW_RANK = 2


def _model_and_group(rank: int, world_size: int, dump_dir: str, check: bool):
    group = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT_S))
    RECORDER.configure(capacity=512, rank=rank, world_size=world_size, dump_dir=dump_dir, job="test", world_id="w")
    install_dump_signal()
    if check:
        desync.enable()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
    return DDP(net, process_group=group, bucket_cap_mb=1), group


def _extra_collective(rank: int, world_size: int, dump_dir: str, check: bool) -> str:
    """Rank 1 all-reduces one more tensor after step 3's backward (say, a gradient norm for its log)."""
    model, group = _model_and_group(rank, world_size, dump_dir, check)
    try:
        for step in range(6):
            model(torch.randn(4, 8)).sum().backward()
            if step == EXTRA_AT_STEP and rank == 1:
                grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # the bucket's size: no error
                extra = grads[:3] if check else grads
                recorded.all_reduce(extra, "drill: extra all-reduce", group=group)
    except RuntimeError as e:
        RECORDER.dump(failure_reason(e))
        return f"{type(e).__name__}: {e}"
    RECORDER.dump("finished")
    return "finished"


def test_a_rank_issuing_an_extra_collective_is_named_with_both_ops(tmp_path: Path):
    outcomes = run_world(_extra_collective, 3, str(tmp_path), False, timeout=120)
    # The extra all-reduce pairs up with the others' next bucket (same size); rank 1 then waits alone at the end.
    assert outcomes[0] == outcomes[2] == "finished" and "Timed out" in outcomes[1], outcomes
    line = summary_line(tmp_path)
    seq = EXTRA_AT_STEP + 2  # one bucket per step: rank 1's extra is collective #5, the others' #5 is step 4's bucket
    assert line == (
        f"doctor: ranks disagree at #{seq}: rank 1 issued all_reduce (drill: extra all-reduce, 2.8 KiB float32), "
        f"the others (ranks 0, 2) all_reduce (DDP bucket 0, 2.8 KiB float32) (desync)"
    ), line


def test_the_desync_check_stops_every_rank_at_the_first_mismatch_naming_both_ops(tmp_path: Path):
    started = time.monotonic()
    outcomes = run_world(_extra_collective, 3, str(tmp_path), True, timeout=120)
    expected = (
        "CollectiveDesync: ranks disagree at #5: rank 1 issued all_reduce (drill: extra all-reduce, 12 B float32), "
        "the others (ranks 0, 2) all_reduce (DDP bucket 0, 2.8 KiB float32) (desync)"
    )
    assert outcomes == [expected] * 3, outcomes
    # Stopped at the mismatch, not after a collective timeout.
    assert time.monotonic() - started < 60
    dumps = load(tmp_path)
    assert {d.header["reason"] for d in dumps.by_rank.values()} == {"desync"}
    assert summary_line(tmp_path) == "doctor: " + expected.removeprefix("CollectiveDesync: ")


def _slowed(rank: int, world_size: int, dump_dir: str, steps: int) -> int:
    """Rank SLOW_RANK takes 3x as long for each forward (twice its own time more, at least 20 ms: above the noise);
    at the end every rank is sent SIGUSR1, and dumps."""
    model, _ = _model_and_group(rank, world_size, dump_dir, False)
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = model(torch.randn(16, 8)).sum()
        if rank == SLOW_RANK:
            time.sleep(max(2 * (time.perf_counter() - t0), 0.02))
        loss.backward()
    dist.barrier()
    path = Path(dump_dir) / f"rank-{rank}.json"
    os.kill(os.getpid(), signal.SIGUSR1)
    _wait_for(path)
    return RECORDER.last_seq(model.process_group)


def test_a_slowed_rank_is_named_as_the_straggler(tmp_path: Path):
    steps = 20
    assert run_world(_slowed, 3, str(tmp_path), steps, timeout=120) == [steps] * 3
    line = summary_line(tmp_path)
    assert line.startswith(f"doctor: rank {SLOW_RANK} is the straggler: last into "), line
    assert "the worst, all_reduce #" in line and "(DDP bucket 0" in line, line
    assert {d.header["reason"] for d in load(tmp_path).by_rank.values()} == {"SIGUSR1"}


def _stuck_in_its_own_code(rank: int, world_size: int, dump_dir: str) -> None:
    """Rank 1 stops in its own code before step 3's backward (a hung data loader, say) while the others wait in the
    bucket's all-reduce; it then sends every rank SIGUSR1, as an operator would, and goes on once all have dumped."""
    model, _ = _model_and_group(rank, world_size, dump_dir, False)
    pids: list = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    for step in range(4):
        loss = model(torch.randn(4, 8)).sum()
        if step == 3 and rank == 1:
            time.sleep(STUCK_S)
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)
            for r in range(world_size):
                _wait_for(Path(dump_dir) / f"rank-{r}.json")
        loss.backward()


STUCK_S = 2.0


def test_a_rank_stuck_before_a_collective_is_named_and_how_long_the_others_waited(tmp_path: Path):
    run_world(_stuck_in_its_own_code, 3, str(tmp_path), timeout=120)
    line = summary_line(tmp_path)
    match = re.fullmatch(
        r"doctor: rank 1 never entered all_reduce #4 \(DDP bucket 0, 2\.8 KiB float32\) \(its last: all_reduce #3, "
        r"done, [\d.]+ s before its dump\); ranks 0, 2 waited there ([\d.]+) s",
        line,
    )
    assert match and float(match[1]) >= STUCK_S - 0.5, line


def _blocked_then_signalled(rank: int, world_size: int, dump_dir: str) -> dict:
    """Rank 0 waits in an all-reduce that rank 1 joins only after it has sent rank 0 SIGUSR1 and seen its dump."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=60))
    RECORDER.configure(capacity=16, rank=rank, world_size=world_size, dump_dir=dump_dir, job="test", world_id="w")
    install_dump_signal()
    pids: list = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        # Signalled until its dump shows it inside the all-reduce: a signal can reach rank 0 on its way there.
        path = Path(dump_dir) / "rank-0.json"
        for _ in range(100):
            os.kill(pids[0], signal.SIGUSR1)
            _wait_for(path)
            if json.loads(path.read_text())["entries"]:
                break
            path.unlink()
            time.sleep(0.05)
    recorded.all_reduce(torch.ones(4), "test: blocked", group=group)
    return {}


def test_sigusr1_dumps_a_rank_blocked_inside_a_collective(tmp_path: Path):
    run_world(_blocked_then_signalled, 2, str(tmp_path), timeout=120)
    dump = load(tmp_path).by_rank[0]
    assert dump.header["reason"] == "SIGUSR1"
    (entry,) = dump.entries
    assert entry["op"] == "all_reduce" and entry["source"] == "test: blocked" and entry["end"] is None, entry


def _wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no dump at {path} {timeout:.0f}s after SIGUSR1"
        time.sleep(0.05)
