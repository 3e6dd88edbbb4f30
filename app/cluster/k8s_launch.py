"""What a pod of the Kubernetes Job runs: torchrun, with what a pod of an Indexed Job needs around it.

    # the arguments are torchrun's own (k8s/base/job.yaml); pod 1 of 2, pod 0 hosts the store
    python -m app.cluster.k8s_launch --rdzv-backend=static --nnodes=2 --nproc-per-node=gpu --node-rank=1 \\
        --master-addr=ddp-train-0.ddp-train --master-port=29500 --rdzv-conf=timeout=900 --max-restarts=0 \\
        -m app.train

Around torchrun, three things the Job needs and torchrun does not do:

- **A store of this attempt only.** The Job replaces a failed pod as soon as that pod has ended, not when its
  peers have: a new pod 1 can meet the previous attempt's pod 0 while it is still ending, and torchrun's static
  rendezvous has no per-attempt key, so the new pod would read the old world's keys (ranks, NCCL bootstrap data).
  Before torchrun joins, pod i > 0 counts itself in at the store (``k8s_launch/joined/<i>``): a count above one
  means this store has already had a node ``i`` in its world, so it is a previous attempt's; the pod waits for a
  new pod 0 (a new store) instead. Pod 0 hosts the store, always a new one.
- **Threads.** The downward API gives the pod's whole CPU limit (``CPU_LIMIT``); each of the pod's processes (one
  per GPU) gets ``OMP_NUM_THREADS = CPU_LIMIT // processes``, at least 1. An ``OMP_NUM_THREADS`` already set wins.
- **Exit codes that podFailurePolicy can read.** torchrun ends with 1 for any failed worker. This ends with:

  ====  ============================================================================================
  0     every rank finished
  2     a bad configuration (a worker exited 2) or bad torchrun arguments: no retry can help
  3     a rank was killed for memory (over the pod's limit, the kernel's own count): one line says the limit and the
        fix, and no retry can help either
  75    the failure was a peer's: every failed local rank exited 75 (app.train: a peer was asked to
        stop, so this pod's ranks stopped with it, checkpointed). The Job ignores it.
  143   this pod was asked to stop (SIGTERM: deleted, evicted, preempted); its ranks checkpointed.
        The Job ignores it. Never 0: an index that ends 0 counts as done and is not run again.
  1     anything else: this pod's own failure, which the Job counts
  ====  ============================================================================================
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys
import time

from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import determine_local_world_size, parse_args, run

from app.cli import first_line, setup_logging
from app.cluster.forked_trainer import fork_trainers
from app.cluster.memory import OomWatch, oom_line
from app.exit_codes import BAD_CONFIG, FAILED, OK, OUT_OF_MEMORY, PEER_STOPPED, STOPPED_BY_SIGNAL
from app.torch_patches import TorchChanged
from app.worker.config import ConfigError
from app.worker.config.launch import LaunchConfig

log = logging.getLogger("app.cluster.k8s_launch")

EXIT_PEER = PEER_STOPPED  # not this pod's fault, try again (the names k8s/ and the tests know)
EXIT_STOPPED = STOPPED_BY_SIGNAL
_TERMINATED_BY_TORCHRUN = -15  # torchrun ends a pod's other ranks with SIGTERM once one has failed
JOINED_KEY = "k8s_launch/joined/{node_rank}"


def wait_for_fresh_store(host: str, port: int, node_rank: int, timeout_s: float, poll_s: float = 1.0) -> int:
    """Returns once the TCPStore at ``host:port`` has never had node ``node_rank`` join it.

    Each call counts node ``node_rank`` in at the store it reaches; a count above one is a store whose world
    already had this node, so a previous attempt's. Node 0 hosts the store and returns at once.

    Args:
        host, port: the store torchrun will join (``--master-addr``, ``--master-port``).
        node_rank: this pod's node rank (the Job's completion index).
        timeout_s: give up after this long (torchrun's rendezvous timeout): ``TimeoutError``.
        poll_s: pause between tries while the store is unreachable or stale.

    Returns the number of stale stores seen (0 when the first store reached was fresh).

    Example::

        wait_for_fresh_store("ddp-train-0.ddp-train", 29500, node_rank=1, timeout_s=900)
    """
    if node_rank == 0:
        return 0
    deadline = time.monotonic() + timeout_s
    stale, last_error = 0, "never reached"
    while time.monotonic() < deadline:
        try:
            # A plain client: no world_size, so the server's count of torchrun's own clients is left alone.
            store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=5))
            joins = store.add(JOINED_KEY.format(node_rank=node_rank), 1)
        except RuntimeError as e:  # not up yet, or its name not yet in DNS: the store of pod 0 is still coming
            last_error = first_line(e)
        else:
            if joins == 1:
                if stale:
                    log.warning("node %d: a new store at %s:%d; joining it", node_rank, host, port)
                return stale
            if stale == 0:
                log.warning(
                    "node %d: the store at %s:%d already had a node %d (joined %d times): it is a previous "
                    "attempt's, still ending; waiting for a new pod 0",
                    node_rank,
                    host,
                    port,
                    node_rank,
                    joins - 1,
                )
            stale += 1
        time.sleep(poll_s)
    raise TimeoutError(f"no new rendezvous store at {host}:{port} within {timeout_s:g} s (last: {last_error})")


def set_omp_threads(nproc_per_node: str, env: dict[str, str] = os.environ) -> None:
    """``OMP_NUM_THREADS = CPU_LIMIT // processes per pod`` (at least 1), unless already set or no ``CPU_LIMIT``.

    Example::

        set_omp_threads("8", {"CPU_LIMIT": "64"})  # OMP_NUM_THREADS=8
    """
    if "OMP_NUM_THREADS" in env or not env.get("CPU_LIMIT"):
        return
    processes = determine_local_world_size(nproc_per_node)
    env["OMP_NUM_THREADS"] = str(max(1, int(env["CPU_LIMIT"]) // processes))


def pod_exit_code(failed_ranks: dict[int, int]) -> int:
    """The pod's exit code from the exit codes of its failed ranks (``{}``: every rank finished).

    Example::

        pod_exit_code({3: 75, 2: -15})  # 75: a peer's failure, and torchrun stopped the other rank
    """
    codes = set(failed_ranks.values())
    if not codes:
        return OK
    if BAD_CONFIG in codes:
        return BAD_CONFIG
    if EXIT_PEER in codes and codes <= {EXIT_PEER, _TERMINATED_BY_TORCHRUN}:
        return EXIT_PEER
    return FAILED


def _rendezvous_timeout(rdzv_conf: str) -> float:
    conf = dict(kv.split("=", 1) for kv in rdzv_conf.split(",") if "=" in kv)
    return float(conf.get("timeout", 600))


def main(argv: list[str] | None = None) -> int:
    setup_logging("k8s_launch")
    args = parse_args(argv)  # torchrun's own parser: bad arguments exit 2 here
    if args.rdzv_backend == "static":
        try:
            wait_for_fresh_store(
                args.master_addr, args.master_port, args.node_rank, _rendezvous_timeout(args.rdzv_conf)
            )
        except TimeoutError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return FAILED
    set_omp_threads(args.nproc_per_node)
    try:
        settings = LaunchConfig.from_environ()  # LAUNCH_FORK, and any LAUNCH_* typo named in one line
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return BAD_CONFIG
    try:
        fork_trainers(args, settings.fork)
    except TorchChanged as e:  # a torch its fork patch was not written for (app.torch_patches)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.code
    memory = OomWatch()
    try:
        run(args)
    except SignalException as e:
        log.warning("%s: the ranks were asked to stop; exit %d", e.sigval.name, EXIT_STOPPED)
        return EXIT_STOPPED
    except ChildFailedError as e:
        return failure_exit({rank: failure.exitcode for rank, failure in e.failures.items()}, memory)
    return OK


def failure_exit(failed: dict[int, int], memory: OomWatch) -> int:
    """The pod's exit code once ranks failed (rank: exit code), said in one line: a rank killed by SIGKILL while the
    container's cgroup counted a kill for memory is ``OUT_OF_MEMORY`` (the limit, the peak, what to change)."""
    code = pod_exit_code(failed)
    killed = [rank for rank, c in sorted(failed.items()) if c == -signal.SIGKILL]
    if killed and (state := memory.kills()):
        # Over the pod's resources.limits.memory: its container is not OOMKilled (the kernel took the trainer,
        # not this process), so say it here, as the compose launcher does (app/cluster/memory.py).
        log.error("%s: exit %d", oom_line(killed[0], socket.gethostname(), state), OUT_OF_MEMORY)
        return OUT_OF_MEMORY
    log.warning("ranks failed with exit codes %s; exit %d", failed, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
