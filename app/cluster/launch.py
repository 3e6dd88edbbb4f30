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
- **Checks before the agent starts**, each one line within a bounded time: the trainer's settings (app.worker.config),
  ``WORKERS`` against the ``--nnodes`` range, the rendezvous store answering (``LAUNCH_STORE_WAIT_SECONDS``).
- **One line per event** instead of torch's multi-line reports and tracebacks: this container joining a world
  (its rank, the members, which containers left or came since the last world), its trainer failing (rank, exit
  code or signal), leaving a world and why, the reason the launcher gives up.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time

OK, FAILED, BAD_CONFIG = 0, 1, 2
STORE_WAIT_SECONDS = float(os.environ.get("LAUNCH_STORE_WAIT_SECONDS", "30"))
# The DNS name of every replica (compose: the service's name): the job's first world waits for all of them.
PEERS = os.environ.get("LAUNCH_PEERS", "")
PEERS_WAIT_SECONDS = float(os.environ.get("LAUNCH_PEERS_WAIT_SECONDS", "90"))
# A container can sit in the full world's redundancy list for a moment while a lost member's keep-alive expires;
# longer than this, it is one container too many.
REDUNDANT_GRACE_SECONDS = float(os.environ.get("LAUNCH_REDUNDANT_GRACE_SECONDS", "20"))

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


def check_trainer_config(args) -> None:
    """The trainer's settings, checked once here rather than failing (and being restarted) in every attempt."""
    if not (args.module and args.training_script == "app.train"):
        return
    from app.worker.config import ConfigError, load_config

    try:
        load_config(list(args.training_script_args))
    except ConfigError as e:
        raise LaunchError(f"config error: {e}", BAD_CONFIG) from None


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
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as e:
            why = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise LaunchError(
                f"rendezvous store {host}:{port} unreachable for {timeout_s:g} s ({why}): is the store service "
                f"up (docker compose ps rendezvous)? LAUNCH_STORE_WAIT_SECONDS sets this wait",
                FAILED,
            )
        time.sleep(0.5)


# -- what happened, one line each ---------------------------------------------------------------------------------
def short(addr: str) -> str:
    """A node's address as `docker ps` shows the container: its hostname, the 12-hex container id."""
    return addr.split(".", 1)[0][:12]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    meaning = {0: "finished", 1: "failed", 2: "bad configuration"}.get(code, "failed")
    return f"exited {code} ({meaning})"


