"""Sharded checkpoints for ZeRO stages 1-3: each rank writes its own shard; any world size can load them.

A ZeRO rank holds 1/N of the optimizer state (and, in stage 3, of the parameters). Gathering all of it onto rank 0
to save it would need on one rank the very memory sharding saved, so each rank writes what it holds:

    directory/                       the worker's: checkpoint_dir/sharded-step-00000060/ (app.checkpoint_dir)
      shard-00000-of-00004-<id>.pt   rank 0's pieces (+ the replicated tensors: buffers, frozen parameters)
      ...
      shard-00003-of-00004-<id>.pt   (<id>: fresh for each save, so a save never overwrites the files in use)
      shard-00003-of-00004-<id>-1.pt a rank's shard in more than one file when it holds over SHARD_FILE_BYTES
      manifest.json             written last, by rank 0: world size, stage, per file its rank, part, sha256 digest
                                and which elements [lo, hi) of which parameter it holds; the parameters' shapes

A *piece* is elements ``[lo, hi)`` of one parameter, flattened, with the same elements of each optimizer-state
tensor (AdamW's ``exp_avg``, ``exp_avg_sq``); 0-dim state (``step``) travels as it is. Stage 1 pieces are whole
parameters, stage 2/3 pieces are the parts of parameters inside a rank's chunk of a bucket or unit. Pieces are
named by the bare model's parameter names, so the layout on load need not match the layout on save: on 3 ranks,
each rank reads the pieces overlapping what it now holds, from whichever of the 4 files have them (one file at a
time: no rank ever holds more than a few shards' worth of state).

Every file is written atomically (app.files: temporary file, fsync, rename, directory fsync) and the manifest only
after every shard is on disk, so a crash mid-save leaves a directory without a manifest (no checkpoint: the worker
resumes from the one before) or, saving again into one that had a manifest, the old manifest (whose digests then
reject the new files). Nothing is copied to save it, nor held twice to load it. Anything wrong on load raises a
one-line ``CheckpointError``; ``DamagedCheckpoint`` when the files are what is wrong (a changed or missing shard, no
readable manifest), so that an older checkpoint may load, rather than the checkpoint being another run's.

    save_sharded(directory, model, optimizer, extra={"step": step})   # on every rank, collectively
    extra = load_sharded(directory, model, optimizer)                  # on every rank, any world size
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from app.checkpoint_dir import MANIFEST
from app.cli import first_line
from app.files import write_atomically
from app.parallel.zero.stage1 import ZeroRedundancyOptimizer, runs_within
from app.parallel.zero.stage2 import ShardedGradDataParallel
from app.parallel.zero.stage3 import FullyShardedDataParallel

FORMAT = "ddp-cluster.sharded-checkpoint.v1"
# The most tensor bytes in one file of a rank's shard: a loading rank holds one file at a time beside the state it
# fills, so its peak grows by this much, not by the whole shard (a sixth to a half of the model's state).
SHARD_FILE_BYTES = 64 * 2**20


class CheckpointError(Exception):
    """A sharded checkpoint that cannot be loaded here: another stage, a changed file, a missing piece."""


class DamagedCheckpoint(CheckpointError):
    """The checkpoint's files are damaged or incomplete (no readable manifest, a shard changed or missing, pieces
    that do not cover the model): not a mismatch with this run, so an older checkpoint may still load."""


class ShardWriteError(CheckpointError):
    """A save the disk did not take (no space, no permission), raised on every rank together.

    ``where`` names the file and the rank that failed first, ``cause`` the system's reason with its errno name
    ("No space left on device (ENOSPC)"). Nothing of the failed save is left behind; the previous manifest, and the
    shards it lists, are untouched.
    """

    def __init__(self, where: str, cause: str):
        super().__init__(f"{where}: cannot write ({cause}); no manifest written, the previous checkpoint is whole")
        self.where, self.cause = where, cause


def _why(e: OSError) -> str:
    return f"{e.strerror or type(e).__name__} ({errno.errorcode.get(e.errno, e.errno)})"


def stage_of(model: nn.Module, optimizer) -> int:
    """1, 2 or 3: which ZeRO stage ``model``/``optimizer`` are."""
    if isinstance(model, FullyShardedDataParallel):
        return 3
    if isinstance(model, ShardedGradDataParallel):
        return 2
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return 1
    raise CheckpointError(
        f"{type(model).__name__} with {type(optimizer).__name__}: not sharded; use app.worker.checkpoint for plain DDP"
    )


def _entries(model: nn.Module, optimizer, stage: int) -> tuple[list, dict]:
    """``[(tensor the optimizer keys state by, its flat values, [(name, shape, lo, hi, offset)])]`` held by this
    rank, and that optimizer's state dict (by tensor)."""
    if stage == 1:
        names = {id(p): n for n, p in _bare(model).named_parameters()}
        out = [
            (p, p.detach().view(-1), [(names[id(p)], tuple(p.shape), 0, p.numel(), 0)])
            for p in optimizer.owned_parameters()
        ]
        return out, optimizer.optim.state
    out = []
    for flat, shard in model.flat_shards():
        pieces = [(flat.names[i], flat.shapes[i], lo, hi, off) for i, lo, hi, off in flat.pieces()]
        out.append((shard, shard.detach(), pieces))
    return out, optimizer.state


