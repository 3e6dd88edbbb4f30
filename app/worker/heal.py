"""Heal in place (``heal=in_place``, parallel=ddp): a lost or new rank costs seconds, not a restart of the world.

With ``heal=restart`` (the default) a lost peer ends every trainer and torchrun starts the world again from the
newest checkpoint. With ``heal=in_place`` the trainers stay up:

- **a lost peer**: the survivors' collective fails (gloo: the dead peer's connections reset within milliseconds),
  each survivor drops its process group, they agree on the new membership at ``heal_store`` (``Quorum``), build a
  fresh group in-process and redo the step that failed with the global batch dealt over the new world. No optimizer
  step was applied by it: every collective of a ddp step (the gradient all-reduce, the step control) comes before
  ``optimizer.step()``, and the data position is rewound to where the step began;
- **a new rank** (``python -m app.train`` started against a live world: ``Healer.connect`` finds it at the store)
  asks to join; rank 0 sees the request at a step boundary and the next step control carries it to every rank; all
  agree on a world with the newcomer, which is given the parameters, optimizer state, schedule, data position and
  step by rank 0 over the new group, not from the checkpoint volume.

The membership is agreed at a TCPStore that outlives every rank (``heal_store``: the compose rendezvous store; a
test's own store), under ``heal/<job>/<incarnation>/`` (rank 0's id in the first world: a world torchrun starts
again begins a fresh one; ``heal/<job>/current`` names the live one for newcomers): each member bumps a heartbeat
counter; for world ``q + 1`` every
candidate registers itself (id, steps committed, rank in world ``q``) and waits until every member of world ``q``
has either registered or let its heartbeat stand still for ``STALE_SECONDS``; the first to be done proposes the
registered set with ``compare_set``, and everyone takes the winning proposal. New rank 0 is the member with the most
steps committed (lowest old rank among equals), and it sends its state to all when the members' steps differ (a
collective can complete on some survivors and fail on others, so one survivor may have applied a step the others
have not) or a newcomer is among them. Every member reseeds its RNG as a resume onto another world size does
(app.worker.checkpoint.checkpointer). Tested by tests/integration/test_heal.py (a real SIGKILL, float64 parameters
against an uninterrupted run).

What still restarts the world: the kinds that shard state (zero1-3, pipeline: refused at start, exit 2), a lost
``heal_store``, and a quorum that cannot form within ``rendezvous_timeout_seconds``.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from app.cli import setup_logging
from app.worker.dist import DistContext, lost_peer

log = logging.getLogger("app.train")

HEARTBEAT_SECONDS = 0.2
# A member whose heartbeat has not moved for this long is gone: well above a heartbeat on a loaded machine (a
# thread that misses the GIL for a while), well below the 10 s a heal may take.
STALE_SECONDS = 2.0
POLL_SECONDS = 0.02


@dataclass(frozen=True)
class Member:
    """One candidate of a world: who, how many optimizer steps it has committed (-1: none, a newcomer), and its rank
    in the previous world (-1: it was not in it)."""

    id: str
    step: int
    rank: int


def new_member_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def order(members: list[Member]) -> list[Member]:
    """The new world's ranks: the most steps committed first (it is the source), then by old rank, newcomers last."""
    return sorted(members, key=lambda m: (-m.step, m.rank if m.rank >= 0 else 1 << 30, m.id))