class Reporter:
    """Reads the rendezvous state at the store (torch's own c10d backend) to say who is in each world."""

    def __init__(self, store: tuple[str, int] | None, run_id: str, workers: int | None):
        self.store, self.run_id, self.workers = store, run_id, workers
        self.me = socket.getfqdn()
        self.backend = None
        self._client = None
        self.members: dict[str, int] = {}  # container -> rank in the last world this container joined
        self.world = 0  # worlds this container has joined
        self.exit_codes: dict[int, int | None] = {}  # local rank -> trainer exit code, after a shutdown
        self.leave_reason = "new containers are waiting to join"
        self.succeeded = False
        self.local_id = 0  # this agent's rendezvous node id (fresh_node_identity)
        self.first_of_job = False  # this agent came before the job's first world (not to a running job)

    def state(self):
        """torch's private ``_RendezvousState`` (participants, wait and redundancy lists), or None."""
        if self.store is None:
            return None
        try:
            if self.backend is None:
                from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

                self.backend = C10dRendezvousBackend(self.client(), self.run_id)
            found = self.backend.get_state()
            return pickle.loads(found[0]) if found else None
        except Exception:  # noqa: BLE001 - the report is a courtesy: never let it break the agent
            log.debug("cannot read the rendezvous state", exc_info=True)
            return None

    def client(self):
        """A TCPStore client of the rendezvous store, opened once."""
        if self._client is None:
            import datetime

            import torch.distributed as dist

            self._client = dist.TCPStore(*self.store, is_master=False, timeout=datetime.timedelta(seconds=10))
        return self._client

    def job_started(self) -> bool:
        state = self.state()
        return state is not None and bool(state.participants or state.complete or state.round > 0)

    def wait_for_peers(self, peers: str, timeout_s: float) -> None:
        """Before a job's first world: wait until the launcher of every running replica is ready to join.

        torch's c10d rendezvous completes ``last_call_timeout`` after its MIN-th member arrives and later arrivals
        do not extend it: with MIN=1 and containers whose start (``import torch``) takes from 5 to 40 s on a busy
        machine, the first world would hold the fastest few and re-form as each of the others arrives. ``peers``
        is a DNS name with one address per running replica (Docker's name of the compose service).
        """
        if self.job_started():
            return  # a world exists or is forming: join it now
        self.first_of_job = True
        if self.store is None:
            return
        log.info("waiting until every replica of %r is ready to form the first world", peers)
        prefix = f"app.cluster.launch/{self.run_id}/ready/"
        self.client().set(prefix + socket.gethostbyname(socket.gethostname()), "1")
        deadline, ips = time.monotonic() + timeout_s, set()
        while time.monotonic() < deadline:
            try:
                ips = {a[4][0] for a in socket.getaddrinfo(peers, None, socket.AF_INET)}
            except OSError:
                ips = set()
            if (ips and self.client().check([prefix + ip for ip in ips])) or self.job_started():
                log.debug("%d replicas of %r ready", len(ips), peers)
                return
            time.sleep(0.5)
        log.warning("not every one of the %d replicas of %r was ready in %g s: joining now", len(ips), peers, timeout_s)

    def is_me(self, node) -> bool:
        return node.addr == self.me and node.pid == os.getpid() and node.local_id == self.local_id

    def world_formed(self, group) -> None:
        self.world += 1
        state = self.state()
        if state is not None and not (state.complete and len(state.participants) == group.group_world_size):
            state = None  # the next round is already forming: its member list is not this world's
        members = {short(n.addr): r for n, r in state.participants.items()} if state else {}
        ranks = [w.global_rank for w in group.workers]
        line = f"joined a world of {group.group_world_size} as rank {','.join(map(str, ranks))}"
        if state:
            line += f" (round {state.round}; " + " ".join(
                f"{r}={c}" for c, r in sorted(members.items(), key=lambda m: m[1])
            )
            gone = [f"{c} (was rank {r})" for c, r in self.members.items() if c not in members]
            came = [c for c in members if self.members and c not in self.members]
            line += (f"; left: {', '.join(gone)}" if gone else "") + (f"; new: {', '.join(came)}" if came else "") + ")"
        log.info("%s", line)
        if self.world == 1 and self.first_of_job and self.workers and group.group_world_size != self.workers:
            log.warning(
                "the world formed with %d workers, not WORKERS=%d: the world follows the running containers "
                "(docker compose up --scale worker=N wins); WORKERS only sets how many containers `up` starts",
                group.group_world_size,
                self.workers,
            )
        self.members = members

    def workers_failed(self, failures) -> None:
        for rank, failure in sorted(failures.items()):
            log.warning(
                "rank %d (this container, %s) %s", rank, short(socket.gethostname()), describe_exit(failure.exitcode)
            )
        self.leave_reason = "its trainer stopped (above)"

    def leaving(self, remaining: int, budget: int) -> None:
        log.info("leaving the world to re-form it: %s; restarts left %d of %d", self.leave_reason, remaining, budget)
        self.leave_reason = "new containers are waiting to join"

    def watch_redundancy(self, high: int) -> None:
        """Exit 2 once this container has been one too many (the world full at MAX) for the grace period."""
        since = None
        while True:
            time.sleep(2.0)
            state = self.state()
            extra = state is not None and any(self.is_me(n) for n in state.redundancy_list)
            since = (since or time.monotonic()) if extra else None
            if since is not None and time.monotonic() - since > REDUNDANT_GRACE_SECONDS:
                log.error(
                    "this container is one more than the world's maximum of %d workers (MAX_WORKERS): it would "
                    "wait idle; scale to at most %d (docker compose up -d --scale worker=%d --no-recreate)",
                    high,
                    high,
                    high,
                )
                logging.shutdown()
                os._exit(BAD_CONFIG)  # no trainer of ours runs: nothing to stop or save