def _bare(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def _sharded_names(model: nn.Module, optimizer, stage: int) -> set[str]:
    """Every name (tied parameters have several) of the parameters that travel as pieces."""
    if stage == 1:
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    else:
        ids = {id(p) for flat, _ in model.flat_shards() for p in flat.params}
    return {n for n, p in _bare(model).named_parameters(remove_duplicate=False) if id(p) in ids}


class _Hashing:
    """A file that hashes what is written through it: the shard's digest without its bytes held in memory."""

    def __init__(self, f):
        self.f, self.sha256, self.flush = f, hashlib.sha256(), f.flush

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)


def _save_hashed(obj, f) -> str:
    """``torch.save(obj)`` into ``f``; the sha256 of what was written."""
    torch.save(obj, hashing := _Hashing(f))
    return hashing.sha256.hexdigest()


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, in a storage of its own size: ``torch.save`` writes a view's *whole* storage (stage 2's shard is a
    view of its bucket), and views of a compact tensor share its one storage, written once."""
    t = t.detach().reshape(-1)
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


def save_sharded(directory, model: nn.Module, optimizer, extra: dict | None = None, process_group=None) -> None:
    """Every rank writes its shard; rank 0 then writes the manifest. Collective: call it on every rank."""
    directory = Path(directory)
    stage = stage_of(model, optimizer)
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    entries, state = _entries(model, optimizer, stage)
    # Pieces are views sharing the shard's storage, written once: a save costs no copy of the state (_compact).
    pieces = {}
    for key, values, slices in entries:
        values = _compact(values)
        tensors_of, scalars = {}, {}
        for k, v in state.get(key, {}).items():
            if isinstance(v, torch.Tensor) and v.numel() == values.numel() and v.dim() > 0:
                tensors_of[k] = _compact(v)
            else:
                scalars[k] = v
        for name, _shape, lo, hi, off in slices:
            tensors = {"param": values[off : off + hi - lo]}
            tensors |= {k: v[off : off + hi - lo] for k, v in tensors_of.items()}
            pieces[name] = {"lo": lo, "hi": hi, "tensors": tensors, "scalars": dict(scalars)}
    payloads = [{"pieces": part} for part in _files_of(pieces, SHARD_FILE_BYTES)]
    if rank == 0:  # buffers and frozen parameters: the same on every rank, stored once, in rank 0's first file
        sharded = _sharded_names(model, optimizer, stage)
        payloads[0]["replicated"] = {
            k: v.detach().clone() for k, v in _bare(model).state_dict().items() if k not in sharded
        }
    # Looked at before the broadcast below, which no rank passes before rank 0 sends: nobody has created it yet.
    created = rank == 0 and not directory.exists()  # a failed save removes it again: nothing of it is left
    # A fresh name per save: the files of the checkpoint the current manifest describes are never overwritten,
    # so until the new manifest replaces it, the old checkpoint stays whole.
    token = [os.urandom(4).hex() if rank == 0 else None]
    dist.broadcast_object_list(
        token, src=dist.get_global_rank(process_group, 0) if process_group else 0, group=process_group
    )
    names = [f"shard-{rank:05d}-of-{world:05d}-{token[0]}{f'-{k}' if k else ''}.pt" for k in range(len(payloads))]
    mine = _write_shard_files(directory, names, payloads, rank)
    shards = [None] * world
    dist.all_gather_object(shards, mine, group=process_group)  # every rank learns whether every shard is on disk
    failed = next((s for s in shards if isinstance(s, tuple)), None)
    if failed is None and rank == 0:
        listed = [entry for files in shards for entry in files]
        failed = _write_manifest(directory, model, optimizer, stage, world, extra, listed)
    verdict = [failed]  # rank 0's manifest too: a rank that failed alone would leave the others at the barrier
    dist.broadcast_object_list(
        verdict, src=dist.get_global_rank(process_group, 0) if process_group else 0, group=process_group
    )
    if verdict[0] is not None:
        for name in names:
            (directory / name).unlink(missing_ok=True)  # the space it took, for the next try; no manifest lists it
        dist.barrier(group=process_group)  # every rank's file gone before rank 0 removes the directory
        if created:
            with contextlib.suppress(OSError):  # not empty (another writer's file): then it stays
                directory.rmdir()
        raise ShardWriteError(*verdict[0])
    dist.barrier(group=process_group)  # nobody returns before the checkpoint is complete


def _files_of(pieces: dict, limit_bytes: int) -> list[dict]:
    """``pieces`` cut into the files of one rank's shard, each of at most ``limit_bytes`` of tensors (a larger piece
    alone), at least one: a rank that loads them holds one file at a time, not its whole shard."""

    def tensor_bytes(item) -> int:
        return sum(t.numel() * t.element_size() for t in item[1]["tensors"].values())

    return [dict(run) for run in runs_within(list(pieces.items()), limit_bytes, tensor_bytes)] or [{}]


def _write_shard_files(directory: Path, names: list[str], payloads: list[dict], rank: int) -> list[dict] | tuple:
    """This rank's files, each written atomically; their manifest entries, or (where, cause) if the disk refused."""
    entries = []
    for part, (name, payload) in enumerate(zip(names, payloads, strict=True)):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            digest = write_atomically(directory / name, lambda f, p=payload: _save_hashed(p, f))
        except OSError as e:
            return f"{directory / name} (rank {rank})", _why(e)
        pieces = {n: [p["lo"], p["hi"]] for n, p in payload["pieces"].items()}
        entries.append({"rank": rank, "part": part, "file": name, "sha256": digest, "pieces": pieces})
    return entries


