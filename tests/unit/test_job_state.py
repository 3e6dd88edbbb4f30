"""The launcher's records (app.cluster.job_state), which stop Docker's restarts from repeating a refusal or a finished
job: a refusal is told again only with the same settings, a finish only to a container that came before it, and a
record cut short reads as none. Then on a volume that takes no writes: a read-only mount and a full one. What a user
would notice: the launch going on (a warning naming the record), not a traceback that ends the container, and
nothing half-written that a restart would later misread as a refusal or a finish.

Real file systems, not mocks: a read-only tmpfs and a 16 KiB tmpfs filled to the last byte (mounting needs root, as
CI runs; elsewhere these skip, saying so)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest

from app.cluster.job_state import JobState


def _mount(where, options: str) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")


@pytest.fixture(params=["read-only", "full"])
def unwritable(request, tmp_path):
    where = tmp_path / request.param
    _mount(where, "size=16k,nr_inodes=1000")
    try:
        (where / "job" / "seen").mkdir(parents=True)
        if request.param == "full":
            _fill(where / "filler")
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, capture_output=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(path) -> None:
    """Write until the file system has no byte left (ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"x" * 512):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def test_a_volume_that_takes_no_writes_costs_a_warning_not_the_launch(unwritable, caplog):
    state = JobState(unwritable, "job", "node-a", "settings")
    with caplog.at_level(logging.WARNING, logger="app.cluster.launch"):
        state.arrived()
        state.refuse("bad flag")
        state.finish(200)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and all("cannot record" in w and "restarts may repeat" in w for w in warnings), warnings
    # Nothing was recorded, so a restart reads no refusal and no finish: it runs again, as without the records.
    assert state.refused_before() is None and state.finished_since_arrival() is None
    assert not list((unwritable / "job").rglob("*.json"))


def test_a_refused_container_is_told_its_reason_only_with_the_same_settings_and_a_finish_only_if_it_came_before(
    tmp_path,
):
    """The records of app.cluster.job_state that stop Docker's restarts from repeating a refusal or a finished job."""
    from app.cluster.job_state import JobState, fingerprint

    settings = fingerprint(["--nnodes", "2"], {"DDP_STEPS": "10", "HOME": "/root"})
    assert settings == fingerprint(["--nnodes", "2"], {"DDP_STEPS": "10", "HOME": "/elsewhere"})  # DDP_* only
    assert settings != fingerprint(["--nnodes", "2"], {"DDP_STEPS": "11"})
    a = JobState(tmp_path, "job", "node-a", settings)
    assert a.refused_before() is None
    a.refuse("WORKERS=0 is outside 1..8")
    assert a.refused_before() == "WORKERS=0 is outside 1..8"
    assert JobState(tmp_path, "job", "node-a", "other settings").refused_before() is None
    assert JobState(tmp_path, "job", "node-b", settings).refused_before() is None
    assert JobState(tmp_path, "another job", "node-a", settings).refused_before() is None

    a.arrived()
    first = (tmp_path / "job" / "seen" / "node-a").read_text()
    a.arrived()  # a restart keeps the time it first came
    assert (tmp_path / "job" / "seen" / "node-a").read_text() == first
    a.finish(step=10)
    assert a.finished_since_arrival()["step"] == 10
    late = JobState(tmp_path, "job", "node-c", settings)  # a new container, after the finish: a new run
    assert late.finished_since_arrival() is None

    nothing_kept = JobState(None, "job", "node-a", settings)
    nothing_kept.refuse("x")
    nothing_kept.arrived()
    nothing_kept.finish(step=1)
    assert nothing_kept.refused_before() is None and nothing_kept.finished_since_arrival() is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job"]


def test_a_record_cut_short_or_not_json_reads_as_no_record(tmp_path):
    # A volume shared with something else, or a record a container died writing before os.replace existed.
    from app.cluster.job_state import JobState

    state = JobState(tmp_path, "job", "node-a", "settings")
    state.arrived()
    for broken in ('{"fingerprint": "settings", "reas', "[1, 2]", "\xff\xfe"):
        (tmp_path / "job" / "refused").mkdir(parents=True, exist_ok=True)
        (tmp_path / "job" / "refused" / "node-a.json").write_text(broken, errors="surrogateescape")
        (tmp_path / "job" / "finished.json").write_text(broken, errors="surrogateescape")
        assert state.refused_before() is None and state.finished_since_arrival() is None, broken
    state.finish(step=10)  # a good finish record, but this container's arrival record is empty: read as new
    (tmp_path / "job" / "seen" / "node-a").write_text("")
    assert state.finished_since_arrival() is None


def test_a_container_that_comes_after_the_finish_runs_a_new_job_and_an_empty_state_dir_keeps_nothing(tmp_path):
    """A fresh `docker compose up` after a finished run (the same job id, a container recreated with the same name)
    arrives after the finish record: it is a new run, not a restart to end at once. LAUNCH_STATE_DIR="" keeps none."""
    import json

    from app.cluster.job_state import JobState

    state = JobState.in_dir(str(tmp_path), "job", "node-a", "settings")
    state.finish(step=10)
    (tmp_path / "job" / "finished.json").write_text(json.dumps({"time": 1000.0, "step": 10}))
    state.arrived()  # now, long after the finish at t=1000
    assert state.finished_since_arrival() is None
    (tmp_path / "job" / "seen" / "node-a").write_text("999.5")  # had it come before the finish: a restart
    assert state.finished_since_arrival() == {"time": 1000.0, "step": 10}
    (tmp_path / "job" / "seen" / "node-a").write_text("1000.0")  # in the same instant: part of it
    assert state.finished_since_arrival() == {"time": 1000.0, "step": 10}
    nothing = JobState.in_dir("", "job", "node-a", "settings")
    nothing.arrived()
    nothing.refuse("x")
    assert nothing.dir is None and nothing.refused_before() is None