class Quorum:
    """The membership agreement at a TCPStore that outlives every rank (one per process; see the module docstring).

    Example::

        quorum = Quorum("rendezvous:29400", job="job1", member_id=new_member_id(), timeout_s=60)
        members = quorum.agree(1, Member(quorum.member_id, step=12, rank=0), previous=["a", "b", "c"])
    """

    def __init__(self, address: str, job: str, member_id: str, timeout_s: float, beat: bool = True):
        host, _, port = address.rpartition(":")
        self.address, self.member_id, self.timeout_s = address, member_id, timeout_s
        self.base = f"heal/{job}/"
        self.prefix = self.base  # then base/<incarnation>/: a world torchrun starts again never reads the last one's
        self.store = self._client(host, int(port))
        if beat:  # a member's; a reader (the launcher's exit barrier) only looks
            self._beat = self._client(host, int(port))  # its own connection: the heartbeat thread never waits on ours
            threading.Thread(target=self._heartbeat, name="heal-heartbeat", daemon=True).start()

    def _client(self, host: str, port: int) -> dist.TCPStore:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        return dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)

    def key(self, name: str) -> str:
        return self.prefix + name

    def heartbeat_key(self, member_id: str) -> str:
        return f"{self.base}hb/{member_id}"

    def current(self) -> str | None:
        """The incarnation of the job's live world (None: none has formed yet)."""
        key = self.base + "current"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def enter(self, incarnation: str, publish: bool = False) -> None:
        self.prefix = f"{self.base}{incarnation}/"
        if publish:
            self.store.set(self.base + "current", incarnation)

    def _heartbeat(self) -> None:
        while True:
            try:
                self._beat.add(self.heartbeat_key(self.member_id), 1)
            except RuntimeError:  # the store is gone: the next agreement says so, in one line
                return
            time.sleep(HEARTBEAT_SECONDS)

    # -- the world's generation: what a newcomer reads to know there is a world to join -----------------------------
    def generation(self) -> int | None:
        key = self.key("generation")
        return int(self.store.get(key)) if self.store.check([key]) else None

    def publish(self, generation: int, members: list[Member]) -> None:
        """New rank 0, once the world ``generation`` has formed: newcomers register for the next one."""
        self.store.set(self.key(f"q{generation}/members"), json.dumps([asdict(m) for m in members]))
        self.store.set(self.key("generation"), str(generation))

    def published(self, generation: int) -> list[Member]:
        """The members of world ``generation`` as its rank 0 published them ([] until it has)."""
        key = self.key(f"q{generation}/members")
        return [Member(**m) for m in json.loads(self.store.get(key))] if self.store.check([key]) else []

    def join_pending(self, generation: int) -> bool:
        """Somebody registered for the world after ``generation`` while this one runs: a newcomer asks in."""
        return self.store.add(self.key(f"q{generation + 1}/n"), 0) > 0

    # -- the agreement ---------------------------------------------------------------------------------------------
    def agree(self, generation: int, me: Member, previous: list[str]) -> list[Member]:
        """The members of world ``generation``, in rank order, as the first candidate to be done waiting proposed it.

        Waits until every id of ``previous`` (world ``generation - 1``) has registered or been silent for
        ``STALE_SECONDS``, at most ``timeout_s``. A candidate not in the result was too late: it joins the next.
        """
        n = self.store.add(self.key(f"q{generation}/n"), 1)
        self.store.set(self.key(f"q{generation}/c{n}"), json.dumps(asdict(me)))
        decided = self.key(f"q{generation}/decided")
        beats = Heartbeats(self, previous)
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([decided]):
            if self.store.check([self.key("finished")]):  # a newcomer's wait: no world will come to take it in
                raise JobFinished(f"the job at heal_store={self.address} finished while this rank waited to join")
            registered = self._candidates(generation)
            ids = {m.id for m in registered}
            waiting = [p for p in previous if p not in ids and beats.alive(p)]
            # Nobody with a state yet (newcomers only): wait for the world, whose members come at a step boundary.
            holders = any(m.step >= 0 for m in registered)
            if (holders and not waiting) or time.monotonic() > deadline:
                proposal = json.dumps([asdict(m) for m in order(registered)])
                self.store.compare_set(decided, "", proposal)  # the first proposal wins; the others read it
                break
            time.sleep(POLL_SECONDS)
        return [Member(**m) for m in json.loads(self.store.get(decided))]

    def _candidates(self, generation: int) -> list[Member]:
        count = self.store.add(self.key(f"q{generation}/n"), 0)
        keys = [self.key(f"q{generation}/c{i}") for i in range(1, count + 1)]
        # A candidate counted but not yet written is seen at the next poll.
        return [Member(**json.loads(self.store.get(k))) for k in keys if self.store.check([k])]


class JobFinished(RuntimeError):
    """The job's world finished while a newcomer waited to be taken in: there is nothing left to join."""


def _reader(address: str, job: str, timeout_s: float) -> Quorum | None:
    """A look at the live incarnation of ``job`` at ``address`` (no heartbeat of its own); None: none formed."""
    quorum = Quorum(address, job, member_id="", timeout_s=timeout_s, beat=False)
    incarnation = quorum.current()
    if incarnation is None:
        return None
    quorum.enter(incarnation)
    return quorum


def _newest_members(quorum: Quorum) -> list[Member]:
    generation = quorum.generation()
    return quorum.published(generation) if generation is not None else []


def newest_world_size(address: str, job: str, timeout_s: float = 10.0) -> int | None:
    """How many ranks the newest world of ``job`` at ``address`` holds (None: no world has formed there)."""
    quorum = _reader(address, job, timeout_s)
    return (len(_newest_members(quorum)) or None) if quorum is not None else None


