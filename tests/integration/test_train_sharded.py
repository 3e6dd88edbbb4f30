"""The worker's ZeRO step kinds (``--parallel zero1|zero2|zero3``, app.worker.steps.zero), run for real.

- Each stage trains like ``parallel=ddp``: the same 8 steps of a global batch of 50 on 2 ranks; every rank prints
  the same FINISHED checksum, and the final parameters (read back from the sharded checkpoint's files) agree with a
  ddp run's to float rounding. Measured max |Δparam| (at 6f01bc1): zero1 0, zero2 0 (bit for bit), zero3 4.3e-08
  (likely its per-micro-batch reduce-scatter, divided by N, then added); ``TOLERANCE`` allows 1e-5, over 200× that.
- A zero2 checkpoint written by 4 ranks resumes on 3 (the shards are cut again) and ends where an uninterrupted
  4-rank run ends. In float64 (worlds 4 and 3 add in another order; in float32 that drifts, see test_invariance.py);
  measured max |Δparam| 5.6e-17 after 12 steps, ``FLOAT64_TOLERANCE`` allows 1e-12. Without the sampler position
  restored on resume the difference is 1.2e-02: the comparison sees which batches the resumed run took.
- A run moves between kinds: ddp (2 ranks) -> zero2 (3) -> ddp (4) ends where 12 uninterrupted ddp steps end
  (float64, ``FLOAT64_TOLERANCE``), zero3 resumes ddp's checkpoint within ``TOLERANCE`` of ddp throughout, ddp
  resumes zero3's, and ``python -m app.export`` turns the sharded checkpoint into a safetensors file the bare model
  loads, equal to the shards.
- A checkpoint of another stage: ``config error: ...``, one line, exit 2, and the checkpoint directory unchanged. So
  is an ``fsdp_units`` naming no module. A newest sharded checkpoint whose shard no longer matches its manifest, or
  whose save never wrote its manifest, is skipped with a warning naming it, and the run resumes from the one before
  and ends where an uninterrupted run ends.
- Retention: each sharded save is a ``sharded-step-*`` directory; ``keep_checkpoints`` keeps the newest of plain and
  sharded together (a run that moved ddp -> zero2 -> ddp keeps the newest N of either kind), and ``app.export``
  reads the newest. A checkpoint_dir in the older layout (shards and manifest at its top) still resumes.
- A save the disk refuses stops every zero2 rank with the ddp path's one line (naming checkpoint_dir, the cause and
  the file) and exit 74, as ``parallel=ddp`` does (tests/integration/test_resume.py): no traceback, no retry.
- ``ddp_zero_*`` metrics after a short zero2 run: exact bytes for MiniMLP's one bucket, wait times > 0.

Run: ``python -m pytest tests/integration/test_train_sharded.py`` (minutes on a few cores: a dozen worker runs).
"""

from __future__ import annotations

import contextlib
import json
import re
import resource
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from app.checkpoint_dir import MANIFEST, find_checkpoints, newest_sharded, sharded_path
from app.worker.checkpoint.files import checkpoint_path, load_checkpoint
from app.worker.config import ConfigError, TrainConfig
from app.worker.metrics import TrainMetrics
from app.worker.models import MiniMLP
from tests.trainer_run import (
    describe,
    finish,
    finished,
    free_port,
    run_module,
    run_process,
    run_ranks,
    start_ranks,
    worker_args,
)

pytestmark = pytest.mark.timeout(1800)
STEPS = 8  # RUNS["fixed_global_batch"]: a global batch of 50 in micro-batches of <= 8, checkpoints every 4
TOLERANCE = 1e-5
FLOAT64_TOLERANCE = 1e-12


def _train(directory, world: int, steps: int = STEPS, **settings) -> str:
    # Plain ranks: what is compared is the training, not torchrun (tests/integration/test_train.py runs that).
    result = run_ranks(
        *worker_args("fixed_global_batch", steps=steps, checkpoint_dir=directory, **settings), world_size=world
    )
    assert result.returncode == 0, describe(result)
    done = finished(result.stdout)
    assert len(done) == world and len({d["checksum"] for d in done.values()}) == 1, describe(result)
    return result.stderr


