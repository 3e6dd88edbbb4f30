"""What the cluster's launcher reads of torch's private elastic internals, and why it patches them.

torchrun's public surface says nothing about who is in a world or why it re-forms; the launcher
(``app.cluster.launch``) and the store (``app.cluster.rendezvous_store``) learn it here, from parts of
``torch.distributed.elastic`` that are not a public API:

- ``state_reader``: torch's pickled ``_RendezvousState`` at the c10d store (participants, wait and redundancy
  lists, ``closed``), read with torch's own ``C10dRendezvousBackend``;
- ``Reporter``: one line per event (a world formed and who is in it, a trainer failed, leaving a world), from
  that state and the agent's hooks;
- ``install_agent``: a ``LocalElasticAgent`` subclass that ``elastic_launch`` builds in place of torch's, with the
  hooks, and the patches of the rendezvous handler (close only a finished job; join once every replica is ready);
  under ``heal=in_place`` its exit barrier waits for the containers of the world the trainers healed to
  (``app.worker.heal.exit_barrier``), not for a lost one's, and counts a newcomer's (``app.cluster.newcomer``);
- ``fresh_node_identity``: a patch of the handler's node-id generator for containers that Docker restarts.

The lines that write into torch (the agent class, the node id, the join hook) are ``app.torch_patches``'s, which
checks torch's version first; the reads (the state, the agent's process context) are here. When torch changes one of
these, those two files are the ones to fix (tests/unit/test_torch_patches.py, tests/integration/test_launch.py).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import socket
import time

from app import torch_patches
from app.cluster.memory import OomWatch, oom_line
from app.exit_codes import BAD_CONFIG, FAILED, OK, PEER_STOPPED, STORAGE_FAILED
from app.worker.config.launch import LaunchConfig

log = logging.getLogger("app.cluster.launch")


class SpareAtTheEnd(Exception):
    """The job ended while this container waited as a spare (the world full at its maximum): nothing to do."""


def state_reader(store, run_id: str):
    """A function returning rendezvous ``run_id``'s state at ``store`` (a TCPStore), or None before the first round.

    The state is torch's private pickled ``_RendezvousState``, written by torchrun's c10d backend; its fields
    (``round``, ``complete``, ``closed``, ``participants``, ``wait_list``, ``redundancy_list``) have been there since
    that backend exists. It raises whatever the store or the unpickling raise: callers decide what a failure means.
    """
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    backend = C10dRendezvousBackend(store, run_id)

    def read():
        found = backend.get_state()
        return pickle.loads(found[0]) if found else None

    return read


def short(addr: str) -> str:
    """A node's address as `docker ps` shows the container: its hostname, the 12-hex container id."""
    return addr.split(".", 1)[0][:12]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    meaning = {
        OK: "finished",
        FAILED: "failed",
        BAD_CONFIG: "bad configuration",
        PEER_STOPPED: "stopped with a departing peer, checkpointed",
        STORAGE_FAILED: "could not write a checkpoint",
    }.get(code, "failed")
    return f"exited {code} ({meaning})"


def replica_addresses(peers: str) -> set[str]:
    """The IPv4 addresses DNS gives for ``peers`` (compose: one per running replica of the service); none on error."""
    try:
        return {a[4][0] for a in socket.getaddrinfo(peers, None, socket.AF_INET)}
    except OSError:
        return set()


class Sightings:
    """When each replica's address was first seen: a set that gained none for ``settle_s`` is taken as complete.

    `docker compose up --scale worker=N` starts the N containers one after another, seconds apart on a busy
    machine, and DNS lists each only once it runs: the first replicas could all be ready while the last is not yet
    listed, and the first world would form without it (seen at load 25-36: a world of 3 out of 4).
    """

    def __init__(self, settle_s: float, clock=time.monotonic):
        self.settle_s, self.clock = settle_s, clock
        self.first_seen: dict[str, float] = {}
        self.current: set[str] = set()

    def see(self, addresses: set[str]) -> set[str]:
        now = self.clock()
        for address in addresses:
            self.first_seen.setdefault(address, now)
        self.current = set(addresses)
        return self.current

    def settled(self) -> bool:
        """True once the newest of the current addresses has been listed for ``settle_s``."""
        if not self.current:
            return False
        newest = max(self.first_seen[a] for a in self.current)
        return self.clock() - newest >= self.settle_s