def live_world(address: str, job: str, timeout_s: float = 10.0) -> int | None:
    """How many ranks the newest world of ``job`` at ``address`` holds when it trains now: not finished, and a
    member's heartbeat moves within ``STALE_SECONDS``; None otherwise (no world, finished, or its ranks all gone).
    What the cluster's launcher asks before it runs a container's trainer as a newcomer (app.cluster.newcomer)."""
    quorum = _reader(address, job, timeout_s)
    if quorum is None or quorum.store.check([quorum.key("finished")]):
        return None
    members = _newest_members(quorum)
    seen = {m.id: quorum.store.add(quorum.heartbeat_key(m.id), 0) for m in members}
    deadline = time.monotonic() + STALE_SECONDS
    while members and time.monotonic() < deadline:
        time.sleep(HEARTBEAT_SECONDS / 2)
        if any(quorum.store.add(quorum.heartbeat_key(i), 0) != n for i, n in seen.items()):
            return len(members)
    return None


def job_finished(address: str, job: str, timeout_s: float = 10.0) -> bool:
    """Whether the live incarnation of ``job`` at ``address`` has finished (its rank 0 said so)."""
    quorum = _reader(address, job, timeout_s)
    return quorum is not None and quorum.store.check([quorum.key("finished")])


def exit_barrier(address: str, job: str, local_world_size: int, timeout_s: float) -> int | None:
    """Each launcher of the newest world of ``job`` arrives here once its trainers finished; returns, with the
    number of containers it waited for, once the launchers of every container of that world have arrived (torch's
    exit barrier counts the world torchrun formed: a lost container's launcher never comes, and a newcomer's never
    entered it). None: no world formed at ``address``; ``TimeoutError`` past ``timeout_s``."""
    quorum = _reader(address, job, min(timeout_s, 10.0))  # reaching the store: seconds, not the barrier's minutes
    if quorum is None:
        return None
    quorum.store.add(quorum.key("exit/n"), 1)
    deadline = time.monotonic() + timeout_s
    while True:
        containers = max(1, len(_newest_members(quorum)) // max(1, local_world_size))
        arrived = quorum.store.add(quorum.key("exit/n"), 0)
        if arrived >= containers:
            return containers
        if time.monotonic() > deadline:
            raise TimeoutError(f"{arrived} of the {containers} containers of the world finished in {timeout_s:g} s")
        time.sleep(POLL_SECONDS * 5)


class Heartbeats:
    """Which of ``ids`` still beat: a counter that has not moved for ``STALE_SECONDS`` since we started watching."""

    def __init__(self, quorum: Quorum, ids: list[str]):
        self.quorum = quorum
        now = time.monotonic()
        self.last = {i: (self._read(i), now) for i in ids}

    def _read(self, member_id: str) -> int:
        return self.quorum.store.add(self.quorum.heartbeat_key(member_id), 0)

    def alive(self, member_id: str) -> bool:
        value, since = self.last[member_id]
        now = time.monotonic()
        current = self._read(member_id)
        if current != value:
            self.last[member_id] = (current, now)
            return True
        return now - since < STALE_SECONDS


class Healer:
    """One rank's side of healing in place: joins the quorum, rebuilds the group and the wrapper, moves the state.

    ``app.train`` connects it before the process group forms (``connect``: a newcomer joins a live world through
    ``join_world`` instead of torchrun's rendezvous); the ``Trainer`` calls ``attach`` once built,
    ``before_step`` at each step, ``heal`` on a lost peer or a join request, and ``cause`` to tell a lost peer from a
    bug.
    """

    def __init__(self, cfg, quorum: Quorum, joining: bool):
        self.cfg, self.quorum, self.joining = cfg, quorum, joining
        self.generation = 0
        self.members: list[Member] = []
        self.data_state: dict | None = None  # the data position where the current step began
        # time.time() of the last failure (or of a newcomer's start) and what it was, for the next step's line
        self.since: tuple[float, str] | None = (time.time(), "this rank asked to join") if joining else None
        self.heals = 0

    @classmethod
    def connect(cls, cfg, job: str) -> Healer:
        """A newcomer is a process no launcher gave a world (no WORLD_SIZE) that finds a live one at the store; a
        rank of a world torchrun (re)started is never one: it starts a new incarnation once its world has formed."""
        quorum = Quorum(cfg.heal_store, job, new_member_id(), cfg.rendezvous_timeout_seconds)
        live = quorum.current()
        joining = live is not None and "WORLD_SIZE" not in os.environ
        if joining:
            quorum.enter(live)
        return cls(cfg, quorum, joining=joining)

    # -- start: the first world, or a newcomer's way into a live one --------------------------------------------------
    def join_world(self, world) -> DistContext:
        """A newcomer: register for the next world until one takes it, then form its group (what torchrun's
        rendezvous does for the first world). ``world``: this process's ``WorldEnv`` (its local rank)."""
        from app.worker.dist import pick_device_and_backend

        if self.quorum.store.check([self.quorum.key("finished")]):
            raise RuntimeError(f"the job at heal_store={self.cfg.heal_store} has finished: no world to join")
        device, backend = pick_device_and_backend(world.local_rank, force_cpu=self.cfg.device == "cpu")
        log.warning("asks to join the world at heal_store=%s", self.cfg.heal_store)
        return self._enter(Member(self.quorum.member_id, -1, -1), device, backend, world.local_rank)

    def _enter(self, me: Member, device, backend, local_rank: int) -> DistContext:
        """Register for the world after the newest published one until one takes ``me`` (a member left out of one,
        too late to its agreement, asks for the next as a newcomer would), then form its group."""
        deadline = time.monotonic() + self.cfg.rendezvous_timeout_seconds
        while True:
            generation = max(self.generation, self.quorum.generation() or 0) + 1
            previous = [m.id for m in self.quorum.published(generation - 1)]
            members = self.quorum.agree(generation, me, previous)
            if all(m.step < 0 for m in members):  # the deadline passed with newcomers only: the world is gone
                raise RuntimeError(f"no live world at heal_store={self.cfg.heal_store} to join (its ranks are gone)")
            if any(m.id == me.id for m in members):
                return self._form(generation, members, device, backend, local_rank)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no world at heal_store={self.cfg.heal_store} took this rank in time")
            me = replace(me, rank=-1)
            self.generation = generation
            # Left out: ask for the next world only once this one is published, or it would start without its members.
            while (self.quorum.generation() or 0) < generation and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)

    def attach(self, trainer) -> None:
        """Once the trainer is built: the first world publishes itself; a newcomer receives the state."""
        if self.joining:
            self._sync_state(trainer)
            log.warning(
                "rank %d joined a world of %d at step %d", trainer.ctx.rank, len(self.members), trainer.step_index
            )
            return
        ids = [None] * trainer.ctx.world_size
        dist.all_gather_object(ids, self.quorum.member_id)
        self.members = [Member(i, trainer.step_index, r) for r, i in enumerate(ids)]
        self.quorum.enter(ids[0])  # rank 0's id names this incarnation
        if trainer.ctx.rank == 0:
            self.quorum.publish(0, self.members)
            self.quorum.enter(ids[0], publish=True)  # after its generation 0: a newcomer finds both
        trainer.control.poll = self._poll if trainer.ctx.rank == 0 else _nothing

    def leave(self, trainer) -> None:
        """The run has finished on every rank: a newcomer from now on is told so instead of waiting."""
        if trainer.ctx.rank == 0:
            self.quorum.store.set(self.quorum.key("finished"), "1")

    def _poll(self) -> int:
        return int(self.quorum.join_pending(self.generation))

    def before_step(self, trainer) -> None:
        """The data position where this step begins: a failed step is redone from it."""
        self.data_state = trainer.step.batches.state_dict()

    def cause(self, error: BaseException) -> str | None:
        """The lost peer behind ``error`` in one line, or None for any other error (which must stay whole)."""
        return lost_peer(error)

    def after_step(self, trainer) -> None:
        """A step finished: its data position is committed (a heal from here on rewinds nothing)."""
        self.data_state = None
        if self.since is not None:
            now = time.time()
            what = self.since[1]
            log.warning("heal: step %d finished %.2f s after %s (at unix time %.3f)", trainer.step_index,
                        now - self.since[0], what, now)  # fmt: skip
            self.since = None

    # -- the heal -------------------------------------------------------------------------------------------------
    def heal(self, trainer, why: str) -> None:
        """Every member: drop the group, agree on the next world, form it, rewrap, move the state to who lacks it."""
        t0 = time.time()
        self.since = (t0, why)
        ctx = trainer.ctx
        log.warning("rank %d: %s at step %d; healing in place", ctx.rank, why, trainer.step_index + 1)
        dist.destroy_process_group()
        trainer.step.wrapped = trainer.step.probe = None  # the old wrapper's hooks go with it (weakly held)
        gc.collect()
        new = self._enter(Member(self.quorum.member_id, trainer.step_index, ctx.rank), ctx.device, ctx.backend,
                          ctx.local_rank)  # fmt: skip
        t1 = time.time()
        rebind(trainer, new)
        self._sync_state(trainer)
        trainer.metrics.observe_healed_world(new.world_size)  # the alerts' world size: a heal is a new world too
        self.heals += 1
        log.warning(
            "rank %d of %d (was %d of %d): world %d healed in %.2f s (agreed and formed in %.2f s, state in %.2f s); "
            "next step %d",
            new.rank,
            new.world_size,
            ctx.rank,
            ctx.world_size,
            self.generation,
            time.time() - t0,
            t1 - t0,
            time.time() - t1,
            trainer.step_index + 1,
        )

    def _form(self, generation: int, members: list[Member], device, backend, local_rank: int) -> DistContext:
        rank = next(i for i, m in enumerate(members) if m.id == self.quorum.member_id)
        store = dist.PrefixStore(self.quorum.key(f"q{generation}/pg/"), self.quorum.store)
        timeout = datetime.timedelta(seconds=self.cfg.collective_timeout_seconds)
        dist.init_process_group(backend, store=store, rank=rank, world_size=len(members), timeout=timeout)
        # The log's tag and its INFO lines follow the rank (app.train's set-up): the new rank 0 says the progress.
        setup_logging(f"rank {rank}", quiet=rank != 0)
        self.generation, self.members = generation, members
        if rank == 0:
            self.quorum.publish(generation, members)
        return DistContext(rank, local_rank, len(members), device, backend)

    def _sync_state(self, trainer) -> None:
        """Rank 0 (the most steps committed) sends its state when the members' steps differ or one is new; every
        member rewinds its data to where its step began and reseeds as a resume onto another world size does."""
        step, ctx = trainer.step, trainer.ctx
        sent = len({m.step for m in self.members}) > 1
        if sent:
            state = [source_state(trainer, self.data_state)] if ctx.rank == 0 else [None]
            dist.broadcast_object_list(state, src=0)
            if ctx.rank != 0:
                load_source_state(trainer, state[0])
        if self.data_state is not None and not (sent and ctx.rank != 0):  # the source rewinds too: it sent this one
            step.batches.load_state_dict(self.data_state)
        trainer.step_index = self.members[0].step
        torch.manual_seed(self.cfg.seed + ctx.rank + 1_000_003 * trainer.step_index)
        trainer.control.poll = self._poll if ctx.rank == 0 else _nothing