def sharded_params(directory) -> dict[str, torch.Tensor]:
    """The whole model's parameters, put together from the newest sharded checkpoint's files in a checkpoint_dir
    (no process group needed)."""
    d = newest_sharded(directory)
    manifest = json.loads((d / MANIFEST).read_text())
    flat = {name: torch.full((torch.Size(shape).numel(),), float("nan")) for name, shape in manifest["params"].items()}
    for shard in manifest["shards"]:
        pieces = torch.load(d / shard["file"], weights_only=True)["pieces"]
        for name, piece in pieces.items():
            values = piece["tensors"]["param"]
            flat[name] = flat[name].to(values.dtype)
            flat[name][piece["lo"] : piece["hi"]] = values
    return {name: flat[name].view(manifest["params"][name]) for name in flat}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    top = tmp_path_factory.mktemp("ddp")
    _train(top, 2, parallel="ddp")
    return top


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_each_stage_trains_like_ddp(tmp_path, reference, stage):
    _train(tmp_path, 2, parallel=stage)
    ddp = load_checkpoint(checkpoint_path(reference, STEPS))["model"]
    diff = _max_diff(sharded_params(tmp_path), dict(ddp))
    print(f"max |Δparam| {stage} vs ddp after {STEPS} steps on 2 ranks: {diff:.3g}")
    assert diff < TOLERANCE, f"{stage}: max |Δparam| {diff:.3g} vs ddp"


def test_zero3_ranks_with_unequal_shares_run_equal_micro_batch_counts_and_train_like_ddp(tmp_path, reference):
    # 50 samples over 3 ranks are 17/17/16: micro-batches of <= 8 would be 3/3/2, and stage 3 reduce-scatters after
    # each one, so rank 2 would leave the others waiting in their third (a hang until the collective timeout).
    # Every rank cuts its share into 3 instead; the global batch is the same, so is the training.
    _train(tmp_path, 3, parallel="zero3")
    ddp = load_checkpoint(checkpoint_path(reference, STEPS))["model"]
    diff = _max_diff(sharded_params(tmp_path), dict(ddp))
    assert diff < TOLERANCE, f"zero3 on 3 ranks: max |Δparam| {diff:.3g} vs ddp on 2"


@pytest.fixture(scope="module")
def zero2_world4(tmp_path_factory) -> dict:
    top = tmp_path_factory.mktemp("zero2")
    whole = _train(top / "whole", 4, steps=12, parallel="zero2", dtype="float64")
    first = _train(top / "resharded", 4, parallel="zero2", dtype="float64")
    return {"top": top, "whole_log": whole, "first_log": first}


def test_zero2_resumes_on_another_world_size_where_it_stopped(zero2_world4):
    top = zero2_world4["top"]
    log = _train(top / "resharded", 3, steps=12, parallel="zero2", dtype="float64")
    assert re.search(
        r"resumed from \S+/sharded-step-00000008/manifest.json \(step 8, epoch \d+, saved by a world of 4", log
    )
    assert "training mini_mlp from step 8 to 12" in log
    # The logged loss is rank 0's own share (another share at world 3), so the parameters are what is compared:
    # they match only if the resumed run took the same 4 global batches as the uninterrupted one.
    diff = _max_diff(sharded_params(top / "resharded"), sharded_params(top / "whole"))
    print(f"max |Δparam| zero2 4 -> 3 ranks vs 4 ranks throughout, float64, 12 steps: {diff:.3g}")
    assert diff < FLOAT64_TOLERANCE, f"max |Δparam| {diff:.3g}"


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _refused(directory: Path, world: int = 2, **settings) -> str:
    """Run on ``directory`` expecting a one-line config error, exit 2, and the directory left as it was."""
    before = _snapshot(directory)
    procs = start_ranks(
        *worker_args("fixed_global_batch", steps=12, checkpoint_dir=directory, **settings), world_size=world
    )
    outs = finish(procs)
    text = "\n".join(f"rank {r}: exit {p.returncode}\n{err}" for r, (p, (_, err)) in enumerate(zip(procs, outs)))
    errors = {line for _, err in outs for line in err.splitlines() if line.startswith("config error:")}
    assert [p.returncode for p in procs] == [2] * world and len(errors) == 1, text
    assert all("Traceback" not in err and not finished(out) for out, err in outs), text
    assert _snapshot(directory) == before, "the refused run changed the checkpoint directory"
    return errors.pop()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_checkpoint_of_another_stage_is_refused(tmp_path, zero2_world4):
    d = _copy(zero2_world4["top"] / "resharded", tmp_path / "ckpt")
    error = _refused(d, parallel="zero3")
    assert "saved by ZeRO stage 2, this run is stage 3" in error, error


@pytest.fixture(scope="module")
def ddp_float64(tmp_path_factory) -> Path:
    """12 uninterrupted ddp steps on 2 ranks in float64: where a run moved between kinds must end."""
    top = tmp_path_factory.mktemp("ddp64")
    _train(top, 2, steps=12, parallel="ddp", dtype="float64")
    return top


