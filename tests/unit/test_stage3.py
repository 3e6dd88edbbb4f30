"""ZeRO stage 3's promises (app/parallel/zero/stage3.py) seen on a small world: which units a setting names and
where each parameter goes, what is gathered while each unit computes (``prefetch``), and the streamed checksum's
one gather per unit. The walks against one process, our DDP and PyTorch's FSDP are in tests/integration/test_fsdp.py.

    .venv/bin/python -m pytest tests/unit/test_stage3.py
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.parallel import checksum
from app.parallel.zero import stage3
from app.parallel.zero.stage3 import FullyShardedDataParallel, assign_parameters, resolve_units
from app.world import run_world

DEPTH = 5


def stack() -> nn.Sequential:
    """Five Linear(8, 8) with tanh between: five units (a Tanh has no parameters, so no unit)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(2))
        self.head = nn.Linear(4, 2)
        self.blocks[1][1].weight = self.blocks[0][1].weight  # tied across two units that do not nest
        self.head.bias.requires_grad_(False)


def test_no_units_named_are_each_child_of_the_root_and_each_item_of_a_list_child():
    assert list(resolve_units(Nested(), None)) == ["blocks.0", "blocks.1", "head"]


def test_units_are_the_modules_a_name_or_a_class_names():
    model = Nested()
    assert list(resolve_units(model, "head")) == ["head"]
    assert list(resolve_units(model, ["blocks.1", "head"])) == ["blocks.1", "head"]
    assert list(resolve_units(model, nn.Sequential)) == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize(
    ("units", "says"),
    [
        (["blocks.7"], "units: 'blocks.7' names no submodule of Nested"),
        ([3], "units: 3 is neither a submodule name nor an nn.Module class"),
        ([nn.Conv2d], "units=[<class 'torch.nn.modules.conv.Conv2d'>] names no submodule of Nested: nothing to shard"),
    ],
)
def test_units_naming_nothing_are_a_one_line_error(units, says):
    with pytest.raises(ValueError) as info:
        resolve_units(Nested(), units)
    assert str(info.value) == says


def test_each_trainable_parameter_goes_to_its_innermost_unit_a_tied_one_to_the_root_a_frozen_one_nowhere():
    model = Nested()
    units = resolve_units(model, ["blocks.0", "blocks.1", "blocks.1.0", "head"])
    names = {id(p): n for n, p in model.named_parameters()}
    got = {unit: [names[id(p)] for p in params] for unit, params in assign_parameters(model, units).items()}
    assert got == {
        "": ["blocks.0.1.weight"],  # tied: blocks.0 and blocks.1 both hold it, and neither holds the other
        "blocks.0": ["blocks.0.0.weight", "blocks.0.0.bias", "blocks.0.1.bias"],
        "blocks.1": ["blocks.1.1.bias"],
        "blocks.1.0": ["blocks.1.0.weight", "blocks.1.0.bias"],  # inside blocks.1, and the inner one wins
        "head": ["head.weight"],  # head.bias is frozen: replicated, never sharded
    }


@pytest.mark.parametrize("option", ["compute_dtype", "reduce_dtype"])
def test_a_dtype_other_than_the_floating_point_ones_is_a_one_line_error(option):
    with pytest.raises(ValueError) as info:
        FullyShardedDataParallel(stack(), **{option: torch.int8})
    assert str(info.value) == f"{option}=torch.int8: choose None, torch.float32, torch.bfloat16 or torch.float16"


def _gathered_and_in_flight(units) -> tuple[list[int], list[int]]:
    """The units gathered (or being gathered), and those whose all-gather is launched and not yet waited for."""
    return [k for k, u in enumerate(units) if u.gathered], [k for k, u in enumerate(units) if u.work is not None]


def gathered_while_each_unit_computes(rank, world, prefetch, reshard):
    wrapped = FullyShardedDataParallel(stack(), prefetch=prefetch, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    seen: list[list[int]] = []
    for sub in (m for m in wrapped.module if isinstance(m, nn.Linear)):
        # Registered after the wrapper's own pre-hook: runs once this unit is gathered and its prefetch launched.
        sub.register_forward_pre_hook(lambda *_: seen.append(_gathered_and_in_flight(wrapped.units)))
    for step in range(2):
        seen.clear()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        F.mse_loss(wrapped(x), x).backward()
        opt.step()
        opt.zero_grad()
    return seen


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_while_a_unit_computes_its_next_prefetch_units_are_gathered_and_no_more(prefetch):
    # The second step's forward (the first had no order to prefetch by): unit k computes with units k..k+prefetch
    # gathered (the earlier ones freed after their forward): prefetch + 1.
    # The prefetched ones are launched, not waited for: their all-gathers run while unit k computes.
    for seen in run_world(gathered_while_each_unit_computes, 2, prefetch, True):
        expected = [list(range(k, min(k + prefetch + 1, DEPTH))) for k in range(DEPTH)]
        assert seen == [(e, e[1:]) for e in expected], (prefetch, seen)


def streamed_checksum(rank, world):
    wrapped = FullyShardedDataParallel(stack())
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    F.mse_loss(wrapped(x), x).backward()
    opt.step()
    gathers, plain = [], stage3.recorded.all_gather_into_tensor
    stage3.recorded.all_gather_into_tensor = lambda *a, **k: (gathers.append(a[2]), plain(*a, **k))[1]
    try:
        digest = wrapped.parameter_checksum()
    finally:
        stage3.recorded.all_gather_into_tensor = plain
    whole = wrapped.full_state_dict()
    h = hashlib.sha256()
    for name, _ in stack().named_parameters():
        checksum.update(h, whole[name]) if rank == 0 else None
    return digest, h.hexdigest() if rank == 0 else None, gathers, len(wrapped.units)


def test_the_streamed_checksum_gathers_each_unit_once_and_is_the_whole_models():
    # One unit at a time, each all-gathered once: a rank never holds the whole model, and the collectives are as
    # many as the units (a unit gathered again for each of its parameters would be twice the traffic).
    (digest0, whole, gathers, units), (digest1, _, _, _) = run_world(streamed_checksum, 2)
    assert digest0 == digest1 == whole
    assert gathers == [f"FSDP unit {k}" for k in range(0, 2 * DEPTH, 2)] and units == DEPTH


seen: list = []  # (input dtype, index dtype) as each TwoOutputs forward got them


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, *, index):
        seen.append((x.dtype, index.dtype))
        return {"y": self.fc(x), "argmax": self.fc(x).argmax(-1)}


