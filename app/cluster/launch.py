"""The cluster's launcher: torchrun's elastic agent, with exit codes and log lines a person can read.

Every worker container runs it (compose.yaml) in place of ``torchrun``, with torchrun's own flags::

    python -m app.cluster.launch --nnodes=1:8 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=rendezvous:29400 \\
        --rdzv-id=job1 --max-restarts=3 -m app.train --steps 200
    python -m app.cluster.launch --standalone --nproc-per-node=2 -m app.train --steps 20      # one machine
    LOGLEVEL=DEBUG python -m app.cluster.launch ...                                 # torch's own log, tracebacks

The engine is torchrun's (``torch.distributed.run``'s parser, ``elastic_launch``, its ``LocalElasticAgent``); this
module adds what a person reading ``docker compose ps`` and ``docker compose logs`` needs:

- **Exit codes**: 0 the workers finished, or this container was stopped on request (SIGTERM/SIGINT) and its
  trainer exited 0 after checkpointing; 2 bad configuration (torchrun's ``--nnodes``, the trainer's settings,
  ``WORKERS``, more containers than the world's maximum); 1 anything else. Plain torchrun re-raises a stop signal
  (exit 1 after a clean stop) and reports a trainer's exit 2 as a ``ChildFailedError`` (exit 1).
- **The launcher does the restarts, not Docker** (compose.yaml: ``restart: "no"`` on workers): a failed trainer is
  restarted by the agent (``--max-restarts``); a lost store (``LAUNCH_STORE_LOST_SECONDS``, 120) or a join that
  timed out is joined again as often. An exit code is the container's last word, as ``docker compose ps`` shows.
- **One ending per job** (``app.cluster.job_state``, under ``LAUNCH_STATE_DIR``): a container started again (``up``,
  ``start``) finds its refusal recorded and exits 2 again in one line within a second (before importing torch),
  or finds its job finished and exits 0: it forms no new world and prints no second FINISHED.
- **Checks before the agent starts**, each one line within a bounded time: the torch its patches were written for
  (app.torch_patches), the trainer's settings and the order of its timeouts and ``--rdzv-conf``'s (app.worker.config),
  ``WORKERS`` against ``--nnodes``, the checkpoint directory taking a file and room for one more checkpoint, the
  rendezvous store answering (``LAUNCH_STORE_WAIT_SECONDS``).
- **A refusal, a storage fault or a kill for memory is not retried** (a trainer's exit 2, its exit 74, the kernel's
  kill over the container's limit: ``app.cluster.memory``): it would fail the same way again. One line, the cause.
- **A container that comes to a live world heals in** (``heal=in_place``): its trainer joins the world the
  running trainers hold, given the state by a live peer, instead of entering torchrun's rendezvous, which would
  restart every trainer (``app.cluster.newcomer``).
- **One line per event** instead of torch's multi-line reports and tracebacks: this container joining a world
  (its rank, the members, which containers left or came since the last world), its trainer failing (rank, exit
  code or signal), leaving a world and why, the reason the launcher gives up. What it reads of torch's private
  elastic internals for that lives in ``app.cluster.elastic``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import socket
import sys
import threading

from app.checkpoint_dir import checkpoint_bytes, find_checkpoints
from app.cli import first_line, setup_logging
from app.cluster.compose_env import describe_env_file
from app.cluster.elastic import (
    Reporter,
    SpareAtTheEnd,
    complete_first_world_when_full,
    describe_exit,
    fresh_node_identity,
    install_agent,
    short,
)
from app.cluster.forked_trainer import fork_trainers, runs_the_trainer
from app.cluster.job_state import JobState, fingerprint
from app.cluster.newcomer import join_live_world, live_world_to_join
from app.exit_codes import BAD_CONFIG, FAILED, OK, STORAGE_FAILED
from app.net import TcpUnreachable, wait_for_tcp
from app.torch_patches import TorchChanged, check_torch
from app.worker.config import ConfigError
from app.worker.config.launch import LaunchConfig

log = logging.getLogger("app.cluster.launch")


class LaunchError(Exception):
    """A reason to stop before (or instead of) training: ``str()`` is the one line shown, ``code`` the exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


# -- checks before the agent starts -------------------------------------------------------------------------------
def nnodes_range(nnodes: str) -> tuple[int, int]:
    """``--nnodes`` as (MIN, MAX); raise LaunchError (exit 2) for anything torchrun would misread.

    Example::

        >>> nnodes_range("1:8")
        (1, 8)
    """
    from torch.distributed.run import parse_min_max_nnodes

    try:
        low, high = parse_min_max_nnodes(nnodes)
    except (RuntimeError, ValueError):
        low = high = 0
    if not 1 <= low <= high:
        raise LaunchError(f"--nnodes={nnodes!r}: give N or MIN:MAX with 1 <= MIN <= MAX (e.g. 1:8)", BAD_CONFIG)
    return low, high