def test_a_run_moves_ddp_to_zero2_to_ddp_across_world_sizes_and_ends_where_ddp_ends(tmp_path, ddp_float64):
    d = tmp_path / "moved"
    _train(d, 2, steps=4, parallel="ddp", dtype="float64")
    log = _train(d, 3, steps=8, parallel="zero2", dtype="float64")  # the plain step-4 file, cut into 3 shards
    assert re.search(r"resumed from \S+step-00000004\.pt \(step 4, epoch \d+, saved by a world of 2", log), log
    log = _train(d, 4, steps=12, parallel="ddp", dtype="float64")  # the sharded step 8, consolidated on 4 ranks
    assert re.search(r"resumed from \S+manifest\.json \(step 8, epoch \d+, saved by a world of 3", log), log
    moved = load_checkpoint(checkpoint_path(d, 12))["model"]
    whole = load_checkpoint(checkpoint_path(ddp_float64, 12))["model"]
    diff = _max_diff(dict(moved), dict(whole))
    print(f"max |Δparam| ddp(2) -> zero2(3) -> ddp(4) vs ddp(2) throughout, float64, 12 steps: {diff:.3g}")
    assert diff < FLOAT64_TOLERANCE, f"max |Δparam| {diff:.3g}: the optimizer state or data position was lost"


def test_zero3_resumes_a_ddp_checkpoint_and_ddp_resumes_zero3s_and_the_export_loads_bare(tmp_path, reference):
    d = tmp_path / "moved"
    _train(d, 2, steps=4, parallel="ddp")
    _train(d, 2, steps=STEPS, parallel="zero3")
    ddp = load_checkpoint(checkpoint_path(reference, STEPS))["model"]
    diff = _max_diff(sharded_params(d), {k: v for k, v in ddp.items()})
    assert diff < TOLERANCE, f"zero3 from ddp's step 4: max |Δparam| {diff:.3g} vs ddp throughout"
    exported = tmp_path / "model.safetensors"
    done = run_module("app.export", str(d), str(exported))
    assert done.returncode == 0 and "exported" in done.stdout, describe(done)
    from safetensors.torch import load_file

    model = MiniMLP()
    model.load_state_dict(load_file(exported))  # the bare model, no wrapper, strict
    assert _max_diff(dict(model.state_dict()), sharded_params(d)) == 0
    log = _train(d, 2, steps=STEPS + 4, parallel="ddp")
    assert re.search(rf"resumed from \S+manifest\.json \(step {STEPS}", log), log


def test_a_damaged_newest_sharded_checkpoint_falls_back_to_the_one_before_and_ends_as_if_uninterrupted(
    tmp_path, zero2_world4
):
    d = _copy(zero2_world4["top"] / "resharded", tmp_path / "ckpt")
    for found in find_checkpoints(d):
        if found.step > 8:  # what another test of this module may have trained on from here
            shutil.rmtree(found.path)
    newest = sharded_path(d, 8)
    shard = newest / json.loads((newest / MANIFEST).read_text())["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes() + b"\0")  # changed after its manifest was written
    unfinished = sharded_path(d, 10)  # a later save killed before its manifest: no checkpoint
    shutil.copytree(newest, unfinished)
    (unfinished / MANIFEST).unlink()
    log = _train(d, 4, steps=12, parallel="zero2", dtype="float64")
    assert re.search(
        rf"WARNING skipping {re.escape(str(unfinished))}: no manifest.json, its save did not finish", log
    ), log
    assert re.search(
        rf"WARNING checkpoint {newest} is unusable \({shard}: sha256 \w+\.\.\. does not match the manifest's .*\); "
        r"renamed to sharded-step-00000008\.corrupt; trying the previous one",
        log,
    ), log
    assert re.search(
        r"resumed from \S+/sharded-step-00000004/manifest.json \(step 4, epoch \d+, saved by a world of 4", log
    )
    diff = _max_diff(sharded_params(d), sharded_params(zero2_world4["top"] / "whole"))
    assert diff < FLOAT64_TOLERANCE, f"max |Δparam| {diff:.3g} after falling back to step 4"
    # The unfinished save is gone (the run passed its step), the damaged one kept aside for inspection.
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("sharded-")) == [
        "sharded-step-00000004",
        "sharded-step-00000008",
        "sharded-step-00000008.corrupt",
        "sharded-step-00000012",
    ]