def _nothing() -> int:
    return 0


def source_state(trainer, data_state: dict | None) -> dict:
    step = trainer.step
    return {
        "step": trainer.step_index,
        "model": step.model.state_dict(),
        "optimizer": step.optimizer.state_dict(),
        "data": data_state if data_state is not None else step.batches.state_dict(),
        "lr_schedule": step.lr_schedule.state_dict() if step.lr_schedule is not None else None,
        "grad_scaler": step.grad_scaler.state_dict() if step.grad_scaler is not None else None,
    }


def load_source_state(trainer, state: dict) -> None:
    step = trainer.step
    step.model.load_state_dict(state["model"])
    step.optimizer.load_state_dict(state["optimizer"])
    step.batches.load_state_dict(state["data"])
    if state["lr_schedule"] is not None:
        step.lr_schedule.load_state_dict(state["lr_schedule"])
    if state["grad_scaler"] is not None:
        step.grad_scaler.load_state_dict(state["grad_scaler"])


def rebind(trainer, ctx: DistContext) -> None:
    """Point everything that knows the world at the new one: the step's share of the global batch (same samples,
    dealt over the new ranks), its wrapper (over the new default group; it broadcasts rank 0's parameters), the
    checkpointer, the step control, the validator."""
    step = trainer.step
    trainer.ctx = step.ctx = trainer.checkpointer.ctx = trainer.control.ctx = ctx
    step.batches.recut(ctx.rank, ctx.world_size)  # the share alone: the dealer keeps its data set and position
    step.wrapped = step.wrap(step.model)
    from app.parallel.probes import comm_probe

    step.probe = comm_probe(step.wrapped)
    trainer.start_recording()  # the flight recorder learns the new world (a newcomer's Trainer makes the same call)
    if trainer.validator is not None:
        from app.worker.evaluation import build_validator

        trainer.validator = build_validator(trainer.cfg, ctx, step.loss_fn)