def outputs_in_compute_dtype(rank, world, compute_dtype):
    seen.clear()
    wrapped = FullyShardedDataParallel(TwoOutputs(), compute_dtype=compute_dtype)
    out = wrapped(torch.randn(2, 4), index=torch.arange(2))
    return seen[0], out["y"].dtype, out["argmax"].dtype


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_a_low_precision_unit_computes_in_its_dtype_and_hands_back_fp32_floats_and_integers_as_they_are(compute_dtype):
    # Inputs (positional and keyword) cast to the compute dtype when floating point; the output's floats back to
    # fp32, what the loss and the user's code expect; integer tensors neither way.
    for (x_dtype, index_dtype), y_dtype, argmax_dtype in run_world(outputs_in_compute_dtype, 2, compute_dtype):
        assert (x_dtype, index_dtype) == (compute_dtype or torch.float32, torch.int64)
        assert (y_dtype, argmax_dtype) == (torch.float32, torch.int64)


class Tied(nn.Module):
    """A weight two units share: it lives in the root unit, whole from a forward to the end of its backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def an_evaluation_between_backward_and_step(rank, world, reshard):
    """Train, evaluate under no_grad after the backward and before the step (units left gathered), step, and
    train again: the wrapper's outputs against one process's, every step."""
    model = Tied()
    plain = Tied()
    wrapped = FullyShardedDataParallel(model, reshard_after_forward=reshard)
    opts = torch.optim.SGD(wrapped.parameters(), lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    worst = 0.0
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))  # the same on both ranks
        outs = [net(x) for net in (wrapped, plain)]
        worst = max(worst, (outs[0] - outs[1]).abs().max().item())
        for out in outs:
            F.mse_loss(out, x).backward()
        with torch.no_grad():
            wrapped(x)  # an evaluation: nothing frees what it gathered until the next forward
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return worst


@pytest.mark.parametrize("reshard", [True, False])
def test_a_forward_after_a_step_computes_with_the_stepped_parameters_whatever_was_left_gathered(reshard):
    # The root unit (the tied weight), and every unit when not resharded, stay gathered after a forward without
    # backward; the next forward must gather them again, or it computes with the values before the step.
    for worst in run_world(an_evaluation_between_backward_and_step, 2, reshard):
        assert worst <= 1e-6, worst


def bytes_of_a_step(rank, world, reshard, compute_dtype):
    wrapped = FullyShardedDataParallel(stack(), reshard_after_forward=reshard, compute_dtype=compute_dtype)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    seen = []
    for step in range(2):
        before = dict(wrapped.comm_bytes)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        F.mse_loss(wrapped(x), x).backward()
        opt.step()
        opt.zero_grad()
        seen.append({k: wrapped.comm_bytes[k] - before[k] for k in before})
    return seen, wrapped.max_units_gathered


@pytest.mark.parametrize(
    ("reshard", "compute_dtype", "gathers", "gathered_bytes"),
    [(True, None, 2, 4), (False, None, 1, 4), (True, torch.bfloat16, 2, 2)],
)
def test_a_step_gathers_each_unit_twice_or_once_unresharded_and_reduce_scatters_it_once_in_fp32(
    reshard, compute_dtype, gathers, gathered_bytes
):
    # Five units of 72 parameters (Linear(8, 8)): gathered for forward and again for backward (once when kept whole
    # in between), in the compute dtype; each gradient reduce-scattered once, in fp32 (reduce_dtype's default).
    for seen, most in run_world(bytes_of_a_step, 2, reshard, compute_dtype):
        assert seen == [{"all_gather": gathers * DEPTH * 72 * gathered_bytes, "reduce_scatter": DEPTH * 72 * 4}] * 2
        assert most == (1 if reshard else DEPTH)
