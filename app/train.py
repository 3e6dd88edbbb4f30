"""The training worker: what every container runs, launched by torchrun.

    # one machine, 4 CPU ranks (what `make run` does); Ctrl-C checkpoints and stops, running it again resumes
    torchrun --standalone --nproc-per-node=4 -m app.train --steps 300 --checkpoint-dir /tmp/ckpt
    # settings from a file, overridden by the environment, overridden by flags
    DDP_LR=0.01 torchrun --standalone --nproc-per-node=2 -m app.train --config configs/example.yaml --steps 50
    # two machines (run on each; node 0's address as the rendezvous endpoint)
    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=node0:29400 --rdzv-id=job1 -m app.train
    # one process, no torchrun
    python -m app.train --wrapper none --steps 50

The flow is ``main`` (config, signals, metrics endpoint, process group as a pair) → ``build_step``
(app.worker.steps: the step kind ``parallel`` names: ddp, dp, pipeline, zero1-3) → ``Trainer.run``
(app.worker.trainer: resume, loop) → the kind's ``train_step`` (for ddp, ``accumulation_step`` in
app.parallel.accum). Per rank: the process group from torchrun's variables (app.worker.dist), the same seeded
parameters everywhere, its share of each global batch (app.worker.data), one ``/metrics`` endpoint
(app.worker.metrics), and checkpoints written by rank 0 (app.worker.checkpoint.checkpointer).

Stopping: SIGTERM (``docker stop``, Kubernetes) or SIGINT finishes the current step; the ranks agree on the step to
stop at (one tiny all-reduce per step, which also carries the NaN check), rank 0 checkpoints, and the signalled ranks
exit 0. Ranks that were not signalled themselves (a peer was scaled away) exit 75, so an elastic torchrun re-forms
the group without it.
A NaN/inf loss stops every rank with exit code 1 and no new checkpoint: the last good one stays the newest.

Exit codes (app.exit_codes): 0 OK (success, or a handled SIGTERM), 2 BAD_CONFIG, 75 PEER_STOPPED (stopped because
a peer was), 74 STORAGE_FAILED (a checkpoint could not be written: no retry), 1 FAILED (anything else).
At the end every rank prints ``FINISHED rank=<r> world_size=<n> step=<s> checksum=<16 hex>``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import time

from app.cli import setup_logging
from app.exit_codes import BAD_CONFIG, FAILED, OK, STORAGE_FAILED
from app.torch_patches import TorchChanged
from app.worker.allocator import return_freed_memory_to_the_os, trim  # torch-free, like the two below
from app.worker.config import ConfigError, TrainConfig, WorldEnv, describe, load_config
from app.worker.control import StopSignal  # torch-free: installed before the seconds-long torch import
from app.worker.startup import StartupClock, defer_dynamo_import  # torch-free: it times the torch import

log = logging.getLogger("app.train")


def main(argv: list[str] | None = None) -> int:
    """Config, signals, metrics endpoint, process group (set up and torn down as a pair), the loop; the exit code."""
    clock = StartupClock()  # rank 0 logs where the start-up went, before the first step (bench/startup.py reads it)
    # Before any tensor: freed pages go back to the OS, a rank's peak is what it holds (app.worker.allocator).
    return_freed_memory_to_the_os()
    stop = StopSignal()
    stop.install()
    # torchrun's variables, read once: the config checks, the metrics and the process group all use this.
    world = WorldEnv.from_environ()
    # INFO from rank 0 only (N copies of every line help nobody); warnings from every rank, marked with its rank.
    setup_logging(f"rank {world.rank}", quiet=world.rank != 0)
    try:
        resolved, grad_accum_steps = checked_config(argv, world, clock)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return BAD_CONFIG
    cfg = resolved.config
    stop.timeout_s = cfg.stop_timeout_seconds

    # torch and everything built on it, only now: a bad flag above fails before this seconds-long import.
    from app.worker.dist import RendezvousError

    clock.mark("trainer imports")
    try:
        healer = connect_healer(cfg)  # heal=in_place; a newcomer to a live world joins it instead of torchrun's
        joined = healer.join_world(world) if healer and healer.joining else None
    except (RendezvousError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return FAILED
    if joined is not None:  # its series carry the rank it was given, not the 0 of a process no launcher numbered
        world = dataclasses.replace(world, rank=joined.rank, world_size=joined.world_size)
    metrics = start_metrics(cfg, world, stop)  # a newcomer that fails here leaves the world it joined: a lost peer
    if metrics is None:
        return BAD_CONFIG
    clock.mark("metrics endpoint")
    try:
        ctx = joined or join_world(cfg, world)
    except (RendezvousError, RuntimeError) as e:
        metrics.shutdown()
        print(f"error: {e}", file=sys.stderr, flush=True)
        return FAILED
    clock.mark("process group")
    return train_to_the_end(cfg, resolved.sources, ctx, world, grad_accum_steps, stop, metrics, clock, healer)


def train_to_the_end(cfg, sources, ctx, world, grad_accum_steps, stop, metrics, clock, healer) -> int:
    """The loop in its process group, and how it ended as an exit code; the group and the endpoint torn down."""
    from app.worker.checkpoint.checkpointer import CheckpointMismatch, CheckpointWriteError
    from app.worker.dist import cleanup_distributed, lost_peer
    from app.worker.trainer import TrainingDiverged

    # torch.optim's seconds-long import of torch._dynamo skipped (TRAINER_DEFER_DYNAMO=0: imported as torch does).
    # After the process group: init_process_group touches torch._dynamo whenever a module of that name is there.
    try:
        defer_dynamo_import(compiling=cfg.compile != "none")  # compile: the real one, imported below
        return train(cfg, sources, ctx, world, grad_accum_steps, stop, metrics, clock, healer)
    except (ConfigError, CheckpointMismatch, TorchChanged) as e:  # TorchChanged: a torch the stand-in does not know
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return BAD_CONFIG
    except TrainingDiverged as e:
        log.error("%s", e)
        return FAILED
    except CheckpointWriteError as e:  # every rank together, one line each: no traceback, no "a peer went away"
        log.error("%s", e)
        return STORAGE_FAILED  # not FAILED: the launcher must not retry what only fails again at the next save
    except RuntimeError as e:
        cause = lost_peer(e)
        if cause is None:
            raise
        # The launcher re-forms the world (or reports the end): one line here, the traceback for LOGLEVEL=DEBUG.
        log.error("rank %d left the world: %s during a collective; exit %d", ctx.rank, cause, FAILED)
        log.debug("the failed collective", exc_info=True)
        return FAILED
    finally:
        metrics.shutdown()
        cleanup_distributed()


def checked_config(argv: list[str] | None, world: WorldEnv, clock: StartupClock):
    """The resolved config and the accumulation steps, checked against the world and tried on the workload: a
    ``ConfigError`` (one line, exit 2) before any rank waits in the rendezvous."""
    resolved = load_config(argv)
    cfg = resolved.config
    clock.mark("config")
    grad_accum_steps = cfg.check_world(world.world_size, world.local_world_size)  # imports torch
    # The model, data and loss specs imported and tried on two samples, before the process group forms: a bad
    # spec exits 2 on every rank alike, and none waits in the rendezvous for one that failed.
    from app.worker.workload import check_workload

    clock.mark("torch import")
    check_workload(cfg, world.world_size, grad_accum_steps)
    clock.mark("workload check")
    for warning in resolved.warnings:
        log.warning(warning)
    log.info(describe(resolved))
    return resolved, grad_accum_steps


def join_world(cfg: TrainConfig, world: WorldEnv):
    """The process group, formed within ``rendezvous_timeout_seconds`` (``RendezvousError`` past it)."""
    from app.worker.dist import init_distributed

    log.info(
        "joining a world of %d at %s:%s (rendezvous_timeout_seconds=%g)",
        world.world_size,
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        os.environ.get("MASTER_PORT", "a free port"),
        cfg.rendezvous_timeout_seconds,
    )
    return init_distributed(
        cfg.rendezvous_timeout_seconds,
        force_cpu=cfg.device == "cpu",
        require_cuda=cfg.device == "cuda",
        world=world,
        collective_timeout_s=cfg.collective_timeout_seconds,
    )


def connect_healer(cfg: TrainConfig):
    """heal=in_place: this rank's ``Healer`` at ``heal_store`` (a newcomer when it finds a live world there); None
    for heal=restart."""
    if cfg.heal != "in_place":
        return None
    from app.worker.heal import Healer

    return Healer.connect(cfg, job=os.environ.get("TORCHELASTIC_RUN_ID", "job"))


def start_metrics(cfg: TrainConfig, world: WorldEnv, stop: StopSignal):
    """This process's /metrics endpoint (``NoMetrics`` when metrics_port is 0), told of a stop request at once; None,
    after one line, when its port cannot be opened. Served before the rendezvous: a rank stuck there is already
    visible (ddp_rank_info)."""
    from app.worker.metrics import NoMetrics, TrainMetrics

    if not cfg.metrics_port:
        return NoMetrics()
    port = cfg.metrics_port + world.local_rank
    metrics = TrainMetrics(world.rank, world.local_rank, world.world_size, world.node)
    try:
        metrics.serve(port)
    except OSError as e:
        print(
            f"config error: metrics_port={cfg.metrics_port}: port {port} (metrics_port + local rank "
            f"{world.local_rank}) cannot be opened ({e.strerror}); choose another metrics_port, or 0 for no metrics",
            file=sys.stderr,
            flush=True,
        )
        return None
    # At once, not at the step boundary: the scrapes during the graceful stop and the linger all see it.
    stop.on_request.append(metrics.observe_stop_requested)
    return metrics


def train(
    cfg: TrainConfig,
    sources: dict[str, str],
    ctx,
    world: WorldEnv,
    grad_accum_steps: int,
    stop,
    metrics,
    clock,
    healer=None,
) -> int:
    """Inside the process group: the start-up checks every rank must agree on, then the loop, then the linger."""
    from app.worker.checkpoint.files import checkpoint_dir_problem
    from app.worker.steps import build_step
    from app.worker.trainer import Trainer

    if stop.requested:
        log.warning("%s before training started: exit %d", stop.name, FAILED)
        return FAILED
    # Collectives of the first world only (a newcomer to a live world, heal=in_place, joins its peers mid-run).
    first = not (healer and healer.joining)
    problem = cfg.checkpoint_dir and first and checkpoint_dir_problem(cfg.checkpoint_dir, ctx.is_main)
    if problem:  # found before training, on every rank: none is left waiting for a rank 0 that cannot save
        raise ConfigError(
            f"checkpoint_dir={cfg.checkpoint_dir!r} (set by {sources['checkpoint_dir']}): "
            f'{problem} on rank 0; choose a writable directory, or "" for no checkpoints'
        )
    if first:
        announce_endpoints(ctx, cfg, world.node)
    clock.mark("endpoints")
    # torch.optim imports torch._dynamo at its first optimizer (seconds): here, so the breakdown shows it apart
    # (nothing to import when defer_dynamo_import put its stand-in there).
    import torch._dynamo  # noqa: F401

    clock.mark("torch._dynamo import")
    # The one place the kinds differ (ddp | pipeline | dp): the step object the one Trainer is handed.
    step = build_step(cfg, ctx, grad_accum_steps, metrics)
    trim()  # the whole model a sharded kind built and cut into shards: its freed pages back before training
    clock.mark("model build")  # the second build of the model (the first was check_workload's) and its wrapper
    trainer = Trainer(cfg, ctx, world, stop, metrics, step=step, healer=healer)  # finds and loads the newest checkpoint
    clock.mark("checkpoint probe")
    log.info("%s", clock.line())
    code = trainer.run()
    leave_together()
    if code == OK and cfg.metrics_port and cfg.metrics_linger_seconds:
        linger(cfg.metrics_linger_seconds, stop)
    return code


def leave_together() -> None:
    """Every rank past its last collective before any tears its connections down (as app.worker.dist.distributed()
    does for the demo): the final save ends in a broadcast from rank 0, which returns before its receivers have read
    it, and a rank whose peer closes a connection it still reads from can abort at exit ("terminate called without
    an active exception"). Every rank gets here (finished, or stopped at one agreed step); a peer that is gone by
    now costs nothing more than its absence."""
    import torch.distributed as dist

    try:
        dist.barrier()
    except RuntimeError:
        log.debug("a peer left before the final barrier", exc_info=True)


# Two of the compose Prometheus' scrapes (5 s apart): a planned departure is seen without slowing every stop much.
PLANNED_LINGER_SECONDS = 10.0


def linger(seconds: float, stop) -> None:
    """Keep /metrics up after training, so Prometheus scrapes the final values: the finish, or a stop on request.

    After a finish a SIGTERM cuts the wait short. After a stop on request (the rank's ``ddp_stop_requested`` says its
    departure is planned) it waits less than what is left of ``stop_timeout_seconds``, which would force exit 1.
    """
    if not stop.requested:
        log.info("keeping /metrics up for %g s (metrics_linger_seconds)", seconds)
        stop.event.wait(seconds)
        return
    seconds = min(seconds, PLANNED_LINGER_SECONDS, stop.seconds_left() - 2.0)
    if seconds > 0:
        log.info("keeping /metrics up for %.1f s: a planned departure, for Prometheus to see", seconds)
        time.sleep(seconds)


def announce_endpoints(ctx, cfg: TrainConfig, node: str) -> None:
    """Rank 0 says where every rank's /metrics is (each rank knows only its own host and port)."""
    import torch.distributed as dist

    me = (ctx.rank, node, socket.gethostname(), cfg.metrics_port + ctx.local_rank if cfg.metrics_port else 0)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, me)
    log.info("world of %d on %s, backend %s", ctx.world_size, ctx.device, ctx.backend)
    if not cfg.metrics_port:
        log.info("metrics off (metrics_port=0)")
        return
    for rank, rank_node, host, port in everyone:
        log.info("metrics of rank %d (node %s): http://%s:%d/metrics", rank, rank_node, host, port)


if __name__ == "__main__":
    from app.worker.dist import exit_process

    exit_process(main())  # not sys.exit: the interpreter's teardown takes seconds and can abort (see there)