def _write_manifest(directory: Path, model, optimizer, stage: int, world: int, extra, shards) -> tuple | None:
    """Rank 0: the manifest, then the earlier saves' shards removed; (where, cause) if the disk refused it."""
    manifest = {
        "format": FORMAT,
        "stage": stage,
        "world_size": world,
        "params": _param_shapes(model, stage),
        "units": _units(model, stage),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "extra": extra or {},
        "shards": shards,
    }
    try:
        text = json.dumps(manifest, indent=1, default=str).encode()
        write_atomically(directory / MANIFEST, lambda f: f.write(text))
    except OSError as e:
        return f"{directory / MANIFEST} (rank 0)", _why(e)
    listed = {s["file"] for s in shards}
    for old in directory.glob("shard-*.pt"):
        if old.name not in listed:
            old.unlink()  # an earlier save's shards: no manifest points at them any more
    return None


def _param_shapes(model: nn.Module, stage: int) -> dict:
    if stage == 1:
        return {n: list(p.shape) for n, p in _bare(model).named_parameters()}
    return {n: list(s) for flat, _ in model.flat_shards() for n, s in zip(flat.names, flat.shapes)}


def _units(model: nn.Module, stage: int) -> list:
    """Stage 2/3: each bucket's/unit's parameters and their offsets in its flat buffer (for a reader)."""
    if stage == 1:
        return []
    return [{"names": f.names, "offsets": f.offsets, "numel": f.total} for f, _ in model.flat_shards()]


