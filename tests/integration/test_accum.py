"""Gradient accumulation (app/accum.py): each claim of ``make accum``, on real gloo ranks where ranks matter.

    .venv/bin/python -m pytest tests/test_accum.py -q

One world of 2 ranks (the ``world`` fixture) measures every multi-rank claim once, with ``bench/accum.py``'s own
per-rank functions (what ``make accum`` prints is what is tested); the tests below read it.
"""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch
import torch.nn.functional as F

from app.parallel.accum import NonFiniteLossError, accumulation_step, effective_batch_size, resolve_grad_accum_steps
from app.parallel.ddp import DistributedDataParallel
from app.worker.models import MiniMLP
from app.world import run_world
from bench import accum as bench_accum

K, MICRO = bench_accum.K, bench_accum.MICRO  # 4 micro-batches of 4: the claims' shape, from the bench


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, 32, generator=g), torch.randint(0, 8, (size,), generator=g)


def split(x, y, sizes):
    return list(zip(x.split(sizes), y.split(sizes)))


def train_pair(
    model,
    *,
    rank=0,
    world=1,
    steps=3,
    sizes=MICRO,
    make_opt=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ref_sizes=None,
    **step_kwargs,
) -> tuple[float, float, torch.optim.Optimizer]:
    """``model`` accumulates micro-batches of ``sizes`` on this rank's slice of each global batch; a bare copy
    trains on the whole batch (or accumulates ``ref_sizes``). Returns worst max |Δgrad|, final max |Δparam|."""
    ref = copy.deepcopy(getattr(model, "module", model))
    ref_opt, opt = make_opt(ref.parameters()), make_opt(model.parameters())
    dgrad = 0.0
    for step in range(steps):
        x, y = batch(step, K * MICRO * world)
        if ref_sizes is None:
            ref_opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
        else:
            accumulation_step(ref, ref_opt, split(x, y, ref_sizes), F.cross_entropy)
        accumulation_step(
            model, opt, split(x.chunk(world)[rank], y.chunk(world)[rank], sizes), F.cross_entropy, **step_kwargs
        )
        dgrad = max(dgrad, bench_accum.max_diff(ref, model, grads=True))
    return dgrad, bench_accum.max_diff(ref, model, grads=False), opt


# -- configuration: grad_accum_steps or effective_batch ------------------------------------------------------------
def test_effective_batch_counts_every_rank_and_micro_batch():
    assert effective_batch_size(micro_batch=4, grad_accum_steps=4, world_size=2) == 32


