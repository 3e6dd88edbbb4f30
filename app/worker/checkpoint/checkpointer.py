"""The ``Checkpointer``: resume, cadence, every rank's RNG state, the save on rank 0 (the file format is
app.worker.checkpoint.files).

``Checkpointer`` is what the training loop talks to: it resumes every rank from the newest checkpoint of either kind
that loads (rank 0 lists them; a damaged or unfinished one is skipped with a warning naming it and why), says when a
save is due (``should_save``), gathers every rank's RNG state and writes on rank 0. Loading maps every tensor to the
CPU and lets ``load_state_dict`` place it: the model's tensors are copied onto the model's device, while AdamW's
``step`` counters stay on the CPU where AdamW keeps them (on a GPU they would cost host syncs).

The ZeRO step kinds (``parallel=zero1|zero2|zero3``, app.worker.steps.zero) hand over a ``ShardedState`` instead:
their checkpoint is ``app.parallel.zero.checkpoint``'s, one shard per rank and ``manifest.json`` in a directory of
its own per save (``checkpoint_dir/sharded-step-00000060/``, app.checkpoint_dir), the step, the sampler position, the
RNG states, generation, wall time and global batch in the manifest's ``extra``. It resumes on any world size (the
shards are cut again); a checkpoint of another stage or model is a ``CheckpointMismatch`` (exit 2) before anything
is loaded or written, shards that do not match their manifest a damaged checkpoint (the previous one is tried).
Both kinds count together towards ``keep`` (``app.checkpoint_dir.prune``, rank 0, once a save is complete).

Across kinds: a ZeRO stage resumes a plain ``step-*.pt`` (every rank reads it whole and keeps its shard), and plain
DDP resumes a sharded checkpoint (every rank consolidates it, one shard file at a time): ddp -> zero3 -> ddp, on any
world size. The pipeline's checkpoints resume under the pipeline only.

Try it: ``make run`` with ``DDP_CHECKPOINT_DIR=/tmp/ckpt``, stop it with Ctrl-C, run it again: it resumes.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from app.checkpoint_dir import MANIFEST, SHARDED, Found, find_checkpoints, prune, set_aside, sharded_path
from app.parallel.zero.checkpoint import (
    CheckpointError,
    DamagedCheckpoint,
    ShardWriteError,
    consolidate,
    load_sharded,
    save_sharded,
)
from app.worker.checkpoint.files import copy_out, load_checkpoint, release, save_checkpoint, unusable_reason
from app.worker.checkpoint.weights import WeightsError, consolidated_from_plain, plain_optimizer_state

log = logging.getLogger(__name__)


class CheckpointWriteError(OSError):
    """Rank 0 could not write a checkpoint (no space, no permission, a read-only or vanished file system).

    Raised on every rank together (the outcome is broadcast), so the world stops at one step with one line naming
    the directory and the cause, instead of rank 0's traceback and its peers' "a peer went away". The previous
    checkpoint is untouched: the write goes to a temporary file that is removed on failure.
    """


class CheckpointMismatch(ValueError):
    """The checkpoint directory holds another run's checkpoints (a configuration problem: exit code 2)."""


@dataclass
class ShardedState:
    """A ZeRO step kind's model *and* optimizer, as the Checkpointer receives them (for both ``model`` and
    ``optimizer``): saved and loaded as shards by every rank, never as one ``state_dict`` on rank 0."""

    model: Any  # the wrapper (our DDP for stage 1, ShardedGradDataParallel, FullyShardedDataParallel)
    optimizer: Any
    parallel: str  # zero1 | zero2 | zero3: named in the errors


PROGRESS_FILE = "progress.json"  # the last step rank 0 logged: how many steps a resume trains again


@dataclass
class Resumed:
    """What a resume found: the step trained up to, and what the world that wrote it knew."""

    step: int
    path: Path
    world_size: int  # the world that wrote it
    epoch: int
    generation: int  # worlds formed before this one
    wall_time: float | None  # unix time it was written (None in older files)
    global_batch: int | None
    steps_redone: int | None  # steps the lost world had trained past it (None: not known)


