"""Weights in and out: a model's state read from whatever holds it, loaded by name, and a whole training state
moved between the plain and the sharded checkpoint formats.

What ``init_from`` and ``python -m app.export`` read (``read_model_state``):

- a ``.safetensors`` file (the ``safetensors`` package: ``pip install 'ddp-cluster[export]'``);
- a ``.pt`` file: a bare ``state_dict`` (``torch.save(model.state_dict(), path)``) or one of our ``step-*.pt``
  checkpoints (its model);
- a ``checkpoint_dir``: its newest checkpoint that loads, of either kind (app.checkpoint_dir): a ``step-*.pt``, or a
  sharded one (``sharded-step-*/``, or ``manifest.json`` at the top in the older layout: ZeRO 1-3, any world size),
  consolidated on this one process. One that does not load is named in a warning and the previous one is read; the
  directory is left as it is.

Every ``torch.load`` here is ``weights_only=True``: a file that would run pickled code is refused, not run.
``load_model_state`` matches by name and shape and names the first mismatches in one line.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from app.checkpoint_dir import SHARDED, find_checkpoints
from app.parallel.zero.checkpoint import CheckpointError, Consolidated, consolidate
from app.worker.checkpoint.files import load_checkpoint, unusable_reason

log = logging.getLogger(__name__)

SHOWN = 3  # mismatched names listed in an error; the rest are counted


class WeightsError(ValueError):
    """A source of weights that cannot be read, or does not fit the model: one line naming it and the fix."""


def read_model_state(source: str | Path) -> dict[str, torch.Tensor]:
    """The model state dict held by ``source`` (see the module docstring), on the CPU."""
    path = Path(source)
    if not path.exists():
        raise WeightsError(f"{path}: no such file or directory")
    if path.is_dir():
        return _from_checkpoint_dir(path)
    if path.suffix == ".safetensors":
        return _from_safetensors(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch says, the line names the file and the cause
        raise WeightsError(f"{path}: not a weights file torch can read safely ({unusable_reason(e)})") from None
    if isinstance(state, dict) and "digest" in state and "model" in state:
        return load_checkpoint(path)["model"]  # one of our checkpoints: validated against its digest
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"{path}: holds {type(state).__name__}, not a state_dict of tensors by name")
    return state


def _from_checkpoint_dir(path: Path) -> dict[str, torch.Tensor]:
    found = find_checkpoints(path)
    if not found:
        raise WeightsError(f"{path}: no step-*.pt checkpoint and no sharded one: not a checkpoint_dir")
    for checkpoint in found:
        try:
            if checkpoint.kind == SHARDED:
                return consolidate(checkpoint.path).model
            return load_checkpoint(checkpoint.path)["model"]
        except Exception as e:  # noqa: BLE001 - any failure to read means "unusable": read the previous one
            reason = str(e) if isinstance(e, CheckpointError) else unusable_reason(e)
            log.warning("checkpoint %s is unusable (%s); reading the previous one", checkpoint.named, reason)
    raise WeightsError(f"{path}: none of its {len(found)} checkpoints loads (the warnings above say why)")


def _from_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise WeightsError(
            f"{path}: reading .safetensors needs the safetensors package: pip install safetensors"
        ) from None
    try:
        return load_file(path, device="cpu")
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: one line
        raise WeightsError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``state`` into ``model`` by name; ``WeightsError`` naming the first mismatches if any name is missing,
    extra or of another shape. A tied parameter may be given under any one of its names."""
    expected = model.state_dict()
    aliases = _tied_aliases(model)
    state = dict(state)
    for name, others in aliases.items():  # fill a tied name from whichever of its names the file has
        if name not in state and (given := next((o for o in others if o in state), None)) is not None:
            state[name] = state[given]
    missing = [n for n in expected if n not in state]
    extra = [n for n in state if n not in expected]
    shapes = [
        f"{n} {tuple(state[n].shape)} != {tuple(t.shape)}"
        for n, t in expected.items()
        if n in state and state[n].shape != t.shape
    ]
    problems = [
        f"{label}: {_first(names)}"
        for label, names in (("missing", missing), ("unexpected", extra), ("shape", shapes))
        if names
    ]
    if problems:
        raise WeightsError(f"{source} does not fit the model ({'; '.join(problems)}); give weights of this model")
    model.load_state_dict(state)


def _tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each name of a parameter that has several (tied weights), with its other names."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n: [o for o in group if o != n] for group in names.values() if len(group) > 1 for n in group}


def _first(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def plain_optimizer_state(whole: Consolidated, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``whole``'s optimizer state as ``optimizer.state_dict()`` of a plain optimizer over ``model`` (bare) holds it:
    indexed by position in its parameter groups, the groups' saved hyperparameters where their number matches."""
    names = {id(p): n for n, p in model.named_parameters()}
    state, groups, index = {}, [], 0
    saved = whole.param_groups if len(whole.param_groups) == len(optimizer.param_groups) else []
    for g, group in enumerate(optimizer.param_groups):
        params = list(range(index, index + len(group["params"])))
        for i, p in zip(params, group["params"]):
            if whole.optimizer.get(names[id(p)]):
                state[i] = whole.optimizer[names[id(p)]]
        hyper = saved[g] if saved else {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": params})
        index += len(params)
    return {"state": state, "param_groups": groups}


def consolidated_from_plain(state: dict) -> Consolidated:
    """A plain checkpoint (``step-*.pt``: model, optimizer by position, the rest) in by-name terms, for a ZeRO stage
    to load; ``WeightsError`` for a checkpoint that does not name its optimizer's parameters (``param_names``)."""
    names = state.get("param_names")
    if names is None:
        raise WeightsError("it does not name its optimizer's parameters (saved by an older trainer)")
    saved = state["optimizer"]
    by_name = {names[i]: s for i, s in saved["state"].items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    extra = {k: v for k, v in state.items() if k not in ("model", "optimizer", "digest", "format", "param_names")}
    return Consolidated(state["model"], by_name, groups, extra)
