"""The flight recorder's ring and dumps, and the doctor's answers to bad input, in one process (no process group:
the recorder labels every collective "world", as in a world of one).

A truncated dump or one from another job: one line saying so, the rest read, exit 2; no dump at all: one line, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from app.diagnostics.doctor import main, summary_line
from app.diagnostics.dumps import load
from app.diagnostics.recorder import FlightRecorder
from tests.trainer_run import REPO


def write_dumps(
    directory: Path, world_size: int = 2, steps: int = 5, world_id: str = "w1", reason: str = "SIGUSR1"
) -> None:
    """Real dumps of ``world_size`` recorders that each ran ``steps`` all-reduces to completion."""
    recorders = [FlightRecorder(capacity=64) for _ in range(world_size)]
    for rank, rec in enumerate(recorders):
        rec.configure(rank=rank, world_size=world_size, dump_dir=directory, job="job", world_id=world_id)
    for step in range(steps):  # each rank first in turn, as ranks arrive at a collective in no fixed order
        for rec in recorders[step % world_size :] + recorders[: step % world_size]:
            rec.end(rec.start("all_reduce", None, torch.zeros(256), "DDP bucket 0"))
    for rec in recorders:
        rec.dump(reason)


def test_the_ring_keeps_the_last_entries_and_counts_every_one():
    rec = FlightRecorder(capacity=8)
    for _ in range(20):
        rec.end(rec.start("broadcast", None, torch.zeros(3, dtype=torch.float64), "test"))
    entries = rec.entries()
    assert [e[0] for e in entries] == list(range(13, 21)) and rec.recorded == 20
    assert entries[-1][1:6] == ["broadcast", "world", 24, "float64", "test"] and entries[-1][7] >= entries[-1][6]


def test_a_recorder_with_no_entries_records_and_dumps_nothing(tmp_path: Path):
    rec = FlightRecorder(capacity=0)
    rec.configure(dump_dir=tmp_path)
    assert rec.start("all_reduce", None, torch.zeros(1), "x") is None
    assert rec.dump("SIGUSR1") is None and list(tmp_path.iterdir()) == []


def test_a_dump_is_written_whole_or_not_at_all(tmp_path: Path):
    write_dumps(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json"]  # no temp file left behind
    doc = json.loads((tmp_path / "rank-1.json").read_text())
    assert doc["header"]["rank"] == 1 and len(doc["entries"]) == 5
    blocked = tmp_path / "file"
    blocked.write_text("")
    rec = FlightRecorder(capacity=4)
    rec.configure(dump_dir=blocked / "flight")  # a file where the directory should be: a warning, no exception
    rec.start("all_reduce", None, torch.zeros(1), "x")
    assert rec.dump("SIGUSR1") is None


def test_healthy_dumps_say_so_and_exit_0(tmp_path: Path, capsys):
    write_dumps(tmp_path)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "doctor: no hang, desync or straggler in 2 of 2 ranks' dumps: every collective up to #5 completed\n"
    )
    assert "all_reduce #5 (DDP bucket 0, 1.0 KiB float32)" in out


def test_a_rank_lost_between_collectives_is_named_when_the_others_dumped_for_a_failure(tmp_path: Path):
    # A worker killed between two steps: the others' next collective fails at once ("peer went away"), so nothing is
    # left in flight and every collective in the dumps completed; the rank without a dump is the one to look at.
    write_dumps(tmp_path, world_size=3, reason="peer went away")
    (tmp_path / "rank-1.json").unlink()
    assert summary_line(tmp_path) == (
        "doctor: rank 1 left no dump (killed or frozen); ranks 0, 2 stopped (peer went away) after all_reduce #5 "
        "(DDP bucket 0, 1.0 KiB float32), which completed"
    )
    # Dumps on request (SIGUSR1) say nothing of a rank that was not asked for one.
    asked = tmp_path / "asked"
    write_dumps(asked, world_size=3)
    (asked / "rank-1.json").unlink()
    assert summary_line(asked).startswith("doctor: no hang, desync or straggler in 2 of 3 ranks' dumps")


def test_a_truncated_dump_is_named_and_read_as_far_as_it_goes(tmp_path: Path, capsys):
    write_dumps(tmp_path, steps=5)
    path = tmp_path / "rank-1.json"
    text = path.read_text()
    path.write_text(text[: text.index('[4, "all_reduce"') + 10])  # cut inside the 4th entry
    assert main([str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert err == "doctor: rank-1.json: truncated after 3 entries: read those (the rest is lost)\n"
    assert out.startswith("doctor: ") and "SIGUSR1 (truncated)" in out
    assert [e["seq"] for e in load(tmp_path).by_rank[1].entries] == [1, 2, 3]


def test_a_dump_from_another_job_is_left_out_in_one_line(tmp_path: Path, capsys):
    write_dumps(tmp_path, world_size=3)
    stale = tmp_path / "old"
    write_dumps(stale, world_size=3, world_id="w0")
    (stale / "rank-2.json").replace(tmp_path / "rank-2.json")
    assert main([str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert err == (
        "doctor: rank-2.json: from another job (job 'job', world 'w0'; the others: job 'job', world 'w1'): left out; "
        "delete stale dumps before a new run\n"
    )
    assert "\n2     no dump" in out


def test_not_a_dump_and_no_dumps_are_one_line_each_exit_2(tmp_path: Path):
    (tmp_path / "rank-0.json").write_text('{"something": "else"}')
    doctor = subprocess.run(
        [sys.executable, "-m", "app.doctor", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert doctor.returncode == 2
    assert (
        doctor.stderr == "doctor: rank-0.json: not a flight recorder dump (no ddp-flight-recorder/1 header): left out\n"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    doctor = subprocess.run(
        [sys.executable, "-m", "app.doctor", str(empty)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert doctor.returncode == 2 and doctor.stdout == "" and len(doctor.stderr.splitlines()) == 1, doctor.stderr
    assert "no rank-N.json dumps" in doctor.stderr
    assert summary_line(empty) is None


def test_the_desync_fingerprint_tells_equal_sizes_issued_for_different_reasons_apart():
    from app.diagnostics.desync import fingerprint

    rec = FlightRecorder(capacity=4)
    t = torch.zeros(8)
    bucket, extra = rec.start("all_reduce", None, t, "DDP bucket 0"), rec.start("all_reduce", None, t, "drill: extra")
    extra[0] = bucket[0]  # the same sequence number on two ranks
    assert fingerprint(bucket, t) != fingerprint(extra, t)
    assert fingerprint(bucket, t) == fingerprint(list(bucket), t.clone())


def test_a_rank_that_entered_the_hung_collective_late_is_named_among_those_waiting(tmp_path: Path):
    """Rank 1 frozen; rank 2 waited its whole timeout in all-reduce #6, rank 0 entered it late (a busy machine) and
    its wait was cut short when rank 2 gave up: rank 0 waited there too, however briefly, and must be named so."""
    import time

    recorders = [FlightRecorder(capacity=64) for _ in range(3)]
    for rank, rec in enumerate(recorders):
        rec.configure(rank=rank, world_size=3, dump_dir=tmp_path, job="job", world_id="w1")
        for _ in range(5):
            rec.end(rec.start("all_reduce", None, torch.zeros(256), "DDP bucket 0"))
    recorders[2].start("all_reduce", None, torch.zeros(256), "DDP bucket 0")
    recorders[2]._ring[-1][6] -= 5.0  # rank 2 entered #6 five seconds before the dumps
    recorders[0].start("all_reduce", None, torch.zeros(256), "DDP bucket 0")  # rank 0 only now
    time.sleep(0.01)
    for rank in (0, 2):
        recorders[rank].dump("peer went away" if rank == 0 else "collective timeout")
    assert summary_line(tmp_path) == (
        "doctor: rank 1 left no dump (frozen or killed) and never completed all_reduce #6 (DDP bucket 0, 1.0 KiB "
        "float32); ranks 0, 2 waited there 5.0 s"
    )