def read_manifest(directory) -> dict:
    """The manifest, checked for format; ``CheckpointError`` if absent or unreadable."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{path}: no manifest (not a sharded checkpoint, or its save did not finish)") from None
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(f"{path}: unreadable manifest ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _check_shard(directory: Path, shard: dict) -> None:
    """``DamagedCheckpoint`` unless the file of ``shard`` has the manifest's digest (hashed in blocks, not loaded)."""
    path = directory / shard["file"]
    sha256 = hashlib.sha256()
    try:
        with open(path, "rb") as f:  # hashed in blocks: the file's bytes are never held whole
            while block := f.read(1 << 20):
                sha256.update(block)
    except OSError as e:
        raise DamagedCheckpoint(f"{path}: listed in the manifest but unreadable ({e.strerror})") from None
    digest = sha256.hexdigest()
    if digest != shard["sha256"]:
        raise DamagedCheckpoint(
            f"{path}: sha256 {digest[:12]}... does not match the manifest's {shard['sha256'][:12]}...: the file "
            f"changed after the manifest was written (an interrupted save?); use another checkpoint"
        )


def _load_shard(directory: Path, shard: dict) -> dict:
    """A shard file's payload, once ``_check_shard`` passed it. Read a second time, from the page cache: shard names
    are fresh per save, no save rewrites a file in place."""
    return torch.load(directory / shard["file"], map_location="cpu", weights_only=True)


def _read_shard(directory: Path, shard: dict) -> dict:
    _check_shard(directory, shard)
    return _load_shard(directory, shard)


def load_sharded(directory, model: nn.Module, optimizer, process_group=None, source: Consolidated | None = None):
    """Load a checkpoint from ``save_sharded`` onto this world (any size); returns the ``extra`` saved with it.

    Collective. Raises ``CheckpointError`` (on every rank, before anything is changed) on a checkpoint from
    another stage, a shard whose digest differs from the manifest's, or a parameter the checkpoint lacks.
    ``source``: a whole (consolidated) state instead of the files in ``directory`` (then only named in errors): a
    plain checkpoint resumed by a ZeRO stage, read as if one rank had saved it under this stage.
    """
    directory = Path(directory)
    try:
        manifest, read = (read_manifest(directory), None) if source is None else source.as_manifest(model, optimizer)
        plan = _check_for_this_rank(directory, model, optimizer, manifest, read)
        error = None
    except Exception as e:  # noqa: BLE001 (any rank's failure must reach every rank, or the others would hang)
        error = _error_of(directory, e)
    _agree(error, process_group)  # all ranks checked what they need, or none changes anything
    try:
        buffers, scalars = _fill(plan, read or (lambda shard: _load_shard(directory, shard)))
        error = None
    except Exception as e:  # noqa: BLE001 (as above)
        error = _error_of(directory, e)
        error = (f"{error[0]}; read after its check, so this rank's parameters are partly loaded: restart", False)
    _agree(error, process_group)
    _install(plan.entries, plan.state, buffers, scalars)
    for group, saved in zip(optimizer.param_groups, manifest["param_groups"]):
        # JSON turned tuples (AdamW's betas) into lists: give them back their type.
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
    _load_replicated(model, optimizer, plan.stage, plan.replicated)
    _resync(model, optimizer, plan.stage)
    return manifest.get("extra", {})