def test_effective_batch_derives_grad_accum_steps():
    assert resolve_grad_accum_steps(micro_batch=4, world_size=2, effective_batch=32) == 4
    assert resolve_grad_accum_steps(micro_batch=4, world_size=2, grad_accum_steps=3) == 3
    assert resolve_grad_accum_steps(micro_batch=4, world_size=2, grad_accum_steps=4, effective_batch=32) == 4
    assert resolve_grad_accum_steps(micro_batch=4, world_size=2) == 1


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"effective_batch": 30}, ["effective_batch=30", "multiple of 8"]),
        ({"effective_batch": 0}, ["effective_batch=0"]),
        ({"grad_accum_steps": 2, "effective_batch": 32}, ["effective_batch=32", "grad_accum_steps=2", "only one"]),
        ({"grad_accum_steps": 0}, ["grad_accum_steps=0", ">= 1"]),
    ],
)
def test_settings_that_do_not_fit_are_refused_in_one_line(kwargs, names):
    with pytest.raises(ValueError) as err:
        resolve_grad_accum_steps(micro_batch=4, world_size=2, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    assert all(name in message for name in names), message


def test_a_micro_batch_below_one_is_refused_and_one_is_accepted():
    with pytest.raises(ValueError, match=r"micro_batch=0 must be >= 1"):
        resolve_grad_accum_steps(micro_batch=0, world_size=2)
    assert resolve_grad_accum_steps(micro_batch=1, world_size=2, effective_batch=4) == 2


# -- one process ---------------------------------------------------------------------------------------------------
def test_one_batch_of_16_equals_4_micro_batches_of_4():
    torch.manual_seed(0)
    dgrad, dparam, _ = train_pair(MiniMLP())
    assert dgrad < 1e-4 and dparam < 1e-4, (dgrad, dparam)


def test_2x8_and_4x4_agree_to_float_rounding():
    # Same 16 per-sample gradients summed in a different order: fp32 rounding only (measured ~1.5e-8).
    torch.manual_seed(0)
    dgrad, dparam, _ = train_pair(MiniMLP(), ref_sizes=8)
    assert dgrad < 1e-6 and dparam < 1e-6, (dgrad, dparam)


def test_unequal_micro_batches_still_give_the_big_batch_gradient():
    # A short last micro-batch (6 + 6 + 4): dividing each loss by K would over-weight its 4 samples.
    torch.manual_seed(0)
    dgrad, dparam, _ = train_pair(MiniMLP(), sizes=[6, 6, 4])
    assert dgrad < 1e-4 and dparam < 1e-4, (dgrad, dparam)


def inf_loss(out, y):
    return F.cross_entropy(out, y) * float("inf")  # a run diverging: its loss overflows before it turns NaN


@pytest.mark.parametrize(("bad_sample", "loss_fn", "says"), [(True, F.cross_entropy, "nan"), (False, inf_loss, "inf")])
def test_non_finite_loss_stops_before_the_step(bad_sample, loss_fn, says):
    torch.manual_seed(0)
    model = MiniMLP()
    before = copy.deepcopy(model)
    x, y = batch(0, 16)
    if bad_sample:
        x[5] = float("nan")
    with pytest.raises(NonFiniteLossError, match=f"loss is {says} on this rank"):
        accumulation_step(model, torch.optim.SGD(model.parameters(), lr=0.1), split(x, y, 4), loss_fn)
    assert bench_accum.max_diff(before, model, grads=False) == 0.0
    assert all(p.grad is None for p in model.parameters())


def test_the_step_reports_its_forward_and_backward_time_within_its_wall_time():
    torch.manual_seed(0)
    model = MiniMLP()
    x, y = batch(0, 16)
    start = time.perf_counter()
    result = accumulation_step(model, torch.optim.SGD(model.parameters(), lr=0.1), split(x, y, 4), F.cross_entropy)
    wall = time.perf_counter() - start
    parts = (result.forward_seconds, result.backward_seconds, result.optimizer_seconds)
    assert all(s > 0 for s in parts) and sum(parts) <= wall, (parts, wall)


# -- real ranks ----------------------------------------------------------------------------------------------------
def _claims(rank: int, world: int) -> dict:
    """The bench's own per-rank measurements (one source of truth for what ``make accum`` claims), plus the NaN stop,
    which only the test checks."""
    torch.manual_seed(0)
    base = MiniMLP()
    out = {
        name: measure(rank, world, base)
        for name, measure in (
            ("equivalence", bench_accum.equivalence),
            ("syncs", bench_accum.sync_counts),
            ("wrong_scale", bench_accum.wrong_scale),
            ("adamw", bench_accum.adamw_state),
        )
    }

    # A NaN on rank 1 only: every rank must stop before its step, and the world must stay usable afterwards.
    ddp = DistributedDataParallel(copy.deepcopy(base))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = batch(0, K * MICRO * world)
    xs, ys = x.chunk(world)[rank].clone(), y.chunk(world)[rank]
    if rank == 1:
        xs[0] = float("nan")
    try:
        accumulation_step(ddp, opt, split(xs, ys, MICRO), F.cross_entropy)
        out["nan_raised"] = None
    except NonFiniteLossError as err:
        out["nan_raised"] = "here" if err.local else "elsewhere"
    out["nan_params_untouched"] = bench_accum.max_diff(base, ddp, grads=False) == 0.0
    calls = ddp.stats.sync_calls
    accumulation_step(ddp, opt, split(x.chunk(world)[rank], ys, MICRO), F.cross_entropy)
    out["after_nan_syncs"] = ddp.stats.sync_calls - calls
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_world(_claims, 2, timeout=120)


def test_accumulation_under_ddp_equals_one_big_batch(world):
    n = K * MICRO * 2
    for rank in world:
        for wrapper in ("ddp", "torch_ddp"):
            r = rank["equivalence"][f"{wrapper}_{n}_vs_2x{K}x{MICRO}"]
            assert r["max_abs_dgrad"] < 1e-4 and r["max_abs_dparam"] < 1e-4, (wrapper, r)


def test_gradients_sync_once_per_effective_step(world):
    for rank in world:
        last = rank["syncs"]["sync_on_last"]
        assert last["sync_calls"] == 3 and last["step_result_syncs"] == 3  # 3 optimizer steps of K=4 micro-batches
        # Syncing every micro-batch puts K times the bytes on the wire.
        assert rank["syncs"]["sync_every_micro_batch"]["bytes_reduced"] == K * last["bytes_reduced"]


def test_syncing_every_micro_batch_costs_k_syncs(world):
    for rank in world:
        every = rank["syncs"]["sync_every_micro_batch"]
        assert (every["sync_calls"], every["step_result_syncs"]) == (3 * K, 3 * K)


def test_forward_outside_no_sync_silently_syncs_every_micro_batch(world):
    for rank in world:
        assert rank["syncs"]["forward_outside_no_sync"]["sync_calls"] == 3 * K


def test_loss_not_divided_by_k_makes_the_step_k_times_too_big(world):
    for rank in world:
        sgd = rank["wrong_scale"]["sgd"]
        assert sgd["update_ratio"] == pytest.approx(K, rel=1e-3)
        assert sgd["max_abs_dparam_wrong"] > 1e-3  # far outside the 1e-4 that the right scale stays within
        assert sgd["max_abs_dparam_right"] < 1e-4


def test_adamw_state_advances_once_per_effective_step(world):
    for rank in world:
        right = rank["adamw"]["accumulation_step"]
        assert right["state_step"] == [5, 5]  # 5 optimizer steps of K=4 micro-batches: not 20
        assert right["max_abs_dparam"] < 1e-4
        assert rank["adamw"]["step_per_micro_batch"]["state_step"] == [5 * K, 5 * K]  # the mistake: once per micro


def test_non_finite_loss_on_one_rank_stops_every_rank(world):
    assert [rank["nan_raised"] for rank in world] == ["elsewhere", "here"]
    assert all(rank["nan_params_untouched"] for rank in world)
    assert [rank["after_nan_syncs"] for rank in world] == [1, 1]  # still in step: the next step syncs normally


# -- make accum ---------------------------------------------------------------------------------------------------
def test_make_accum_writes_the_sweep_and_the_plot(tmp_path, capsys):
    # main() in this process: the same code as `make accum` (its own 2 spawned ranks), with a tiny sweep.
    argv = [
        "--accum-steps",
        "1,2",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--width",
        "32",
        "--depth",
        "2",
        "--out",
        str(tmp_path),
        "--timeout",
        "120",
    ]
    assert bench_accum.main(argv) == 0
    printed = capsys.readouterr().out
    doc = json.loads((tmp_path / "accum-curve.json").read_text())
    assert doc["schema"] == "accum-curve.v1" and doc["failed"] == []
    fields = {
        "effective_batch",
        "accum_steps",
        "micro_batch",
        "avg_loss",
        "samples_per_sec",
        "median_step_ms",
        "sync_calls",
        "steps",
    }
    assert [(p["sync_mode"], p["effective_batch"], p["sync_calls"]) for p in doc["points"]] == [
        ("last", 16, 1),
        ("every", 16, 1),
        ("last", 32, 1),
        ("every", 32, 2),
    ]
    assert all(fields <= p.keys() and p["samples_per_sec"] > 0 for p in doc["points"])
    assert (tmp_path / "accum-curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "max|Δgrad|" in printed and "sync_on_last" in printed and "samples/s" in printed


@pytest.mark.parametrize(
    "argv, flag",
    [(["--accum-steps", "1,0"], "--accum-steps"), (["--steps", "-3"], "--steps"), (["--warmup", "-1"], "--warmup")],
)
def test_make_accum_refuses_a_bad_flag_in_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_accum.parse_args(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in error and "error" in error
