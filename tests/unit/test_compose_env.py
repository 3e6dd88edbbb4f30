"""The compose workers' settings: compose.yaml names every setting's ``DDP_*`` variable (so a plain ``docker compose
up`` passes the shell's), and the env file `make up` writes carries every ``DDP_*`` name and says what it is.

What the containers then receive is run for real in tests/e2e/test_compose_cluster.py (plain ``up`` and `make up`'s
file); here, what can be read without Docker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app.cluster.compose_env import FILE_ENV, NAMES_ENV, WRITTEN_ENV, describe_env_file, settings, write_env_file
from app.worker.config import FIELDS, env_name
from tools.config_table import COMPOSE_BEGIN, COMPOSE_END, compose_settings_yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"


def worker() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]["worker"]


def test_compose_names_every_setting_with_no_value_so_the_shells_variable_passes_through():
    environment = worker()["environment"]
    named = {k for k in environment if k.startswith("DDP_") and k != "DDP_CONFIG"}
    assert named == {env_name(name) for name in FIELDS}, "run `make docs-config` after changing TrainConfig"
    # No value: Compose takes the caller's variable when set and leaves it out when not ("not given"). A value here
    # (even an empty one) would override the shell's, or hand the trainer an empty setting.
    assert {environment[k] for k in named} == {None}


def test_the_generated_list_stands_between_its_markers_as_make_docs_config_writes_it():
    text = COMPOSE.read_text()
    body = text[text.index(COMPOSE_BEGIN) + len(COMPOSE_BEGIN) : text.index(COMPOSE_END)]
    assert body == compose_settings_yaml()


def test_a_plain_up_reads_no_env_file_and_make_up_names_its_own():
    (entry,) = worker()["env_file"]
    # ${CLUSTER_ENV_FILE:-/dev/null}: a .cluster.env left by an earlier `make up` is read only when named again.
    assert re.fullmatch(r"\$\{CLUSTER_ENV_FILE:-/dev/null\}", entry["path"]), entry
    assert entry["required"] is False and entry["format"] == "raw"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^CLUSTER_ENV_FILE \?= \.cluster\.env$", makefile, re.M)
    assert re.search(r"^export .*\bCLUSTER_ENV_FILE\b", makefile, re.M), "make up must hand compose the file's name"


def test_make_down_removes_the_env_file():
    env = {k: v for k, v in os.environ.items() if k not in (FILE_ENV, "MAKEFLAGS", "MAKELEVEL")}  # as a user runs it
    out = subprocess.run(["make", "-n", "down"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "rm -f .cluster.env" in out.stdout.splitlines(), out.stdout


def test_the_env_file_holds_every_ddp_name_raw_and_says_what_it_is(tmp_path):
    environ = {"DDP_STEPS": "400", "DDP_STESP": "10", "DDP_LR": "$HOME 'x'", "DDP_CONFIG": "/here", "HOME": "/root"}
    path = write_env_file(tmp_path / "run.env", environ)
    lines = dict(line.split("=", 1) for line in path.read_text().splitlines())
    assert {k: v for k, v in lines.items() if k.startswith("DDP_")} == {
        "DDP_LR": "$HOME 'x'",  # raw: no quoting, no expansion
        "DDP_STEPS": "400",
        "DDP_STESP": "10",  # a typo goes in too: the launcher refuses it by name
    }
    assert lines[FILE_ENV] == str(path) and lines[NAMES_ENV] == "DDP_LR DDP_STEPS DDP_STESP"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", lines[WRITTEN_ENV])
    assert not list(tmp_path.glob(".*.tmp*")), "the temporary file is renamed into place"
    write_env_file(path, {"DDP_SEED": "1"})  # replaced whole: yesterday's settings do not linger
    assert "DDP_STEPS" not in path.read_text() and "DDP_SEED=1" in path.read_text()


def test_a_value_with_a_line_break_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="DDP_DATA_KWARGS: a value with a line break"):
        settings({"DDP_DATA_KWARGS": '{"a":\n1}'})


def test_the_launchers_line_names_the_file_its_time_and_its_settings():
    written = {FILE_ENV: ".cluster.env", WRITTEN_ENV: "2026-12-03T18:00:00Z", NAMES_ENV: "DDP_LR DDP_STEPS"}
    line = describe_env_file(written)
    assert line == "settings from env file .cluster.env (written 2026-12-03T18:00:00Z): DDP_LR, DDP_STEPS"
    assert describe_env_file({"DDP_LR": "0.5"}) is None, "a plain up read no file: nothing to say"
    assert describe_env_file({FILE_ENV: "x.env"}).endswith(": none (no DDP_* in its shell)")


def test_an_env_file_that_cannot_be_written_is_one_line_naming_it_and_exit_2(tmp_path):
    # `make up` runs this first: a CLUSTER_ENV_FILE in a place that cannot hold a file must stop it with the path and
    # what to do, not a traceback (a file where its directory should be: refused even to root, unlike permissions).
    (tmp_path / "a-file").write_text("")
    path = tmp_path / "a-file" / "run.env"
    env = {**os.environ, "DDP_STEPS": "5"}
    out = subprocess.run(
        [sys.executable, "-m", "app.cluster.compose_env", str(path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert out.stderr.splitlines() == [
        f"error: cannot write {path} (Not a directory): choose another CLUSTER_ENV_FILE"
    ], out.stderr


def test_make_ups_line_counts_and_names_the_settings_it_wrote(tmp_path):
    # What `make up` prints: the file, how many DDP_* settings the workers get, and which (none: no names after it).
    path = tmp_path / "run.env"
    base = {k: v for k, v in os.environ.items() if not k.startswith("DDP_")}
    lines = [
        subprocess.run(
            [sys.executable, "-m", "app.cluster.compose_env", str(path)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True,
        ).stdout.strip()
        for env in ({**base, "DDP_STEPS": "5", "DDP_LR": "0.5"}, base)
    ]  # fmt: skip
    assert lines[0].endswith(": 2 setting(s) for the workers: DDP_LR DDP_STEPS") or lines[0].endswith(
        ": 2 setting(s) for the workers: DDP_STEPS DDP_LR"
    ), lines[0]
    assert lines[1].endswith(": 0 setting(s) for the workers"), lines[1]