def heal_exit_barrier(config, run_id: str, local_world_size: int, timeout_s: float) -> bool:
    """heal=in_place: wait at heal_store for the launchers of every container of the trainers' newest world (as
    agreed there, after any heal: a lost container's launcher never comes, a newcomer's comes though it never
    entered torch's rendezvous). True once that barrier is done (passed, or timed out: a warning, as torch's, and the
    trainers' own exit code stands); False: not for this job (heal=restart, no world at the store, the store
    unreachable), so the caller's own barrier runs, if it has one."""
    if config is None or config.heal != "in_place":
        return False
    from app.worker.heal import exit_barrier

    try:
        containers = exit_barrier(config.heal_store, run_id, local_world_size, timeout_s)
    except TimeoutError as e:
        log.warning("exit barrier at heal_store=%s: %s", config.heal_store, e)
        return True
    except Exception:  # noqa: BLE001 - torch's own barrier then: the slower, never the wrong ending
        log.debug("cannot reach the healed world at %s", config.heal_store, exc_info=True)
        return False
    if containers is not None:
        log.info("the exit barrier at heal_store waited for the %d container(s) of the trainers' world", containers)
    return containers is not None


class Reporter:
    """Reads the rendezvous state at the store (torch's own c10d backend) to say who is in each world."""

    def __init__(
        self,
        store: tuple[str, int] | None,
        run_id: str,
        workers: int | None,
        config=None,
        settings: LaunchConfig | None = None,
    ):
        self.store, self.run_id, self.workers = store, run_id, workers
        self.settings = settings or LaunchConfig()  # the launcher's LAUNCH_* settings (peers, waits, grace)
        self.config = config  # the trainer's TrainConfig, when the launcher checked it (for the advice on memory)
        self.me = socket.getfqdn()
        self._read = None  # state_reader, once the store is reached
        self._client = None
        self.members: dict[str, int] = {}  # container -> rank in the last world this container joined
        self.world = 0  # worlds this container has joined
        self.exit_codes: dict[int, int | None] = {}  # local rank -> trainer exit code, after a shutdown
        self.leave_reason = "new containers are waiting to join"
        self.succeeded = False
        self.local_id = 0  # this agent's rendezvous node id (fresh_node_identity)
        self.first_of_job = False  # this agent came before the job's first world (not to a running job)
        self.expected = 0  # the first world's size once every replica is ready (wait_for_peers); 0 = not known
        self.memory = OomWatch()
        self.out_of_memory: str | None = None  # the line of a trainer killed for memory (app.cluster.memory)
        self.world_started = time.time()  # when this container's latest world formed (older dumps are not its)

    def state(self):
        """torch's private ``_RendezvousState`` (participants, wait and redundancy lists), or None."""
        if self.store is None:
            return None
        try:
            if self._read is None:
                self._read = state_reader(self.client(), self.run_id)
            return self._read()
        except Exception:  # noqa: BLE001 - the report is a courtesy: never let it break the agent
            log.debug("cannot read the rendezvous state", exc_info=True)
            return None

    def client(self):
        """A TCPStore client of the rendezvous store, opened once."""
        if self._client is None:
            import torch.distributed as dist

            self._client = dist.TCPStore(*self.store, is_master=False, timeout=datetime.timedelta(seconds=10))
        return self._client

    def forget_store(self) -> None:
        """Drop the client and reader: they talk to a store that is gone; the next read opens a new one."""
        self._read = self._client = None

    def job_started(self) -> bool:
        state = self.state()
        return state is not None and bool(state.participants or state.complete or state.round > 0)

    def wait_for_peers(self, peers: str, timeout_s: float) -> None:
        """Before a job's first world: wait until the launcher of every running replica is ready to join.

        torch's c10d rendezvous completes ``last_call_timeout`` after its MIN-th member arrives and later arrivals
        do not extend it: with MIN=1 and containers whose start (``import torch``) takes from 5 to 40 s on a busy
        machine, the first world would hold the fastest few and re-form as each of the others arrives. ``peers``
        is a DNS name with one address per running replica (Docker's name of the compose service); a replica not
        yet running is not listed, so the set must also have stood still (``Sightings``).
        """
        if self.job_started():
            return  # a world exists or is forming: join it now
        self.first_of_job = True
        if self.store is None:
            return
        log.info("waiting until every replica of %r is ready to form the first world", peers)
        prefix = f"app.cluster.launch/{self.run_id}/ready/"
        self.client().set(prefix + socket.gethostbyname(socket.gethostname()), "1")
        deadline, sightings = time.monotonic() + timeout_s, Sightings(self.settings.peers_settle_seconds)
        ips: set[str] = set()
        while time.monotonic() < deadline:
            ips = sightings.see(replica_addresses(peers))
            # Ready first: the first replicas to see everyone ready join at once, and a replica that looked a
            # poll later would find the job started and, returning before this, never learn how many are coming;
            # if it is the last to join, the world would then wait the whole last call for nobody.
            ready = bool(ips) and self.client().check([prefix + ip for ip in ips])
            if ready and sightings.settled():
                log.debug("%d replicas of %r ready", len(ips), peers)
                self.expected = len(ips)  # every one of them joins now: the world is full when they are in
                return
            if self.job_started():
                # Another replica saw the same addresses stand still for longer: they are the first world.
                self.expected = len(ips) if ready else 0
                return
            time.sleep(0.5)
        log.warning("not every one of the %d replicas of %r was ready in %g s: joining now", len(ips), peers, timeout_s)

    def is_me(self, node) -> bool:
        return node.addr == self.me and node.pid == os.getpid() and node.local_id == self.local_id

    def world_formed(self, group) -> None:
        self.world += 1
        self.world_started = time.time()
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
        killed = [rank for rank, f in sorted(failures.items()) if f.exitcode == -signal.SIGKILL]
        if killed and (memory := self.memory.kills()):
            # The kernel killed it for memory: the launcher ends with this line (and no restart), not a warning.
            self.out_of_memory = oom_line(killed[0], short(socket.gethostname()), memory, self.config)
            return
        for rank, failure in sorted(failures.items()):
            # A peer's planned departure (scale down, docker stop) ends this rank with 75 on purpose: the world
            # re-forms without the peer. That is the design working, not a warning.
            level = logging.INFO if failure.exitcode == PEER_STOPPED else logging.WARNING
            me = short(socket.gethostname())
            log.log(level, "rank %d (this container, %s) %s", rank, me, describe_exit(failure.exitcode))
        self.leave_reason = "its trainer stopped (above)"
        if line := self.diagnosis():
            log.warning("%s", line)

    def diagnosis(self) -> str | None:
        """The doctor's line (app.diagnostics.doctor) over the flight recorder's dumps that this world's failure
        wrote to the shared checkpoint volume: which rank stopped, at which collective. None without fresh dumps."""
        directory = getattr(self.config, "checkpoint_dir", "")
        flight = os.path.join(directory, "flight") if directory else ""
        try:
            fresh = flight and any(
                e.stat().st_mtime >= self.world_started for e in os.scandir(flight) if e.name.startswith("rank-")
            )
        except OSError:
            fresh = False  # no dumps (no checkpoint_dir, recorder off, nothing failed in a collective)
        if not fresh:
            return None
        from app.diagnostics.doctor import summary_line

        return summary_line(flight)

    def heal_exit_barrier(self, local_world_size: int, timeout_s: float) -> bool:
        """heal=in_place: the exit barrier at heal_store (``heal_exit_barrier``); False: torch's own instead."""
        return heal_exit_barrier(self.config, self.run_id, local_world_size, timeout_s)

    def leaving(self, remaining: int, budget: int) -> None:
        log.info("leaving the world to re-form it: %s; restarts left %d of %d", self.leave_reason, remaining, budget)
        self.leave_reason = "new containers are waiting to join"

    def watch_redundancy(self, high: int, refuse=lambda reason: None) -> None:
        """Exit 2 once this container has been one too many (the world full at MAX) for the grace period.

        ``refuse(reason)`` records it first (``JobState.refuse``), so that Docker's restart of it ends at once.
        """
        since = None
        while True:
            time.sleep(2.0)
            state = self.state()
            extra = state is not None and any(self.is_me(n) for n in state.redundancy_list)
            since = (since or time.monotonic()) if extra else None
            if since is not None and time.monotonic() - since > self.settings.redundant_grace_seconds:
                log.error(
                    "this container is one more than the world's maximum of %d workers (MAX_WORKERS): it would "
                    "wait idle; scale to at most %d (docker compose up -d --scale worker=%d --no-recreate)",
                    high,
                    high,
                    high,
                )
                refuse(f"one container more than the world's maximum of {high} workers (MAX_WORKERS)")
                logging.shutdown()
                os._exit(BAD_CONFIG)  # no trainer of ours runs: nothing to stop or save