def _kept(directory: Path) -> list[str]:
    return [f.path.name for f in find_checkpoints(directory, incomplete=True)]


def test_keep_checkpoints_keeps_the_newest_sharded_saves(tmp_path):
    _train(tmp_path, 2, steps=10, parallel="zero2", checkpoint_every=2, keep_checkpoints=2)  # saves 2, 4, ..., 10
    assert _kept(tmp_path) == ["sharded-step-00000010", "sharded-step-00000008"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*_kept(tmp_path), "progress.json"])


def test_a_run_that_moves_between_kinds_keeps_the_newest_n_of_either_and_exports_the_newest(tmp_path):
    d, keep = tmp_path / "ckpt", {"checkpoint_every": 2, "keep_checkpoints": 3}
    _train(d, 2, steps=4, parallel="ddp", **keep)
    _train(d, 2, steps=8, parallel="zero3", **keep)
    assert _kept(d) == ["sharded-step-00000008", "sharded-step-00000006", "step-00000004.pt"]
    exported = tmp_path / "model.pt"
    done = run_module("app.export", str(d), str(exported))
    assert done.returncode == 0, describe(done)
    assert _max_diff(torch.load(exported, weights_only=True), sharded_params(d)) == 0  # step 8's, not 4's
    log = _train(d, 2, steps=10, parallel="ddp", **keep)
    assert re.search(r"resumed from \S+/sharded-step-00000008/manifest.json \(step 8", log), log
    assert _kept(d) == ["step-00000010.pt", "sharded-step-00000008", "sharded-step-00000006"]


def test_a_checkpoint_dir_in_the_older_layout_resumes_and_counts_as_one_checkpoint(tmp_path, reference):
    d = tmp_path / "ckpt"
    _train(d, 2, steps=4, parallel="zero2")
    step_dir = sharded_path(d, 4)
    for part in step_dir.iterdir():  # shards and manifest at the top of checkpoint_dir, as saves used to leave them
        part.rename(d / part.name)
    step_dir.rmdir()
    log = _train(d, 2, steps=STEPS, parallel="zero2")
    assert re.search(rf"resumed from {re.escape(str(d / MANIFEST))} \(step 4, epoch \d+, saved by a world of 2", log)
    ddp = load_checkpoint(checkpoint_path(reference, STEPS))["model"]
    diff = _max_diff(sharded_params(d), dict(ddp))
    assert diff < TOLERANCE, f"zero2 resumed from the older layout: max |Δparam| {diff:.3g} vs ddp"
    assert _kept(d) == ["sharded-step-00000008", "ckpt"]  # kept (keep_checkpoints=5): a user's checkpoint not lost


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Processes started inside inherit RLIMIT_FSIZE = ``nbytes``: a bigger write fails with EFBIG (Python ignores
    SIGXFSZ). Unlike a read-only directory this holds for root too (CI), and it refuses the save, not the start-up
    probe (an empty file)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_save_the_disk_refuses_ends_every_zero_rank_in_one_line_with_exit_74(tmp_path):
    ckpt = tmp_path / "ckpt"
    with file_size_limit(1024):  # every shard is bigger
        procs = start_ranks(*worker_args("fixed_global_batch", steps=STEPS, checkpoint_dir=ckpt, parallel="zero2"))
    outs = finish(procs, timeout=300)
    assert [p.returncode for p in procs] == [74, 74], outs  # STORAGE_FAILED: the launcher restarts no world for it
    for _, err in outs:
        errors = [line for line in err.splitlines() if " ERROR " in line or line.startswith("error")]
        assert len(errors) == 1, err
        assert f"checkpoint_dir {ckpt} could not take the checkpoint of step 4: File too large (EFBIG)" in errors[0]
        assert "No checkpoint was written" in errors[0] and "Traceback" not in err, err
    left = [p.name for p in ckpt.iterdir() if p.name.startswith(("sharded-", "shard-", ".shard-", MANIFEST))]
    assert left == [], "a failed save leaves no directory, no shard, no manifest and no temporary file"


def test_fsdp_units_naming_no_module_is_a_config_error(tmp_path):
    result = run_process(*worker_args("one_process", parallel="zero3", fsdp_units="Linear,Nope", steps=2))
    assert result.returncode == 2, describe(result)
    assert result.stderr.strip().splitlines()[-1].startswith("config error: fsdp_units='Linear,Nope': Nope names no")
    with pytest.raises(ConfigError, match="fsdp_units='Block' is for parallel=zero3 only"):
        TrainConfig(parallel="zero2", fsdp_units="Block")