def expected_workers(high: int, environ=os.environ) -> int | None:
    """``WORKERS`` (the replica count compose starts) when set: it must fit the world's range."""
    raw = environ.get("WORKERS", "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= high:
        raise LaunchError(
            f"WORKERS={raw}: a world holds 1..{high} workers (MAX_WORKERS={high}); "
            f"start 1 to {high} containers (docker compose up --scale worker=N), or raise MAX_WORKERS",
            BAD_CONFIG,
        )
    return n


def check_trainer_config(args):
    """The trainer's settings, checked once here rather than failing (and being restarted) in every attempt.

    Returns the resolved TrainConfig, or None when the script is not app.train.
    """
    if not runs_the_trainer(args):
        return None
    from app.worker.config import ConfigError, digest, load_config
    from app.worker.config.timeouts import check_launch_timeouts

    try:
        resolved = load_config(list(args.training_script_args))
        check_launch_timeouts(args.rdzv_conf, resolved.config.collective_timeout_seconds)
    except ConfigError as e:
        raise LaunchError(f"config error: {e}", BAD_CONFIG) from None
    # One line per container (rank 0's trainer logs the whole table): equal digests, equal settings everywhere.
    from_env = sum(source.startswith("env ") for source in resolved.sources.values())
    log.info(
        "trainer settings: %d of %d from the environment, digest %s",
        from_env,
        len(resolved.sources),
        digest(resolved.config),
    )
    return resolved.config


def check_checkpoint_dir(directory: str) -> None:
    """Refuse to start (exit 1, one line) where the next checkpoint cannot be written: a file cannot be created in
    ``directory``, or it has less room than its newest checkpoint took. Without this, each restart after a storage
    fault would train up to the next save and fail there again."""
    if not directory or not os.path.isdir(directory):
        return  # no checkpoints, or a directory the trainer creates: its own save reports a failure
    probe = os.path.join(directory, f".launch-probe-{socket.gethostname()}-{os.getpid()}")  # PIDs repeat in containers
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)  # one block: an empty file can be created on a disk with no block left
        os.remove(probe)
        stat = os.statvfs(directory)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(probe)
        cause = f"{e.strerror} ({errno.errorcode.get(e.errno, e.errno)})"
        raise LaunchError(f"checkpoint_dir {directory} cannot take a file: {cause}; {STORAGE_ADVICE}", FAILED) from None
    free, needed = stat.f_bavail * stat.f_frsize, newest_checkpoint_bytes(directory)
    if free < needed:
        raise LaunchError(
            f"checkpoint_dir {directory} has {free} bytes free, its newest checkpoint took {needed}: the next save "
            f"would fail; {STORAGE_ADVICE}",
            FAILED,
        )


STORAGE_ADVICE = "free space or fix the permissions (or point checkpoint_dir elsewhere), then start the job again"


def newest_checkpoint_bytes(directory: str) -> int:
    """The size of the newest complete checkpoint of either kind: a ``step-*.pt`` file, or a sharded one's shards and
    manifest (app.checkpoint_dir); 0 when there is none."""
    found = find_checkpoints(directory)
    return checkpoint_bytes(found[0]) if found else 0


def store_address(args) -> tuple[str, int] | None:
    """The c10d rendezvous store's (host, port), or None where the agent hosts it itself (--standalone)."""
    if args.standalone or args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return None
    host, _, port = args.rdzv_endpoint.rpartition(":")
    if not host:
        return args.rdzv_endpoint, 29400  # torchrun's default port for c10d
    try:
        return host, int(port)
    except ValueError:
        raise LaunchError(f"--rdzv-endpoint={args.rdzv_endpoint!r}: give HOST:PORT", BAD_CONFIG) from None


def wait_for_store(host: str, port: int, timeout_s: float) -> None:
    """Poll until the store accepts a TCP connection (its name may not resolve yet either), or raise (exit 1)."""
    try:
        wait_for_tcp(host, port, timeout_s, poll_s=0.5)
    except TcpUnreachable as e:
        raise LaunchError(
            f"rendezvous store {host}:{port} unreachable for {timeout_s:g} s ({e.why}): is the store service "
            f"up (docker compose ps rendezvous)? LAUNCH_STORE_WAIT_SECONDS sets this wait",
            FAILED,
        ) from None


