"""A container that comes to a live ``heal=in_place`` world joins it as a newcomer, not through torchrun's rendezvous.

Under compose, a container that starts while the job trains (``docker compose up -d --scale worker=3
--no-recreate``, a killed container brought back with ``up -d``) would enter torchrun's rendezvous; every running
agent would see it waiting and stop its trainer, and the world would start again from the checkpoint. With
``heal=in_place`` the launcher (app.cluster.launch) asks ``heal_store`` first (``app.worker.heal.live_world``: a
world of this job that has not finished, a member's heartbeat moving): if one trains, this container's trainer is
started with no ``WORLD_SIZE``, finds that world and asks in (``app.worker.heal.Healer.connect``), and is given the
parameters, optimizer state, schedule and data position by a live peer over the process group. No agent sees a
waiting node, so no survivor's trainer restarts.

Its launcher keeps the guarantees of torchrun's path: the trainer's exit code is the container's (0 finished,
2 bad configuration: recorded, 1 failed); SIGTERM/SIGINT reach the trainer; a finished trainer's launcher waits at
the exit barrier of the healed world (``app.worker.heal.exit_barrier``, which the survivors' agents use too) and
records the job as finished. If the world finishes while the newcomer waits to be taken in, the launcher ends 0 in
one line; if the world is gone (every rank's heartbeat still), it returns to torchrun's path, which starts the next
world from the checkpoint. One trainer per container (``--nproc-per-node=1``, as compose and k8s/ run it); more
go through torchrun's rendezvous.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys

from app.cluster.forked_trainer import TRAINER, forkable_torch, run_trainer
from app.cluster.job_state import JobState
from app.exit_codes import BAD_CONFIG, FAILED, OK
from app.worker.config.launch import LaunchConfig

log = logging.getLogger("app.cluster.launch")

# torch's own exit barrier timeout (LocalElasticAgent's exit_barrier_timeout): the survivors' agents wait as long.
EXIT_BARRIER_SECONDS = 300.0


def live_world_to_join(args, config) -> int | None:
    """The size of the live ``heal=in_place`` world this container should join as a newcomer; None: torchrun's path
    (heal=restart, another script, several trainers per container, no live world, or a store that does not say)."""
    if config is None or config.heal != "in_place" or str(args.nproc_per_node) != "1":
        return None
    from app.worker.heal import live_world

    try:
        return live_world(config.heal_store, args.rdzv_id)
    except Exception:  # noqa: BLE001 - a store that does not answer: torchrun's path reports it
        log.debug("cannot read heal_store=%s", config.heal_store, exc_info=True)
        return None


def join_live_world(args, config, settings: LaunchConfig, job: JobState, size: int, high: int) -> int | None:
    """Run this container's trainer as a newcomer to the live world of ``size`` ranks; the container's exit code,
    or None when that world turned out to be gone (the caller goes on with torchrun's rendezvous). A world already
    at ``high`` containers (``--nnodes``' MAX) takes none: refused as torchrun's spare is, exit 2."""
    if size >= high:
        reason = f"one container more than the world's maximum of {high} workers (MAX_WORKERS)"
        log.error(
            "the live world of job %r holds %d ranks, its maximum (MAX_WORKERS): this container would wait idle; "
            "scale to at most %d (docker compose up -d --scale worker=%d --no-recreate)",
            args.rdzv_id,
            size,
            high,
            high,
        )
        job.refuse(reason)
        return BAD_CONFIG
    log.info(
        "job %r trains in place (heal=in_place): joining its live world of %d at heal_store=%s as a newcomer, "
        "given the state by a live peer (not through torchrun's rendezvous: no survivor restarts)",
        args.rdzv_id,
        size,
        config.heal_store,
    )
    trainer = start_trainer(args, settings.fork)
    code, stopped = wait_forwarding_signals(trainer)
    if code == OK:
        if stopped:
            log.info("stopped on request (%s): the trainer exited 0; exit 0", stopped)
            return OK
        return finished(args, config, job)
    return failed(args, config, job, code)


def finished(args, config, job: JobState) -> int:
    from app.cluster.elastic import heal_exit_barrier

    # The survivors' agents use the same barrier; a newcomer has no torch barrier to fall back on.
    if not heal_exit_barrier(config, args.rdzv_id, 1, EXIT_BARRIER_SECONDS):
        log.warning("exit barrier at heal_store=%s: no world there to wait for", config.heal_store)
    job.finish(config.steps)
    log.info("the workers finished: exit 0")
    return OK


def failed(args, config, job: JobState, code: int) -> int | None:
    from app.cluster.elastic import describe_exit
    from app.worker.heal import job_finished, live_world

    if code == BAD_CONFIG:
        job.refuse("the trainer refused its configuration (its line names the setting)")
        log.error("bad configuration (the trainer's line above names the setting): exit 2")
        return BAD_CONFIG
    try:
        if job_finished(config.heal_store, args.rdzv_id):
            log.info("the job finished while this container waited to join its world: nothing left to do; exit 0")
            job.finish(config.steps)
            return OK
        if live_world(config.heal_store, args.rdzv_id) is None:
            log.warning("the world this container asked to join is gone: joining torchrun's rendezvous instead")
            return None
    except Exception:  # noqa: BLE001 - the store is gone too: the trainer's failure is the ending
        log.debug("cannot read heal_store=%s", config.heal_store, exc_info=True)
    log.error("the newcomer's trainer (this container) %s: exit 1", describe_exit(code))
    return FAILED


def start_trainer(args, fork: bool) -> int:
    """The trainer's pid: forked from this launcher (torch imported once per container, as app.cluster.forked_trainer
    does for torchrun's path) where it can be, else a new interpreter. No WORLD_SIZE: it is a newcomer."""
    env = {"TORCHELASTIC_RUN_ID": args.rdzv_id, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "PET_NNODES": args.nnodes}
    argv = list(args.training_script_args)
    if not (fork and forkable_torch()):
        command = [sys.executable, "-u", "-m", TRAINER, *argv]
        return subprocess.Popen(command, env={**os.environ, **env}).pid
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = FAILED
    try:
        os.environ.update(env)
        run_trainer(TRAINER, *argv)  # returns for exit code 0; any other ends this process with it
        code = OK
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else FAILED
    except BaseException:  # noqa: BLE001 - the traceback, then the exit code the launcher reads
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait_forwarding_signals(pid: int) -> tuple[int, str | None]:
    """The trainer's exit code (negative: the signal that killed it) and the stop signal this launcher forwarded to
    it, if any (``docker stop``, Ctrl-C: the trainer checkpoints and exits; the launcher waits for it)."""
    stopped: list[str] = []

    def forward(signum, _frame) -> None:
        stopped.append(signal.Signals(signum).name)
        with contextlib.suppress(ProcessLookupError):  # it has just ended: its exit code says how
            os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _, status = os.waitpid(pid, 0)  # retried across the handler's interruptions (PEP 475)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return os.waitstatus_to_exitcode(status), (stopped[0] if stopped else None)