class Checkpointer:
    """Resume, cadence, RNG state and the final save of one training run; every rank holds one.

    Args:
        directory: checkpoint_dir ("" = checkpoints off: ``resume`` finds nothing, ``should_save`` is False).
        every: save every this many steps (and on the final step or a stop: ``should_save(step, final=True)``).
        keep: checkpoints kept on disk.
        ctx: this rank's ``DistContext``; rank 0 reads and writes, every rank joins the collectives.
        model, optimizer, batches: what is saved and restored (the *unwrapped* model).
        lr_schedule, grad_scaler: two more ``Stateful``s, or None (saved as ``lr_scheduler`` / ``grad_scaler``; a
            checkpoint without them, written before they existed, still loads: the schedule is put at its step).
        model_name, seed, lr, global_batch: recorded in the file / applied on resume.

    Example::

        ckpt = Checkpointer("/tmp/ckpt", every=50, keep=3, ctx=ctx, model=model, optimizer=opt, batches=batches,
                            model_name="mini_mlp", seed=0, lr=3e-3, global_batch=128)
        resumed = ckpt.resume()             # None on a fresh start
        ...
        if ckpt.should_save(step, final=step == steps):
            ckpt.save(step)                 # every rank calls it; rank 0 writes
    """

    def __init__(
        self,
        directory: str,
        *,
        every: int,
        keep: int,
        ctx,
        model,
        optimizer,
        batches,
        model_name: str,
        seed: int,
        lr: float,
        global_batch: int,
        lr_schedule=None,
        grad_scaler=None,
    ):
        self.directory, self.every, self.keep, self.ctx = directory, every, keep, ctx
        self.lr_schedule, self.grad_scaler = lr_schedule, grad_scaler
        self.model, self.optimizer, self.batches = model, optimizer, batches
        self.model_name, self.seed, self.lr, self.global_batch = model_name, seed, lr, global_batch
        self.generation = 1  # this world is the job's first, unless a checkpoint says otherwise

    # -- resume -----------------------------------------------------------------------------------------------------
    def resume(self) -> Resumed | None:
        """Every rank loads the newest checkpoint of either kind that loads (a broadcast: all must call).

        Rank 0 lists the candidates, so every rank tries the same ones in the same order even if a file changes
        while they look. One that is damaged or incomplete is skipped with a warning naming it and why (set aside as
        ``.corrupt`` when damaged, as ``files.load_latest`` does) and the previous one is tried; one that belongs to
        another run (model, stage, pipeline) stops the run with ``CheckpointMismatch`` instead.
        """
        if not self.directory:
            return None
        listed = [find_checkpoints(self.directory, incomplete=True) if self.ctx.is_main else None]
        dist.broadcast_object_list(listed, src=0)
        for found in listed[0]:
            resumed = self._resume_from(found)
            if resumed is not None:
                return resumed
        return None

    def _resume_from(self, found: Found) -> Resumed | None:
        """Load ``found`` on every rank, or None (every rank together) when it is damaged or incomplete."""
        if not found.complete:
            if self.ctx.is_main:
                log.warning(
                    "skipping %s: no %s, its save did not finish; trying the previous one", found.path, MANIFEST
                )
            return None
        sharded = self.model if isinstance(self.model, ShardedState) else None
        try:
            if found.kind == SHARDED:
                return self._load_sharded(sharded, found) if sharded else self._consolidate_sharded(found)
            state = self._read_plain(found)
            if state is None:
                return None
            return self._plain_into_shards(sharded, state, found.path) if sharded else self._load_plain(state, found)
        except DamagedCheckpoint as e:  # raised on every rank together: all move on to the previous one
            if self.ctx.is_main:
                aside = set_aside(found)
                log.warning("checkpoint %s is unusable (%s); %s; trying the previous one", found.path, e, aside)
            return None

    def _read_plain(self, found: Found) -> dict[str, Any] | None:
        """Rank 0 validates the file and says whether it loads; each peer then reads it too (None: it did not)."""
        state, reason = None, None
        if self.ctx.is_main:
            try:
                state = load_checkpoint(found.path, mapped=True)  # the tensors copied out one by one (_load_plain)
            except Exception as e:  # noqa: BLE001 - any failure to read means "unusable": fall back to the previous
                reason = unusable_reason(e)
        verdict = [reason]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            if self.ctx.is_main:
                aside = set_aside(found)
                log.warning("checkpoint %s is unusable (%s); %s; trying the previous one", found.path, reason, aside)
            return None
        return state if state is not None else self._load_on_peer(found.path)

    def _load_plain(self, state: dict[str, Any], found: Found) -> Resumed:
        self._check_model_name(state["model_name"])
        if "pipeline_stages" in state["optimizer"] and isinstance(self.optimizer, torch.optim.Optimizer):
            raise CheckpointMismatch(
                f"checkpoint_dir={self.directory!r} holds a {state['optimizer']['pipeline_stages']}-stage pipeline's "
                f"checkpoints (parallel=pipeline); resume with parallel=pipeline, or use another checkpoint_dir"
            )
        # The file is mapped, not loaded (files.load_checkpoint): each tensor's pages are dropped once copied, so
        # the model is never held twice (see [Note: a plain checkpoint loaded beside the model]).
        self.model.load_state_dict(state["model"])  # copies onto the model's device
        for tensor in state["model"].values():
            release(tensor)
        # Copied out of the file first: load_state_dict keeps the tensors it is given (AdamW's `step` too).
        self.optimizer.load_state_dict(copy_out(state["optimizer"]))
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr  # the configured lr wins over the saved one: changing it on resume is allowed
        step = int(state["step"])
        self._restore_recipe(state, step)
        self.batches.load_state_dict(state["data"])
        self._restore_rng(state["rng"], step)
        return self._resumed(state, step, found.path)

    def _recipe_state(self) -> dict[str, Any]:
        """The schedule's and the GradScaler's states, where the kind has them (small, JSON-able: the manifest)."""
        pairs = (("lr_scheduler", self.lr_schedule), ("grad_scaler", self.grad_scaler))
        return {key: stateful.state_dict() for key, stateful in pairs if stateful is not None}

    def _restore_recipe(self, state: dict[str, Any], step: int) -> None:
        if self.lr_schedule is not None:
            # The schedule is a function of the step index with the *configured* lr as its base (LRSchedule), so a
            # changed lr still wins; a checkpoint from before schedules existed needs only its step.
            self.lr_schedule.load_state_dict(state.get("lr_scheduler") or {"last_epoch": step})
        if self.grad_scaler is not None and state.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state["grad_scaler"])  # else a fresh scale (e.g. the run was bf16)

    def _resumed(self, state: dict[str, Any], step: int, path: Path) -> Resumed:
        self.generation = int(state.get("generation", 1)) + 1
        last_seen = self._last_seen_step()
        return Resumed(
            step=step,
            path=path,
            world_size=int(state["world_size"]),
            epoch=int(state["data"]["epoch"]),
            generation=self.generation - 1,
            wall_time=state.get("wall_time"),
            global_batch=state.get("global_batch"),
            steps_redone=last_seen - step if last_seen is not None and last_seen > step else None,
        )

    def _load_sharded(self, sharded: ShardedState, found: Found) -> Resumed:
        """Every rank loads its part of the sharded checkpoint (collective), cut for this world's size."""
        try:
            # Raises on every rank, before anything is changed: DamagedCheckpoint for damaged files (the caller
            # falls back), CheckpointError for another stage or model.
            extra = load_sharded(found.path, sharded.model, sharded.optimizer)
        except DamagedCheckpoint:
            raise
        except CheckpointError as e:
            raise CheckpointMismatch(f"checkpoint_dir={self.directory!r}: {e}") from None
        self._check_model_name(extra.get("model_name"))
        for group in sharded.optimizer.param_groups:
            group["lr"] = self.lr  # the configured lr wins, as for a plain checkpoint
        return self._restore_extra(extra, found.named)

    def _restore_extra(self, extra: dict[str, Any], path: Path) -> Resumed:
        """What a checkpoint saves beside the model and optimizer: the schedule, data position and RNG streams."""
        step = int(extra["step"])
        self._restore_recipe(extra, step)
        self.batches.load_state_dict(extra["data"])
        rng = {
            kind: [_decode_rng(s) if isinstance(s, str) else s for s in states] for kind, states in extra["rng"].items()
        }
        self._restore_rng(rng, step)
        return self._resumed(extra, step, path)

    # -- resume across kinds: a plain checkpoint under ZeRO, a sharded one under plain DDP -------------------------
    def _plain_into_shards(self, sharded: ShardedState, state: dict[str, Any], path: Path) -> Resumed:
        """A ZeRO stage resumes a ``step-*.pt``: every rank has read it whole and keeps its shard. Costs the whole
        state in memory once on every rank, as the plain run that wrote it held it."""
        self._check_model_name(state.get("model_name"))
        try:
            whole = consolidated_from_plain(state)
            extra = load_sharded(path, sharded.model, sharded.optimizer, source=whole)
        except (WeightsError, CheckpointError) as e:
            raise CheckpointMismatch(
                f"checkpoint_dir={self.directory!r}: {path.name} cannot resume under "
                f"parallel={sharded.parallel}: {e}; resume with parallel=ddp"
            ) from None
        for group in sharded.optimizer.param_groups:
            group["lr"] = self.lr
        log.info(
            "resuming parallel=%s from the plain checkpoint %s (cut into this world's shards)", sharded.parallel, path
        )
        return self._restore_extra(extra, path)

    def _consolidate_sharded(self, found: Found) -> Resumed:
        """Plain DDP resumes a ZeRO stage's sharded checkpoint: every rank consolidates it (one shard at a time)."""
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise CheckpointMismatch(
                f"checkpoint_dir={self.directory!r} holds a sharded checkpoint (parallel=zero1|zero2|zero3, "
                f"{found.named}); resume it with a zero stage or parallel=ddp, or use another checkpoint_dir"
            )
        whole, error = None, None
        try:
            whole = consolidate(found.path)
        except CheckpointError as e:
            error = (str(e), isinstance(e, DamagedCheckpoint))
        errors = [None] * self.ctx.world_size
        dist.all_gather_object(errors, error)  # each rank read it alone: all fall back, or all load
        if (first := next((e for e in errors if e), None)) is not None:
            if first[1]:
                raise DamagedCheckpoint(first[0])
            raise CheckpointMismatch(f"checkpoint_dir={self.directory!r}: {first[0]}")
        self._check_model_name(whole.extra.get("model_name"))
        self.model.load_state_dict(whole.model)
        self.optimizer.load_state_dict(plain_optimizer_state(whole, self.model, self.optimizer))
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        log.info("resuming from the sharded checkpoint %s (consolidated on every rank)", found.path)
        return self._restore_extra(whole.extra, found.named)

    def _check_model_name(self, name: str | None) -> None:
        if name != self.model_name:
            raise CheckpointMismatch(
                f"checkpoint_dir={self.directory!r} holds {name} checkpoints but model={self.model_name}; use another "
                f"checkpoint_dir or model"
            )

    def _load_on_peer(self, path: Path) -> dict[str, Any]:
        try:
            return load_checkpoint(path, mapped=True)
        except Exception as e:  # noqa: BLE001 - whatever the cause, the message must name the shared storage
            raise RuntimeError(
                f"rank {self.ctx.rank} cannot read {path}, which rank 0 resumes from ({unusable_reason(e)}); "
                f"checkpoint_dir must be storage shared by all ranks"
            ) from None

    def _restore_rng(self, rng: dict[str, list], step: int) -> None:
        ctx = self.ctx
        if len(rng["cpu"]) == ctx.world_size:
            torch.set_rng_state(rng["cpu"][ctx.rank].cpu())
            if ctx.device.type == "cuda" and rng.get("cuda"):
                torch.cuda.set_rng_state(rng["cuda"][ctx.rank].cpu(), ctx.device)
        else:  # a different world size: rank r's old stream has no meaning; derive a fresh one per rank and step
            torch.manual_seed(self.seed + ctx.rank + 1_000_003 * step)

    def _last_seen_step(self) -> int | None:
        try:
            return int(json.loads((Path(self.directory) / PROGRESS_FILE).read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # -- save -------------------------------------------------------------------------------------------------------
    def should_save(self, step: int, *, final: bool = False) -> bool:
        """A save is due at every ``every``-th step, and at the final step or a stop (``final``)."""
        return bool(self.directory) and (final or step % self.every == 0)

    def save(self, step: int) -> tuple[Path, float] | None:
        """Gather every rank's RNG state and write on rank 0; returns (path, seconds) on rank 0, else None.

        Every rank must call it (the RNG states are gathered with a collective).
        """
        ctx = self.ctx
        cpu = [None] * ctx.world_size
        dist.all_gather_object(cpu, torch.get_rng_state())  # every rank's stream, for an exact resume
        cuda = [None] * ctx.world_size
        if ctx.device.type == "cuda":
            dist.all_gather_object(cuda, torch.cuda.get_rng_state(ctx.device))
        if isinstance(self.model, ShardedState):
            return self._save_sharded(self.model, step, cpu, cuda)
        written, failure = None, None
        if ctx.is_main:
            try:
                written = self._write(step, cpu, cuda)
            except OSError as e:
                failure = f"checkpoint_dir {self.directory} could not take the checkpoint of step {step}: " + (
                    f"{e.strerror or type(e).__name__} ({errno.errorcode.get(e.errno, e.errno)}). Free space or fix "
                    f"the permissions, or point checkpoint_dir elsewhere. {self.last_good()}"
                )
        verdict = [failure]
        dist.broadcast_object_list(verdict, src=0)  # one outcome for the world: every rank stops, or none
        if verdict[0] is not None:
            raise CheckpointWriteError(verdict[0])
        return written

    def _write(self, step: int, cpu: list, cuda: list) -> tuple[Path, float]:
        ctx = self.ctx
        t0 = time.perf_counter()
        state = {
            "step": step,
            "model_name": self.model_name,
            "world_size": ctx.world_size,
            "model": self.model.state_dict(),  # the bare model, never the wrapper: loads without DDP
            "optimizer": self.optimizer.state_dict(),
            "param_names": self._optimizer_param_names(),  # what a ZeRO stage needs to resume it by name
            "data": self.batches.state_dict(),
            "rng": {"cpu": cpu, "cuda": cuda if ctx.device.type == "cuda" else []},
            "generation": self.generation,
            "wall_time": time.time(),
            "global_batch": self.global_batch,
        }
        state |= self._recipe_state()
        path = save_checkpoint(self.directory, state, keep=self.keep)
        return path, time.perf_counter() - t0

    def _optimizer_param_names(self) -> list[str] | None:
        """The name of each parameter the optimizer holds, in its order (None: a kind without one plain optimizer)."""
        if not isinstance(self.optimizer, torch.optim.Optimizer) or not isinstance(self.model, torch.nn.Module):
            return None
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names.get(id(p), "") for group in self.optimizer.param_groups for p in group["params"]]

    def _save_sharded(self, sharded: ShardedState, step: int, cpu: list, cuda: list) -> tuple[Path, float] | None:
        """Every rank writes its shard, rank 0 the manifest with what ``save`` puts in a plain checkpoint."""
        t0 = time.perf_counter()
        extra = {
            "step": step,
            "model_name": self.model_name,
            "parallel": sharded.parallel,
            "world_size": self.ctx.world_size,
            "data": self.batches.state_dict(),
            # base64 of the raw bytes: the manifest is JSON
            "rng": {"cpu": [_encode_rng(t) for t in cpu], "cuda": [_encode_rng(t) for t in cuda if t is not None]},
            "generation": self.generation,
            "wall_time": time.time(),
            "global_batch": self.global_batch,
        } | self._recipe_state()
        directory = sharded_path(self.directory, step)
        try:
            save_sharded(directory, sharded.model, sharded.optimizer, extra=extra)
        except ShardWriteError as e:  # on every rank together: the same one line as a plain checkpoint's
            raise CheckpointWriteError(
                f"checkpoint_dir {self.directory} could not take the checkpoint of step {step}: {e.cause}, writing "
                f"{e.where}. Free space or fix the permissions, or point checkpoint_dir elsewhere. {self.last_good()}"
            ) from None
        if not self.ctx.is_main:
            return None
        prune(self.directory, self.keep, newest=step)  # save_sharded returned: every shard and the manifest are on disk
        return directory / MANIFEST, time.perf_counter() - t0

    def note_progress(self, step: int) -> None:
        """Rank 0 records the last step it reached (cheap, not fsynced: losing it only loses a statistic)."""
        if not (self.directory and self.ctx.is_main):
            return
        d = Path(self.directory)
        tmp = d / f".{PROGRESS_FILE}.tmp-{os.getpid()}"
        try:
            tmp.write_text(json.dumps({"step": step}))
            os.replace(tmp, d / PROGRESS_FILE)
        except OSError:
            tmp.unlink(missing_ok=True)

    def last_good(self) -> str:
        found = find_checkpoints(self.directory) if self.directory else []
        return f"Last good checkpoint kept: {found[0].named}." if found else "No checkpoint was written."


def _encode_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def _decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