def _error_of(directory: Path, e: Exception) -> tuple[str, bool]:
    """``(message, damaged)`` of a failure to load, for ``_agree``."""
    if not isinstance(e, CheckpointError):
        return f"{directory}: {type(e).__name__}: {e}", False
    return str(e), isinstance(e, DamagedCheckpoint)


def _agree(error: tuple[str, bool] | None, process_group) -> None:
    """Raise ``CheckpointError`` on every rank if any rank failed (the lowest rank's message; ``DamagedCheckpoint``
    if that rank found the files damaged). ``error``: this rank's (message, damaged), or None."""
    errors = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(errors, error, group=process_group)
    if (first := next((e for e in errors if e), None)) is not None:
        message, damaged = first
        raise (DamagedCheckpoint if damaged else CheckpointError)(first_line(message))


@dataclass
class _LoadPlan:
    """What one rank loads, checked: its entries (``_entries``), the optimizer's state dict, and per file it needs
    the names of the pieces it takes from it; what each name needs ``(lo, hi)`` and where it goes."""

    stage: int
    entries: list
    state: dict
    files: list  # [(shard entry of the manifest, [names])]
    needed: dict
    where: dict
    replicated: dict


def _check_for_this_rank(directory: Path, model: nn.Module, optimizer, manifest: dict, read=None) -> _LoadPlan:
    """Check everything this rank will load, and change nothing: the stage, the shapes, each file it needs against
    its digest (hashed, not loaded), that the files' pieces cover what it holds, rank 0's replicated tensors.

    [Note: a sharded load installs straight from the files] Nothing is loaded into a staging copy to be installed
    once every rank has read its part (a second copy of this rank's parameters): every rank checks first, all agree,
    then each file is loaded again (from the page cache) and its pieces copied into the parameters in place, one file
    at a time. ``read(shard)``: a shard's payload (None: its file in ``directory``)."""
    stage = stage_of(model, optimizer)
    if manifest["stage"] != stage:
        raise CheckpointError(
            f"{directory}: saved by ZeRO stage {manifest['stage']}, this run is stage {stage}; resume with the "
            f"stage it was saved with"
        )
    entries, state = _entries(model, optimizer, stage)
    _check_shapes(directory, manifest, entries)
    needed = {name: (lo, hi) for _, _, slices in entries for name, _, lo, hi, _ in slices}
    covered = dict.fromkeys(needed, 0)
    where = {name: (e, lo, off) for e, (_, _, slices) in enumerate(entries) for name, _, lo, _, off in slices}
    files, replicated = [], None
    for shard in manifest["shards"]:
        overlaps = [n for n, (lo, hi) in shard["pieces"].items() if n in needed and _overlap((lo, hi), needed[n])]
        if shard["rank"] == 0 and shard.get("part", 0) == 0:  # rank 0's first file: the replicated tensors
            replicated = (read or (lambda s: _read_shard(directory, s)))(shard).get("replicated", {})
        elif not overlaps:
            continue  # a file with nothing for this rank is never read
        elif read is None:
            _check_shard(directory, shard)
        for name in overlaps:
            lo, hi = shard["pieces"][name]
            covered[name] += min(hi, needed[name][1]) - max(lo, needed[name][0])
        if overlaps:
            files.append((shard, overlaps))
    for name, (lo, hi) in needed.items():
        if covered[name] != hi - lo:
            raise DamagedCheckpoint(
                f"{directory}: the shards hold {covered[name]} of elements [{lo}, {hi}) of {name!r}: the manifest "
                f"does not match its files"
            )
    sharded = _sharded_names(model, optimizer, stage)
    for key in _bare(model).state_dict():
        if key not in sharded and key not in (replicated or {}):
            raise CheckpointError(f"{directory}: rank 0's shard lacks {key!r} (a buffer or frozen parameter)")
    return _LoadPlan(stage, entries, state, files, needed, where, replicated or {})


