"""app.files: the one atomic write, whole or absent (checkpoints, sharded checkpoints, job records, the env file)."""

from __future__ import annotations

import os

import pytest

from app.files import write_atomically, write_text_atomically


def test_a_write_replaces_the_file_whole_and_returns_what_the_writer_returned(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    assert write_atomically(path, lambda f: f.write(b"new contents")) == len(b"new contents")
    assert path.read_text() == "new contents"
    assert os.listdir(tmp_path) == ["state.json"], "no temporary file left beside it"


def test_a_writer_that_fails_leaves_the_old_file_and_no_temporary_file(tmp_path):
    path = tmp_path / "step-00000010.pt"
    path.write_bytes(b"the good checkpoint")

    def full_disk(f):
        f.write(b"half of a new one")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomically(path, full_disk)
    assert path.read_bytes() == b"the good checkpoint"
    assert os.listdir(tmp_path) == [path.name]


def test_a_reader_never_sees_half_a_file_while_it_is_written(tmp_path):
    path = tmp_path / "run.env"
    write_text_atomically(path, "DDP_STEPS=10\n")
    seen = []

    def slow(f):
        f.write(b"DDP_STEPS=")
        seen.append(path.read_text())  # mid-write, the old file is what a reader gets
        f.write(b"20\n")

    write_atomically(path, slow)
    assert seen == ["DDP_STEPS=10\n"] and path.read_text() == "DDP_STEPS=20\n"


def test_text_is_written_as_utf8(tmp_path):
    write_text_atomically(tmp_path / "a.txt", "größe ✓")
    assert (tmp_path / "a.txt").read_bytes() == "größe ✓".encode()


def test_two_writers_of_one_file_at_once_each_write_whole_though_they_share_a_pid(tmp_path):
    # Two containers on one volume run their launchers as the same pid and record the job's finish together; a
    # temporary name made of the pid alone had the second writer truncate the first's file and the first's rename fail,
    # or leave a record of both texts mixed, which the next start read as no record at all.
    path = tmp_path / "finished.json"
    first, second = '{"time": 1764931234.5, "step": 6}', '{"time": 1764931234.25, "step": 6}'

    def first_writer(f):
        f.write(first[:10].encode())
        write_text_atomically(path, second)  # the other writer starts and ends in the middle of this one's write
        assert path.read_text() == second
        f.write(first[10:].encode())

    write_atomically(path, first_writer)
    assert path.read_text() == first, "the last rename wins, whole"
    assert os.listdir(tmp_path) == [path.name], "no temporary file left beside it"