# -- the run ------------------------------------------------------------------------------------------------------
def _one_line(record: logging.LogRecord) -> bool:
    """torch's multi-line reports and tracebacks, cut to their first line (LOGLEVEL=DEBUG keeps them whole)."""
    text = record.getMessage()
    if text.startswith("failed (exitcode"):
        return False  # torch's own note of a worker's exit: Reporter.workers_failed says it with the rank
    first = first_line(text)
    record.msg, record.args = (first + " [LOGLEVEL=DEBUG: full report]" if first != text.strip() else first), None
    record.exc_info = record.exc_text = record.stack_info = None
    return True


def outcome_of_stop(reporter: Reporter, sig: str) -> int:
    codes = [c for c in reporter.exit_codes.values()]
    if all(c == 0 for c in codes):
        log.info("stopped on request (%s): %s; exit 0", sig, "the trainer checkpointed" if codes else "no trainer ran")
        return OK
    log.error("stopped on request (%s) but the trainer %s: exit 1", sig, describe_exit(next(c for c in codes if c)))
    return FAILED


def outcome_of_failure(failures, reporter: Reporter) -> int:
    codes = {f.exitcode for f in failures.values()}
    if codes == {BAD_CONFIG}:
        log.error("bad configuration (the trainer's line above names the setting): exit 2")
        return BAD_CONFIG
    if reporter.out_of_memory:
        why = reporter.out_of_memory  # the one line: rank, limit, peak, fixes (app.cluster.memory)
    elif codes == {STORAGE_FAILED}:
        why = "giving up: the trainer could not write a checkpoint (its line above names the directory and the "
        why += "cause); a restart would fail at the same save"
    else:
        why = "giving up: the trainer failed and the restart budget (--max-restarts) is spent"
    log.error("%s: exit 1", why)
    return FAILED


def explain(e: Exception, store: tuple[str, int] | None, run_id: str) -> str:
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    where = f"{store[0]}:{store[1]}" if store else "the rendezvous"
    if isinstance(e, RendezvousClosedError):
        return (
            f"job {run_id!r} has already ended (its rendezvous at {where} is closed): start a new run with "
            f"another RUN_ID, or restart the store"
        )
    if isinstance(e, RendezvousTimeoutError):
        return f"no world formed in time at {where} (join_timeout): fewer containers than --nnodes MIN came"
    if isinstance(e, RendezvousConnectionError) or "store" in str(e).lower() or "connect" in str(e).lower():
        return f"lost the rendezvous store {where} ({type(e).__name__}): did the store service stop?"
    return f"{type(e).__name__}: {first_line(str(e))}"


def job_state(argv: list[str], settings: LaunchConfig) -> JobState:
    """This container's records for the job named by ``--rdzv-id``, read before the seconds-long torch import.

    --standalone draws a new id per run: nothing to find then (and nothing is kept).
    """
    light = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    light.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default="none")
    light.add_argument("--standalone", action="store_true")
    known, _ = light.parse_known_args(argv)
    state_dir = "" if known.standalone else settings.state_dir
    return JobState.in_dir(state_dir, known.rdzv_id, socket.gethostname(), fingerprint(argv, os.environ))


