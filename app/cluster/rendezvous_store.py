"""The rendezvous store of a cluster whose workers cannot know their rank: a TCPStore server, serving forever.

Replicas of one Compose service (``docker compose up --scale worker=4``) get no index and no stable hostname, so
none of them can be told "you are rank 0, host the store". torchrun's c10d rendezvous assigns the ranks instead,
but it needs a store to meet at that none of the workers owns; this process is that store::

    python -m app.cluster.rendezvous_store                     # serve on 0.0.0.0:29400 until SIGTERM/SIGINT
    python -m app.cluster.rendezvous_store --port 29401
    python -m app.cluster.rendezvous_store --check HOST:PORT   # health check: exit 0 when the store accepts connections

    python -m app.cluster.rendezvous_store --restart-after-job ddp-cluster   # exit 0 once job `ddp-cluster` has ended

and each worker runs ``torchrun --nnodes=N --rdzv-backend=c10d --rdzv-endpoint=<store host>:29400
--rdzv-id=<run> -m app.train``. When a job ends, torchrun closes its rendezvous id at the store for good: agents
that come later with the same id (the next ``docker compose up``) fail with RendezvousClosedError. With
``--restart-after-job RUN_ID`` the store exits once that happens, a few seconds after the last agent is done, and
its restart policy brings it back empty, so the next run meets at the same id. An empty store is the only safe
reset: the old job's per-round keys (its master address, its barriers) would mislead the next job.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

from app.cli import OneLineParser, setup_logging
from app.exit_codes import BAD_CONFIG, FAILED, OK
from app.net import tcp_problem

DEFAULT_PORT = 29400

log = logging.getLogger("rendezvous_store")


def check(address: str, timeout_s: float = 2.0) -> bool:
    """True when something accepts TCP connections at HOST:PORT (the health check; no torch import, so cheap)."""
    host, _, port = address.rpartition(":")
    try:
        return tcp_problem(host or "127.0.0.1", int(port), timeout_s) is None
    except ValueError:  # not a port number: nothing answers there
        return False


def serve(host: str, port: int, stop: threading.Event, restart_after_job: str | None = None) -> None:
    """Host a TCPStore at host:port until ``stop`` is set (or, with restart_after_job, that job has ended)."""
    import datetime

    import torch.distributed as dist  # here, not at the top: the health check must not pay for importing torch

    # wait_for_workers=False: there is no fixed number of clients; agents come and go with the replicas.
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    log.info("rendezvous store listening on %s:%d", host, store.port)
    if restart_after_job:
        threading.Thread(target=watch_job, args=(store, restart_after_job, stop), name="watch-job", daemon=True).start()
    while not stop.wait(1.0):  # a timeout keeps the main thread responsive to signals
        pass
    log.info("rendezvous store stopping")


def watch_job(
    store, run_id: str, stop: threading.Event, poll_s: float = 1.0, grace_s: float = 5.0, alone_s: float = 45.0
) -> None:
    """Set ``stop`` once the rendezvous ``run_id`` is closed, i.e. its job has ended.

    Says so once if no worker has come to the rendezvous within ``alone_s`` (``--scale worker=0``, or workers that
    cannot reach the store): otherwise an empty cluster would wait without a word.
    """
    from app.cluster.elastic import state_reader  # torch's private rendezvous state: read in one place

    read_state = state_reader(store, run_id)
    started, warned = time.monotonic(), False
    while not stop.wait(poll_s):
        try:
            # If torch ever moves the state's `closed` flag, stop watching rather than guess.
            state = read_state()
            closed = state is not None and bool(state.closed)
            seen = state is not None and bool(state.participants or state.wait_list or state.redundancy_list)
        except Exception as exc:  # noqa: BLE001 - any failure here must leave the store serving
            log.warning("cannot read rendezvous %r (%s): no restart after the job", run_id, exc)
            return
        if not seen and not warned and time.monotonic() - started > alone_s:
            warned = True
            log.warning(
                "no worker has joined rendezvous %r in %g s: start some (docker compose up -d --scale worker=N, "
                "1 <= N <= MAX_WORKERS), or check that they reach this store",
                run_id,
                alone_s,
            )
        if seen:
            warned = True  # the job has started: an empty round later is a re-formation, not an empty cluster
        if closed:
            # The agents close the rendezvous while shutting down: give the last of them time to finish.
            log.info(
                "job %r ended (rendezvous closed): exiting in %g s so the next run finds an empty store",
                run_id,
                grace_s,
            )
            stop.wait(grace_s)
            stop.set()
            return


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m app.cluster.rendezvous_store", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    parser.add_argument(
        "--check",
        metavar="HOST:PORT",
        nargs="?",
        const=f"127.0.0.1:{DEFAULT_PORT}",
        help="only check that a store answers there (exit 0) or not (exit 1)",
    )
    parser.add_argument(
        "--restart-after-job",
        metavar="RUN_ID",
        help="exit 0 once the job with this --rdzv-id has ended (a restart policy brings the store "
        "back empty for the next run)",
    )
    args = parser.parse_args(argv)
    if args.check:
        return OK if check(args.check) else FAILED
    if not 0 < args.port < 65536:
        print(f"error: --port {args.port} is not a TCP port; give 1-65535", file=sys.stderr)
        return BAD_CONFIG

    setup_logging("rendezvous_store")
    stop = threading.Event()
    # As PID 1 of a container, a process that installs no handler ignores SIGTERM: `docker stop` would wait
    # its full grace period and then kill. Stop at once instead.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve(args.host, args.port, stop, args.restart_after_job)
    except RuntimeError as exc:  # port taken, address not ours: one line, not a traceback
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return FAILED
    return OK


if __name__ == "__main__":
    sys.exit(main())