def _fill(plan: _LoadPlan, load) -> tuple[list[dict], list[dict]]:
    """Copy each piece this rank takes into its parameters, and its optimizer state into new buffers, one file at a
    time (``load(shard)``: the file's payload); returns the buffers and scalars, per entry."""
    buffers: list[dict] = [{} for _ in plan.entries]
    scalars: list[dict] = [{} for _ in plan.entries]
    for shard, names in plan.files:
        payload = load(shard)
        for name in names:
            _copy_piece(payload["pieces"][name], plan.needed[name], plan.where[name], plan.entries, buffers, scalars)
        del payload  # before the next file is read: one file's tensors at a time
    return buffers, scalars


def _overlap(a, b) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


def _check_shapes(directory: Path, manifest: dict, entries: list) -> None:
    for _, _, slices in entries:
        for name, shape, *_ in slices:
            saved = manifest["params"].get(name)
            if saved is None:
                raise CheckpointError(f"{directory}: no parameter {name!r} (saved from a different model?)")
            if tuple(saved) != tuple(shape):
                raise CheckpointError(f"{directory}: {name!r} has shape {tuple(saved)}, this model {tuple(shape)}")


def _copy_piece(piece: dict, want: tuple[int, int], at: tuple[int, int, int], entries, buffers, scalars) -> None:
    """Copy the part of a saved piece inside ``want`` into entry ``at``: its parameter values in place, its
    optimizer state into that entry's buffers."""
    entry, want_lo, offset = at
    lo, hi = max(piece["lo"], want[0]), min(piece["hi"], want[1])
    src = slice(lo - piece["lo"], hi - piece["lo"])
    dst = slice(offset + lo - want_lo, offset + hi - want_lo)
    values = entries[entry][1]
    with torch.no_grad():
        for key, tensor in piece["tensors"].items():
            if key == "param":
                values[dst] = tensor[src].to(values.dtype)
                continue
            if key not in buffers[entry]:
                buffers[entry][key] = torch.zeros_like(values)
            buffers[entry][key][dst] = tensor[src].to(buffers[entry][key].dtype)
    # A copy per entry: two of this world's entries may take pieces of one saved entry, and AdamW adds 1 to ``step``
    # in place, once per entry holding it.
    scalars[entry].update({k: v.clone() if torch.is_tensor(v) else v for k, v in piece["scalars"].items()})


def _install(entries, state, buffers, scalars) -> None:
    """The optimizer state, from the buffers ``_fill`` made (the parameters are in place already)."""
    for (key, _, _), buf, sc in zip(entries, buffers, scalars):
        if buf or sc:
            state[key] = {**sc, **{k: v.view_as(key) for k, v in buf.items()}}  # buffers of our own: no copy


def _load_replicated(model: nn.Module, optimizer, stage: int, replicated: dict) -> None:
    """Buffers and frozen parameters, from rank 0's shard, into every rank's model."""
    sharded = _sharded_names(model, optimizer, stage)
    with torch.no_grad():
        for k, v in _bare(model).state_dict().items():
            if k not in sharded:
                v.copy_(replicated[k])


def _resync(model: nn.Module, optimizer, stage: int) -> None:
    """Each rank loaded what it steps; bring the replicated copies up to date (stage 3 has none)."""
    if stage == 1:
        with torch.no_grad():
            optimizer.broadcast_partitions()
    elif stage == 2:
        model.gather_parameters()