def fresh_node_identity(reporter: Reporter) -> None:
    """Give this agent a rendezvous identity its predecessor in the same container never had.

    torch names a node (hostname, pid, local id). A container that Docker restarts keeps its hostname and, in a fresh
    pid namespace, gets the same pid: its new agent would be taken for the dead one still listed in the rendezvous
    state (a participant of a finished round), and wait for a round it is not part of until join_timeout. The local
    id counts rendezvous handlers within a process; starting it from the clock makes each incarnation distinct.
    """
    reporter.local_id = int(time.time() * 1000) % 2**31
    torch_patches.set_node_local_id(reporter.local_id)


def complete_first_world_when_full(reporter: Reporter) -> None:
    """Form the job's first world as soon as every replica is in it, not ``last_call_timeout`` later, and not before.

    torch's c10d rendezvous completes at once only with MAX members; with fewer it waits ``last_call_timeout``
    after the MIN-th, for members that may still come. Before the first world, ``wait_for_peers`` knows how many
    will come (every replica is ready): when that many are in, nobody else is coming. Until then the last call is
    held open ``LAUNCH_FIRST_WORLD_HOLD_SECONDS`` from each arrival: on a machine far above its cores, adding four
    agents to the state took longer than the last call (``make bench-startup`` at load 35), and the first world formed
    with two while the other two, already joining, waited out join_timeout and exited 1. Later worlds (a container
    gone or come) keep torch's last call: there, the world may still be growing.
    """

    def maybe_complete(state, complete) -> None:
        if not (reporter.expected and reporter.world == 0 and reporter.first_of_job and not state.complete):
            return
        if len(state.participants) >= reporter.expected:
            log.debug("all %d expected replicas are in: forming the first world now", reporter.expected)
            complete()
        elif state.deadline is not None:  # the last call runs (MIN members are in): hold it for the rest
            hold = datetime.timedelta(seconds=reporter.settings.first_world_hold_seconds)
            held = datetime.datetime.now(datetime.timezone.utc) + hold
            state.deadline = max(state.deadline, held)

    torch_patches.after_joining_participants(maybe_complete)


