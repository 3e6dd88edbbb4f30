"""Launcher cases that generated mutants showed missing (`make mutants`, tools/mutation_triage.yaml).

.venv/bin/python -m pytest tests/unit/test_mutation_kills_launch.py
"""

from __future__ import annotations

import pytest

STORE = ("store", 29400)


def test_a_failure_that_is_not_the_stores_is_told_as_itself():
    from app.cluster.launch import explain

    assert explain(ValueError("bad shape (3, 4)\nmore"), STORE, "job") == "ValueError: bad shape (3, 4)"


@pytest.mark.parametrize("what", ["connection", "message"])
def test_a_lost_store_is_named_with_its_address(what):
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from app.cluster.launch import explain

    e = RendezvousConnectionError("gone") if what == "connection" else RuntimeError("the TCP store went away")
    assert explain(e, STORE, "job").startswith("lost the rendezvous store store:29400 (")


@pytest.mark.parametrize("code, says", [(-1, "was killed by SIGHUP"), (-9, "was killed by SIGKILL"), (2, "bad config")])
def test_an_exit_by_signal_is_named_by_its_signal(code, says):
    from app.cluster.launch import describe_exit

    assert says in describe_exit(code)


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


@pytest.mark.parametrize(
    "flags, address",
    [
        (["--rdzv-backend=c10d", "--rdzv-endpoint=store:29500"], ("store", 29500)),
        (["--rdzv-backend=c10d", "--rdzv-endpoint=store"], ("store", 29400)),  # torchrun's default port
        (["--standalone", "--rdzv-backend=c10d", "--rdzv-endpoint=store:29500"], None),  # the agent hosts its own
        (["--rdzv-backend=static", "--rdzv-endpoint=store:29500"], None),  # no c10d store to wait for
        (["--rdzv-backend=c10d"], None),
    ],
)
def test_the_launcher_waits_for_the_c10d_store_only_where_one_is_named(flags, address):
    from torch.distributed.run import parse_args

    from app.cluster.launch import store_address

    assert store_address(parse_args([*flags, "--nnodes=1:2", "-m", "app.train"])) == address


def test_a_store_port_that_is_not_a_number_is_one_line_and_exit_2():
    from torch.distributed.run import parse_args

    from app.cluster.launch import LaunchError, store_address

    with pytest.raises(LaunchError, match="--rdzv-endpoint='store:abc': give HOST:PORT") as e:
        store_address(parse_args(["--rdzv-backend=c10d", "--rdzv-endpoint=store:abc", "-m", "app.train"]))
    assert e.value.code == 2


def test_a_checkpoint_dir_without_room_for_the_next_save_is_refused_before_training(tmp_path):
    """The launcher's storage check: the newest step file's size against the free space (a sparse file of 8 TiB
    stands for a checkpoint bigger than the disk), ZeRO's shards summed, hidden temp files not counted."""
    from app.cluster.launch import LaunchError, check_checkpoint_dir, newest_checkpoint_bytes

    (tmp_path / "step-00000010.pt").write_bytes(b"x" * 300)
    (tmp_path / "step-00000020.pt").write_bytes(b"x" * 200)
    (tmp_path / ".step-00000030.pt.tmp").write_bytes(b"x" * 5000)
    assert newest_checkpoint_bytes(str(tmp_path)) == 200
    shards = tmp_path / "zero"
    shards.mkdir()
    for name, size in [("manifest.json", 10), ("shard-0.pt", 100), ("shard-1.pt", 120)]:
        (shards / name).write_bytes(b"x" * size)
    assert newest_checkpoint_bytes(str(shards)) == 230
    check_checkpoint_dir(str(tmp_path))  # room enough: nothing said
    check_checkpoint_dir("")  # no checkpoints
    check_checkpoint_dir(str(tmp_path / "not yet"))  # the trainer creates it
    try:
        with open(tmp_path / "step-00000040.pt", "wb") as f:
            f.truncate(8 * 2**40)
    except OSError:
        pytest.skip("this file system cannot hold an 8 TiB sparse file")
    with pytest.raises(LaunchError, match=r"has \d+ bytes free, its newest checkpoint took 8796093022208") as e:
        check_checkpoint_dir(str(tmp_path))
    assert e.value.code == 1


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_is_left_to_torchrun_by_the_early_look_at_the_job_id(flag, capsys):
    """``launch --help`` must show torchrun's options: the parser that reads --rdzv-id before torch is imported
    must neither print its own two options nor exit."""
    from app.cluster.launch import job_state
    from app.worker.config.launch import LaunchConfig

    assert job_state([flag, "--rdzv-id", "job"], LaunchConfig()).dir is None  # no LAUNCH_STATE_DIR here: nothing kept
    assert capsys.readouterr().out == ""