@dataclass
class Consolidated:
    """A whole training state, by parameter name, on one process: what ``consolidate`` reads from a sharded
    checkpoint, or a plain checkpoint's model and optimizer state put in the same terms.

    ``model``: the bare model's state dict (tied parameters once, under their first name); ``optimizer``: each
    parameter's optimizer state by name (tensors shaped like the parameter, scalars such as AdamW's ``step``);
    ``param_groups``: the optimizer's hyperparameters, per group, without their parameters; ``extra``: what the run
    saved beside them (step, data position, RNG states).
    """

    model: dict[str, torch.Tensor]
    optimizer: dict[str, dict]
    param_groups: list[dict]
    extra: dict

    def as_manifest(self, model: nn.Module, optimizer) -> tuple[dict, Callable[[dict], dict]]:
        """A manifest and reader under which ``load_sharded`` loads this state as one rank's save for ``model``'s
        stage: one shard holding every parameter whole."""
        stage = stage_of(model, optimizer)
        shapes = {n: shape for n, shape in _param_shapes(model, stage).items() if n in self.model}
        pieces = {}
        for name in shapes:
            flat = self.model[name].reshape(-1)
            state = self.optimizer.get(name, {})
            shaped = {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == self.model[name].shape}
            tensors = {"param": flat} | {k: state[k].reshape(-1) for k in shaped}
            scalars = {k: v for k, v in state.items() if k not in shaped}  # AdamW's step, a 0-dim tensor
            pieces[name] = {"lo": 0, "hi": flat.numel(), "tensors": tensors, "scalars": scalars}
        replicated = {k: v for k, v in self.model.items() if k not in shapes}
        payload = {"pieces": pieces, "replicated": replicated}
        shard = {"rank": 0, "file": "(whole state)", "pieces": {n: [0, p["hi"]] for n, p in pieces.items()}}
        manifest = {"stage": stage, "world_size": 1, "params": shapes, "shards": [shard]}
        manifest |= {"param_groups": self.param_groups, "extra": self.extra}
        return manifest, lambda _shard: payload


def consolidate(directory) -> Consolidated:
    """The whole state of a sharded checkpoint on this one process (no process group), read one shard at a time.

    The model's state needs the whole model's memory once, the optimizer's twice that for AdamW: for an export,
    or a resume under plain DDP (which holds all of it anyway). ``CheckpointError`` on a missing or changed shard.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    shapes = {name: torch.Size(shape) for name, shape in manifest["params"].items()}
    flat: dict[str, dict[str, torch.Tensor]] = {name: {} for name in shapes}
    scalars: dict[str, dict] = {name: {} for name in shapes}
    covered = {name: torch.zeros(shape.numel(), dtype=torch.uint8) for name, shape in shapes.items()}
    replicated: dict = {}
    for shard in manifest["shards"]:
        payload = _read_shard(directory, shard)
        replicated |= payload.get("replicated", {}) if shard["rank"] == 0 else {}
        for name, piece in payload["pieces"].items():
            for key, tensor in piece["tensors"].items():
                whole = flat[name].setdefault(key, torch.empty(shapes[name].numel(), dtype=tensor.dtype))
                whole[piece["lo"] : piece["hi"]] = tensor
            # Each parameter its own copy: AdamW adds 1 to ``step`` in place, once per parameter holding it.
            scalars[name].update({k: v.clone() if torch.is_tensor(v) else v for k, v in piece["scalars"].items()})
            covered[name][piece["lo"] : piece["hi"]] += 1
        del payload  # one file's tensors at a time
    for name, count in covered.items():  # a gap or an overlap: the shards are not one model
        if (count != 1).any():
            raise DamagedCheckpoint(f"{directory}: the shards do not cover every element of {name!r} exactly once")
    model = replicated | {name: flat[name].pop("param").view(shape) for name, shape in shapes.items()}
    optimizer = {n: scalars[n] | {k: v.view(shapes[n]) for k, v in flat[n].items()} for n in shapes}
    return Consolidated(model, optimizer, manifest["param_groups"], manifest.get("extra", {}))