def install_agent(reporter: Reporter) -> None:
    """Make ``elastic_launch`` build torch's LocalElasticAgent with the reporting hooks below."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class ReportingAgent(LocalElasticAgent):
        def __init__(self, spec, *args, **kwargs):
            super().__init__(spec, *args, **kwargs)
            hook_rendezvous_handler(spec.rdzv_handler, reporter)

        def run(self, *args, **kwargs):
            result = super().run(*args, **kwargs)
            if result is None:
                # torch's agent returns None when the job's rendezvous closed while this node waited in the
                # redundancy list (RendezvousGracefulExitError); launch_agent would then fail on result.is_failed().
                raise SpareAtTheEnd()
            return result

        def _rendezvous(self, worker_group):
            super()._rendezvous(worker_group)
            reporter.world_formed(worker_group)

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.is_failed():
                reporter.workers_failed(result.failures)
                codes = {f.exitcode for f in result.failures.values()}
                if codes in ({STORAGE_FAILED}, {BAD_CONFIG}) or reporter.out_of_memory:
                    # The checkpoint directory is full or not writable, the trainer refused its input (a checkpoint
                    # of another kind, a shard that fails its digest), or it was killed for memory: a new world
                    # would fail the same way. No restart of the group (the agent gives up: ChildFailedError).
                    self._remaining_restarts = 0
            reporter.succeeded = result.state.name == "SUCCEEDED"
            return result

        def _restart_workers(self, worker_group):
            reporter.leaving(self._remaining_restarts, worker_group.spec.max_restarts)
            super()._restart_workers(worker_group)

        def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
            super()._shutdown(death_sig, timeout)
            reporter.exit_codes = exit_codes(self._pcontext)

        def _exit_barrier(self):
            # torch's barrier waits for every launcher of the world torchrun formed; after a heal in place
            # (heal=in_place) a lost container's never comes (the survivors would wait out its 300 s) and a
            # newcomer's (app.cluster.newcomer) never entered it: the barrier at heal_store counts the healed world.
            local = self._worker_group.spec.local_world_size
            self._in_exit_barrier = True  # as torch's: its health check reads the wait as progress
            try:
                healed = reporter.heal_exit_barrier(local, self._exit_barrier_timeout)
            finally:
                self._in_exit_barrier = False
            if not healed:
                super()._exit_barrier()

    torch_patches.use_agent_class(ReportingAgent)


def hook_rendezvous_handler(handler, reporter: Reporter) -> None:
    """The agent's rendezvous handler with two of its calls wrapped: the job's rendezvous is closed only once the job
    finished, and the first join waits for every replica's launcher (``LAUNCH_PEERS``)."""
    close, join = handler.shutdown, handler.next_rendezvous

    def close_only_when_done() -> bool:
        # launch_agent closes the job's rendezvous for good whenever this agent ends other than by a signal; one
        # container giving up (restart budget spent, store lost) must not end the job for the others: only a
        # finished job is closed.
        return close() if reporter.succeeded else False

    def join_with_peers():
        # Here, not earlier: the agent's own start-up (seconds on a busy machine) is behind every container, so
        # they all join within a moment of each other.
        settings = reporter.settings
        if settings.peers and reporter.world == 0:
            reporter.wait_for_peers(settings.peers, settings.peers_wait_seconds)
        if reporter.store:
            log.info("joining a world of job %r at %s:%d", reporter.run_id, *reporter.store)
        return join()

    handler.shutdown, handler.next_rendezvous = close_only_when_done, join_with_peers


def exit_codes(pcontext) -> dict[int, int | None]:
    """Each local rank's exit code (None while it runs) from torch's process context: new interpreters
    (``subprocess_handlers``) or forked trainers (app.cluster.forked_trainer: torch.multiprocessing's ``_pc``)."""
    if handlers := getattr(pcontext, "subprocess_handlers", None):
        return {rank: handler.proc.poll() for rank, handler in handlers.items()}
    processes = getattr(getattr(pcontext, "_pc", None), "processes", None) or []
    return {rank: proc.exitcode for rank, proc in enumerate(processes)}
