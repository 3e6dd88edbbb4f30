"""The launcher's records (app.cluster.job_state) on a volume that takes no writes: a read-only mount and a full
one. What a user would notice: the launch going on (a warning naming the record), not a traceback that ends the
container, and nothing half-written that a restart would later misread as a refusal or a finish.

Real file systems, not mocks: a read-only tmpfs and a 16 KiB tmpfs filled to the last byte (mounting needs root,
as CI runs; elsewhere these skip, saying so).
"""

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