def test_only_the_zero_kinds_export_zero_series_and_they_are_promtool_clean():
    m = TrainMetrics(rank=0, local_rank=0, world_size=2, node="0")
    assert "ddp_zero" not in generate_latest(m.registry).decode()  # until a zero step kind enables them
    m.observe_zero(
        collectives={"reduce_scatter": (4096, 0.001), "all_gather": (4096, 0.002)},
        parameter_bytes=8192,
        gradient_bytes=4096,
        optimizer_state_bytes=8196,
    )
    text = generate_latest(m.registry).decode()
    assert 'ddp_zero_reduce_scatter_bytes_total{rank="0"} 4096.0' in text
    assert 'ddp_zero_gradient_bytes{rank="0"} 4096.0' in text
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check


def test_zero2_metrics_after_a_short_run():
    from tests.integration.test_metrics import scrape_at_the_end

    steps, k, world = 6, 2, 2
    values, err = scrape_at_the_end(free_port(2), parallel="zero2", steps=steps, grad_accum_steps=k, log_every=1)
    total = sum(p.numel() for p in MiniMLP().parameters())
    shard = -(-total // world)  # one bucket (MiniMLP is far below bucket_cap_mb), padded to a multiple of 2
    for rank, v in enumerate(values):
        r = f'{{rank="{rank}"}}'
        assert v[f"ddp_zero_stage{r}"] == 2
        assert v[f"ddp_zero_parameter_bytes{r}"] == total * 4  # stage 2: parameters whole on every rank
        assert v[f"ddp_zero_gradient_bytes{r}"] == shard * 4  # ...but 1/N of the gradient
        assert v[f"ddp_zero_optimizer_state_bytes{r}"] == 2 * shard * 4 + 4  # exp_avg, exp_avg_sq; step
        # One synchronised backward per step (no_sync on the other micro-batch), one all-gather after each step.
        assert v[f"ddp_zero_reduce_scatter_bytes_total{r}"] == steps * shard * world * 4
        assert v[f"ddp_zero_all_gather_bytes_total{r}"] == steps * shard * world * 4
        assert v[f"ddp_zero_reduce_scatter_seconds_count{r}"] == steps
        assert 0 < v[f"ddp_zero_all_gather_seconds_sum{r}"] < 60
        assert v[f"ddp_gradient_syncs_total{r}"] == steps


def _zero_gauges_after_a_step(rank: int, world: int, parallel: str) -> dict:
    from app.worker.dist import DistContext
    from app.worker.steps import build_step

    cfg = TrainConfig(parallel=parallel, micro_batch=4, metrics_port=0)
    metrics = TrainMetrics(rank=rank, local_rank=rank, world_size=world, node=str(rank))
    step = build_step(cfg, DistContext(rank, rank, world, torch.device("cpu"), "gloo"), 1, metrics)
    step.train_step(step.batches.next_micro_batches(), agree_nonfinite=lambda bad: bad)
    labels = {"rank": str(rank)}
    return {
        name: metrics.registry.get_sample_value(f"ddp_zero_{name}_bytes", labels)
        for name in ("parameter", "gradient", "optimizer_state")
    }


@pytest.mark.parametrize("parallel", ["zero1", "zero3"])
def test_zero1_and_zero3_memory_gauges_read_what_each_rank_holds(parallel):
    """The bytes each rank keeps (zero2's exact values: test_zero2_metrics_after_a_short_run): AdamW's two moments
    of what the rank steps, plus its step counters; between them, the ranks hold one copy of that state."""
    from app.world import run_world

    world = 2
    params = list(MiniMLP().parameters())
    total = sum(p.numel() for p in params) * 4  # float32 bytes
    gauges = run_world(_zero_gauges_after_a_step, world, parallel, timeout=120)
    for g in gauges:
        assert all(v is not None and v > 0 for v in g.values()), gauges
    state = sum(g["optimizer_state"] for g in gauges)
    if parallel == "zero1":
        assert [g["parameter"] for g in gauges] == [total] * world, gauges  # the model whole on every rank ...
        assert [g["gradient"] for g in gauges] == [total] * world, gauges  # ... and its all-reduced gradient
        assert state == 2 * total + 4 * len(params), gauges  # 1/N of the state each: one copy between them
    else:
        held = sum(g["parameter"] for g in gauges)
        assert total <= held <= total + 4 * world * len(params), gauges  # 1/N each (+ padding to a multiple of N)
        assert 2 * held <= state <= 2 * held + 4 * world * len(params), gauges
