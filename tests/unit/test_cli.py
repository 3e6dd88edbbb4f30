"""app.cli, what every entry point shares: the log line's shape and levels (rank 0 INFO, the others WARNING,
LOGLEVEL=DEBUG everything and unfiltered), a bad flag in one line with exit 2, a long message cut to its first line.

The logging cases run in a fresh interpreter each (torch-free, a fraction of a second): ``setup_logging`` replaces
the root logger's handlers, which pytest's own capture relies on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from app.cli import OneLineParser, first_line
from tests.trainer_run import REPO

SPEAK = """
import logging, sys
from app.cli import setup_logging
own = logging.getLogger("torch.x"); own.addHandler(logging.StreamHandler(sys.stdout))  # as torch's loggers come
quiet = sys.argv[1] == "quiet"
setup_logging("rank 1", quiet=quiet, line_filter=lambda r: "noise" not in r.getMessage(), route=["torch.x"])
log = logging.getLogger("app.train")
log.debug("a debug line"); log.info("an info line"); log.info("noise to filter"); log.warning("a warning")
own.warning("routed")
"""


def speak(mode: str, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k != "LOGLEVEL"} | env
    out = subprocess.run(
        [sys.executable, "-c", SPEAK, mode], cwd=REPO, env=environ, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "", "a routed logger kept its own handler: its lines come twice, in two formats"
    return out.stderr.splitlines()


def test_one_line_shape_with_the_tag_and_the_levels_rank_0_and_the_others_see():
    lines = speak("loud")
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d \[rank 1\] (INFO|WARNING) .+", line) for line in lines), lines
    assert [line[9:] for line in lines] == [
        "[rank 1] INFO an info line",
        "[rank 1] WARNING a warning",
        "[rank 1] WARNING routed",  # torch's logger, through our handler only
    ]
    assert [line[9:] for line in speak("quiet")] == ["[rank 1] WARNING a warning", "[rank 1] WARNING routed"]


def test_loglevel_debug_shows_everything_unfiltered():
    messages = [line.split(" ", 4)[4] for line in speak("quiet", LOGLEVEL="debug")]
    assert messages == ["a debug line", "an info line", "noise to filter", "a warning", "routed"]


def test_a_bad_flag_is_one_line_and_exit_2(capsys):
    parser = OneLineParser(prog="python -m app.x")
    parser.add_argument("--steps", type=int)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--steps", "many"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m app.x: error: argument --steps: invalid int value")
    assert err.rstrip().endswith("; run with --help for the flags")

    class Refused(ValueError):
        pass

    with pytest.raises(Refused, match=r"^unrecognized arguments: --stpes 3; run with --help for the flags$"):
        OneLineParser(prog="x", raise_as=Refused).parse_args(["--stpes", "3"])


def test_first_line_of_a_long_message_or_the_type_of_a_silent_error():
    assert first_line(RuntimeError("gloo: peer closed\n  at frame 1\n  at frame 2")) == "gloo: peer closed"
    assert first_line(TimeoutError()) == "TimeoutError"
    assert first_line("  \n") == ""