def test_a_job_has_started_once_its_rendezvous_has_members_a_formed_world_or_a_past_round():
    """What a launcher reads at a real c10d store before waiting for its peers (``Reporter.job_started``): torch's
    own rendezvous state, written with torch's own backend. Joining at once is right only for a started job."""
    import datetime
    import pickle

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    from app.cluster.elastic import Reporter

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))

    def started(job: str, **fields) -> bool:
        if fields:
            state = _RendezvousState()
            for name, value in fields.items():
                setattr(state, name, value)
            C10dRendezvousBackend(server, job).set_state(pickle.dumps(state))
        return Reporter(("127.0.0.1", server.port), job, None).job_started()

    node = _NodeDesc("node-a", 1, 0)
    assert not started("no state yet")
    assert not started("fresh", round=0)
    assert started("someone waits", participants={node: 0})
    assert started("formed", complete=True)
    assert started("a past round", round=1)
    assert not Reporter(None, "standalone", None).job_started()  # no store: nothing to read


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


def test_only_a_lost_store_is_waited_for_not_an_ended_job_a_join_timeout_or_a_spare():
    """What the launcher retries after waiting for the store (app.cluster.launch.run_rejoining): a store that went
    away. A closed rendezvous (the job ended) or a spare at the end must end the container, and a join timeout has
    its own retry (a RendezvousTimeoutError), without waiting for a store that is there."""
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    from app.cluster.elastic import SpareAtTheEnd
    from app.cluster.launch import store_lost

    assert store_lost(RendezvousConnectionError("the store is gone"))
    assert not store_lost(RendezvousClosedError("the rendezvous store says closed"))
    assert not store_lost(RendezvousTimeoutError("timed out waiting for the store's participants"))
    assert not store_lost(SpareAtTheEnd())
    assert not store_lost(ValueError("bad shape"))


@pytest.mark.parametrize("port", ["0", "65536", "-1"])
def test_the_store_refuses_a_port_outside_1_to_65535_in_one_line(port, capsys):
    from app.cluster.rendezvous_store import main

    assert main(["--host", "127.0.0.1", "--port", port]) == 2
    assert capsys.readouterr().err.strip() == f"error: --port {port} is not a TCP port; give 1-65535"


def test_the_newest_checkpoint_size_counts_only_finished_checkpoint_files(tmp_path):
    # ZeRO's layout (shards and a manifest, no step-*.pt): every finished file counts, a writer's hidden temp file
    # and a directory do not; with step files, only the newest one counts.
    from app.cluster.launch import newest_checkpoint_bytes

    (tmp_path / "manifest.json").write_bytes(b"m" * 10)
    (tmp_path / "shard-0.pt").write_bytes(b"s" * 20)
    (tmp_path / ".shard-1.pt.tmp").write_bytes(b"t" * 1000)
    (tmp_path / "older").mkdir()
    assert newest_checkpoint_bytes(str(tmp_path)) == 30
    (tmp_path / "step-00000005.pt").write_bytes(b"a" * 7)
    (tmp_path / "step-00000010.pt").write_bytes(b"b" * 9)
    assert newest_checkpoint_bytes(str(tmp_path)) == 9