def fresh_node_identity(reporter: Reporter) -> None:
    """Give this agent a rendezvous identity its predecessor in the same container never had.

    torch names a node (hostname, pid, local id). A container that Docker restarts keeps its hostname and, in a fresh
    pid namespace, gets the same pid: its new agent would be taken for the dead one still listed in the rendezvous
    state (a participant of a finished round), and wait for a round it is not part of until join_timeout. The local
    id counts rendezvous handlers within a process; starting it from the clock makes each incarnation distinct.
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    reporter.local_id = int(time.time() * 1000) % 2**31
    DynamicRendezvousHandler._node_desc_generator._local_id = reporter.local_id


def install_agent(reporter: Reporter) -> None:
    """Make ``elastic_launch`` build torch's LocalElasticAgent with the reporting hooks below."""
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class ReportingAgent(LocalElasticAgent):
        def __init__(self, spec, *args, **kwargs):
            super().__init__(spec, *args, **kwargs)
            close = spec.rdzv_handler.shutdown

            def close_only_when_done() -> bool:
                # launch_agent closes the job's rendezvous for good whenever this agent ends other than by a
                # signal; one container giving up (restart budget spent, store lost) must not end the job for the
                # others: only a finished job is closed.
                return close() if reporter.succeeded else False

            spec.rdzv_handler.shutdown = close_only_when_done
            join = spec.rdzv_handler.next_rendezvous

            def join_with_peers():
                # Here, not earlier: the agent's own start-up (seconds on a busy machine) is behind every
                # container, so they all join within a moment of each other.
                if PEERS and reporter.world == 0:
                    reporter.wait_for_peers(PEERS, PEERS_WAIT_SECONDS)
                if reporter.store:
                    log.info("joining a world of job %r at %s:%d", reporter.run_id, *reporter.store)
                return join()

            spec.rdzv_handler.next_rendezvous = join_with_peers

        def _rendezvous(self, worker_group):
            super()._rendezvous(worker_group)
            reporter.world_formed(worker_group)

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.is_failed():
                reporter.workers_failed(result.failures)
            reporter.succeeded = result.state.name == "SUCCEEDED"
            return result

        def _restart_workers(self, worker_group):
            reporter.leaving(self._remaining_restarts, worker_group.spec.max_restarts)
            super()._restart_workers(worker_group)

        def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
            super()._shutdown(death_sig, timeout)
            handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
            reporter.exit_codes = {r: h.proc.poll() for r, h in handlers.items()}

    launcher_api.LocalElasticAgent = ReportingAgent  # launch_agent looks the class up by this name at each call


# -- the run ------------------------------------------------------------------------------------------------------
def setup_logging(debug: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [launch {short(socket.gethostname())}] %(levelname)s %(message)s", "%H:%M:%S")
    )
    if not debug:
        handler.addFilter(_one_line)
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, handlers=[handler], force=True)
    # torch's loggers carry a handler of their own (torch._logging's format): route the agent's through ours.
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.handlers, elastic.propagate = [handler], False


def _one_line(record: logging.LogRecord) -> bool:
    """torch's multi-line reports and tracebacks, cut to their first line (LOGLEVEL=DEBUG keeps them whole)."""
    text = record.getMessage()
    if text.startswith("failed (exitcode"):
        return False  # torch's own note of a worker's exit: Reporter.workers_failed says it with the rank
    first = text.strip().splitlines()[0] if text.strip() else text
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


def outcome_of_failure(failures, high: int) -> int:
    codes = {f.exitcode for f in failures.values()}
    if codes == {BAD_CONFIG}:
        log.error("bad configuration (the trainer's line above names the setting): exit 2")
        return BAD_CONFIG
    log.error("giving up: the trainer failed and the restart budget (--max-restarts) is spent: exit 1")
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
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


def launch(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)  # torchrun's own parser (usage + exit 2 on errors)
    try:
        _, high = nnodes_range(args.nnodes)
        workers = expected_workers(high)
        check_trainer_config(args)
        store = store_address(args)
        if store:
            wait_for_store(*store, STORE_WAIT_SECONDS)
    except LaunchError as e:
        log.error("%s", e)
        return e.code
    reporter = Reporter(store, args.rdzv_id, workers)
    fresh_node_identity(reporter)
    install_agent(reporter)
    if store:
        threading.Thread(target=reporter.watch_redundancy, args=(high,), name="redundancy", daemon=True).start()
    try:
        run(args)  # torch.distributed.run.run: elastic_launch with the agent above
    except SignalException as e:
        return outcome_of_stop(reporter, e.sigval.name)
    except ChildFailedError as e:
        return outcome_of_failure(e.failures, high)
    except Exception as e:  # noqa: BLE001 - one line names the cause; LOGLEVEL=DEBUG shows the traceback
        log.debug("the agent failed", exc_info=True)
        log.error("%s: exit 1", explain(e, store, args.rdzv_id))
        return FAILED
    log.info("the workers finished: exit 0")
    return OK


def main(argv: list[str] | None = None) -> int:
    setup_logging(os.environ.get("LOGLEVEL", "").upper() == "DEBUG")
    return launch(argv)


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.exit(code)