def launch(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings = LaunchConfig.from_environ()  # first: a bad one names itself before anything is read or written
    except ConfigError as e:
        log.error("%s", e)
        return BAD_CONFIG
    job = job_state(argv, settings)
    if (code := ending_already_known(job)) is not None:
        return code  # a restart with nothing to do ends here, in a second: before torch is imported

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args

    args = parse_args(argv)  # torchrun's own parser (usage + exit 2 on errors)
    job.arrived()
    if env_file := describe_env_file(os.environ):  # never read silently: which file, and what it carried
        log.info("%s", env_file)
    try:
        high, workers, config, store = preflight(args, settings)
    except (LaunchError, TorchChanged) as e:
        log.error("%s", e)
        if e.code == BAD_CONFIG:
            job.refuse(str(e))
        return e.code
    # heal=in_place: a container that comes while the job's world trains joins it in place (app.cluster.newcomer);
    # in torchrun's rendezvous it would make every running agent restart its trainer.
    if store and (size := live_world_to_join(args, config)) is not None:
        code = join_live_world(args, config, settings, job, size, high)
        if code is not None:
            return code
    reporter = Reporter(store, args.rdzv_id, workers, config, settings)
    fresh_node_identity(reporter)
    complete_first_world_when_full(reporter)
    install_agent(reporter)
    if store:
        watch = threading.Thread(target=reporter.watch_redundancy, args=(high, job.refuse), name="redundancy")
        watch.daemon = True
        watch.start()
    try:
        run_rejoining(args, reporter, store)
    except SignalException as e:
        return outcome_of_stop(reporter, e.sigval.name)
    except SpareAtTheEnd:
        log.info("the job ended while this container waited as a spare (the world was full): exit 0")
        return OK
    except ChildFailedError as e:
        code = outcome_of_failure(e.failures, reporter)
        if code == BAD_CONFIG:
            job.refuse("the trainer refused its configuration (its line names the setting)")
        return code
    except Exception as e:  # noqa: BLE001 - one line names the cause; LOGLEVEL=DEBUG shows the traceback
        log.debug("the agent failed", exc_info=True)
        log.error("%s: exit 1", explain(e, store, args.rdzv_id))
        return FAILED
    job.finish(config.steps if config is not None else None)
    log.info("the workers finished: exit 0")
    return OK


def preflight(args, settings: LaunchConfig):
    """What must hold before any rendezvous: the torch, the world's range, WORKERS, the trainer's settings and its
    checkpoint directory, the store answering. Returns (MAX nodes, WORKERS or None, TrainConfig or None, store)."""
    check_torch()  # the version app.torch_patches was written for, before any patch below
    _, high = nnodes_range(args.nnodes)
    workers = expected_workers(high)
    config = check_trainer_config(args)
    if config is not None:
        check_checkpoint_dir(config.checkpoint_dir)
    store = store_address(args)
    if store:
        wait_for_store(*store, settings.store_wait_seconds)
    return high, workers, config, store


def run_rejoining(args, reporter: Reporter, store: tuple[str, int] | None) -> None:
    """torch's ``run`` (elastic_launch with the agent above), run again when the rendezvous store was lost or no
    world took this agent in within join_timeout.

    Docker restarts no worker (compose.yaml), so this is where a store crash heals: the agent's trainers stopped
    and checkpointed, the store comes back empty, and the agent joins the next world there. And where an agent
    whose join lost out (measured at load 50 on 2 cores: two of three joined, the third timed out while the world
    of two trained) tries again, as Docker's restart used to make it. At most ``--max-restarts`` times; a store that
    stays away for ``LAUNCH_STORE_LOST_SECONDS`` ends it (exit 1), as does the last join timeout.
    """
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.run import run

    fork_trainers(args, reporter.settings.fork)
    lost_s = reporter.settings.store_lost_seconds
    for attempt in range(args.max_restarts + 1):
        try:
            return run(args)
        except Exception as e:  # noqa: BLE001 - only a lost store is retried; the caller explains the rest
            retried = store_lost(e) or isinstance(e, RendezvousTimeoutError)  # a join that timed out: again
            if not store or attempt == args.max_restarts or not retried:
                raise
            log.warning(
                "%s; waiting up to %g s for the store, then joining again (%d of %d)",
                explain(e, store, args.rdzv_id),
                lost_s,
                attempt + 1,
                args.max_restarts,
            )
            wait_for_store(*store, lost_s)
            reporter.forget_store()
            fresh_node_identity(reporter)  # the new store must not take this agent for its last incarnation


def store_lost(e: Exception) -> bool:
    """Whether the agent failed because the rendezvous store went away (not closed, not timed out)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

    if isinstance(e, (RendezvousClosedError, RendezvousTimeoutError, SpareAtTheEnd)):
        return False
    return explain(e, ("", 0), "").startswith("lost the rendezvous store")


def ending_already_known(job: JobState) -> int | None:
    """The exit code when a new start of this container has nothing to do (refused before: 2; its job has finished:
    0); else None. Ends in one line, within a second: no torch import, no second world, no second FINISHED.
    """
    if reason := job.refused_before():
        log.error("refused before, with these same settings: %s; exit 2: fix it, then up again", reason)
        return BAD_CONFIG
    if finished := job.finished_since_arrival():
        log.info(
            "job finished (step %s) while this container was part of it: nothing left to do; exit 0",
            finished.get("step"),
        )
        return OK
    return None


def main(argv: list[str] | None = None) -> int:
    # torch's loggers carry a handler of their own (torch._logging's format): the agent's go through ours.
    setup_logging(f"launch {short(socket.gethostname())}", line_filter=_one_line, route=["torch.distributed.elastic"])
    return launch(argv)


if __name__ == "__main__":
    from app.worker.dist import exit_process

    exit_process(main())  # not sys.exit: torch's teardown can abort and replace the exit code said above
