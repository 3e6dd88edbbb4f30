"""Weights in and out: a model's state read from whatever holds it, loaded by name, and a whole training state
moved between the plain and the sharded checkpoint formats.

What ``init_from`` and ``python -m app.export`` read (``read_model_state``):

- a ``.safetensors`` file (the ``safetensors`` package: ``pip install 'ddp-cluster[export]'``);
- a ``.pt`` file: a bare ``state_dict`` (``torch.save(model.state_dict(), path)``) or one of our ``step-*.pt``
  checkpoints (its model);
- a ``checkpoint_dir``: its newest valid ``step-*.pt``, or its sharded checkpoint (``manifest.json``: ZeRO 1-3, any
  world size), consolidated on this one process.

Every ``torch.load`` here is ``weights_only=True``: a file that would run pickled code is refused, not run.
``load_model_state`` matches by name and shape and names the first mismatches in one line.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from app.parallel.zero.checkpoint import MANIFEST, CheckpointError, Consolidated, consolidate
from app.worker.checkpoint.files import list_checkpoints, load_checkpoint, load_latest, unusable_reason

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
    if (path / MANIFEST).exists():
        try:
            return consolidate(path).model
        except CheckpointError as e:
            raise WeightsError(str(e)) from None
    if not list_checkpoints(path):
        raise WeightsError(f"{path}: no step-*.pt checkpoint and no {MANIFEST}: not a checkpoint_dir")
    found = load_latest(path)
    if found is None:
        raise WeightsError(f"{path}: no checkpoint in it loads (each was set aside as .corrupt)")
    return found[1]["model"]


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
