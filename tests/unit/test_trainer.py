"""The training loop (app.worker.trainer) as a user sees one run: the metrics it leaves, the lines it logs, the
checkpoints it writes, a resume, a stop, a NaN. One rank in a kept gloo world of 1 (app.world: started once per
session), mini_mlp for a few steps: each run takes milliseconds. What N ranks agree on is tests/integration."""

from __future__ import annotations

import io
import logging
import re
import sys
import time

import pytest
import torch

from app.worker.checkpoint.files import list_checkpoints
from app.world.ranks import run_world


def _train(rank: int, world: int, settings: dict, stop_first: bool = False, slow_final: bool = False) -> dict:
    """Run one Trainer to its end in this rank; its exit code, log lines, stdout and ``ddp_*`` series."""
    from prometheus_client import generate_latest

    from app.worker.config import TrainConfig, WorldEnv
    from app.worker.control import StopSignal
    from app.worker.dist import DistContext
    from app.worker.metrics import TrainMetrics
    from app.worker.steps import build_step
    from app.worker.trainer import Trainer, TrainingDiverged

    save_seconds = settings.pop("save_seconds", None)  # a disk this slow: each write reports this long
    cfg = TrainConfig(**{"metrics_port": 0, "dataset_size": 256, "micro_batch": 8, **settings})
    ctx = DistContext(rank, rank, world, torch.device("cpu"), "gloo")
    metrics = TrainMetrics(rank=rank, local_rank=rank, world_size=world, node="0", host="h")
    stop = StopSignal()
    if stop_first:
        stop.name = "SIGTERM"
        stop.event.set()  # as the signal's thread does
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("app.train")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out, stdout = io.StringIO(), sys.stdout
    sys.stdout = out
    returned = None
    try:
        step = build_step(cfg, ctx, cfg.check_world(world), metrics)
        trainer = Trainer(cfg, ctx, WorldEnv(rank=rank, world_size=world), stop, metrics, step=step)
        if save_seconds is not None:
            write = trainer.checkpointer.save
            trainer.checkpointer.save = lambda step: (write(step)[0], save_seconds)
        saved = []
        if slow_final and rank == 0:  # rank 0's last write takes a second longer than the others' part of it
            write = trainer.checkpointer.save

            def slow_save(step):
                done = write(step)
                if step == cfg.steps:
                    time.sleep(1.0)
                    saved.append(time.time())
                return done

            trainer.checkpointer.save = slow_save
        code = trainer.run()
        returned = time.time()
    except TrainingDiverged as e:
        code = str(e)
    finally:
        sys.stdout = stdout
        logger.removeHandler(handler)
    series = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("ddp_") and "_bucket{" not in line:
            name, _, value = line.rpartition(" ")
            series[name.split("{")[0]] = float(value)
    return {"code": code, "log": lines, "stdout": out.getvalue(), "series": series, "saved": saved,
            "returned": returned}  # fmt: skip


def train(**settings) -> dict:
    stop_first = settings.pop("stop_first", False)
    return run_world(_train, 1, settings, stop_first, timeout=240)[0]


def test_a_run_trains_every_step_checkpoints_at_its_cadence_and_reports_finished(tmp_path):
    run = train(steps=5, checkpoint_dir=str(tmp_path), checkpoint_every=2, log_every=2, checkpoint_timeout_seconds=9)
    assert run["code"] == 0
    s = run["series"]
    assert (s["ddp_step"], s["ddp_target_steps"], s["ddp_optimizer_steps_total"]) == (5, 5, 5)
    assert s["ddp_samples_total"] == 5 * 8 and s["ddp_last_checkpoint_step"] == 5
    assert s["ddp_checkpoint_duration_seconds_count"] == 3  # steps 2, 4 and the final 5
    assert (s["ddp_world_size"], s["ddp_world_generation"], s["ddp_stop_requested"]) == (1, 1, 0)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [5, 4, 2]  # keep_checkpoints=3, newest first
    log = run["log"]
    assert f"no checkpoint in {tmp_path}: starting from step 0" in log
    assert "training mini_mlp from step 0 to 5: " in next(line for line in log if line.startswith("training "))
    assert [line.split(" | ")[0] for line in log if line.startswith("step ")] == ["step 1/5", "step 2/5", "step 4/5",
                                                                                   "step 5/5"]  # fmt: skip
    assert re.fullmatch(r"FINISHED rank=0 world_size=1 step=5 checksum=[0-9a-f]{16}\n", run["stdout"])
    assert not [line for line in log if line.startswith("checkpoint write took")]  # a write of a few KiB: within 9 s


def test_a_resumed_run_continues_from_its_checkpoint_and_says_where_it_came_from(tmp_path):
    train(steps=3, checkpoint_dir=str(tmp_path), checkpoint_every=3)
    run = train(steps=5, checkpoint_dir=str(tmp_path), checkpoint_every=3)
    assert run["code"] == 0 and run["series"]["ddp_optimizer_steps_total"] == 2  # steps 4 and 5 only
    assert run["series"]["ddp_step"] == 5 and run["series"]["ddp_world_generation"] == 2
    resumed = [line for line in run["log"] if line.startswith("resumed from ")]
    assert len(resumed) == 1 and "(step 3, epoch 0, saved by a world of 1; world generation 2)" in resumed[0]
    assert "step=5" in run["stdout"]


def test_a_run_resumed_at_its_last_step_trains_nothing_and_says_so(tmp_path):
    train(steps=2, checkpoint_dir=str(tmp_path))
    run = train(steps=2, checkpoint_dir=str(tmp_path))
    assert run["code"] == 0 and run["series"]["ddp_optimizer_steps_total"] == 0
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2]
    assert "checkpoint step 2 >= steps=2: nothing to train" in run["log"]


def test_a_resume_with_another_global_batch_warns_how_to_keep_it(tmp_path):
    train(steps=2, checkpoint_dir=str(tmp_path))
    run = train(steps=3, checkpoint_dir=str(tmp_path), micro_batch=16)
    assert (
        "the global batch changes from 8 to 16 samples per step with this world of 1; set effective_batch=8 to keep "
        "it at any world size"
    ) in run["log"]


def test_a_checkpoint_slower_than_its_timeout_is_logged_with_the_fix(tmp_path):
    run = train(steps=1, checkpoint_dir=str(tmp_path), checkpoint_timeout_seconds=1.5, save_seconds=2.0)
    ((_, path),) = list_checkpoints(tmp_path)
    assert f"checkpoint {path} written in 2000 ms" in run["log"]
    slow = [line for line in run["log"] if line.startswith("checkpoint write took ")]
    assert slow == [
        "checkpoint write took 2.0 s > checkpoint_timeout_seconds=1.5: raise it, and stop_timeout_seconds and "
        "collective_timeout_seconds above it, or a slow save will pass for a hung rank 0"
    ]
    assert run["series"]["ddp_checkpoint_duration_seconds_sum"] == 2.0 and run["code"] == 0


def test_a_stop_before_the_last_step_checkpoints_that_step_and_exits_0(tmp_path):
    run = train(steps=5, checkpoint_dir=str(tmp_path), stop_first=True)
    assert run["code"] == 0 and run["series"]["ddp_optimizer_steps_total"] == 1
    assert run["series"]["ddp_last_checkpoint_step"] == 1 and "FINISHED" not in run["stdout"]
    assert "SIGTERM: stopped at step 1 (checkpoint at step 1); exit 0" in run["log"]
    lost = train(steps=5, stop_first=True)
    assert "SIGTERM: stopped at step 1 (no checkpoint_dir: progress lost); exit 0" in lost["log"]


def test_a_stop_during_the_last_step_completes_the_run():
    run = train(steps=1, stop_first=True)
    assert run["code"] == 0 and run["stdout"].startswith("FINISHED rank=0 world_size=1 step=1 ")


def test_a_nan_loss_stops_before_the_optimizer_step_naming_the_step_and_the_rank(tmp_path):
    run = train(steps=4, inject_nan_at_step=3, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    assert run["code"].startswith("loss became NaN/inf at step 3 on rank 0; every rank stopped before the optimizer")
    assert run["code"].endswith(" Lower lr or check the data")
    assert run["series"]["ddp_optimizer_steps_total"] == 2


def test_validation_runs_every_eval_every_steps_and_sets_its_gauge():
    run = train(steps=4, eval_fraction=0.25, eval_every=2)
    lines = [line for line in run["log"] if "validation loss" in line]
    assert [line.split(":")[0] for line in lines] == ["step 2", "step 4"]
    assert all(line.endswith("over 64 held-out samples") for line in lines)
    assert run["series"]["ddp_validation_loss"] == pytest.approx(float(lines[-1].split()[4]), rel=1e-5)
    assert "ddp_validation_loss" not in train(steps=2)["series"]


def test_a_run_resumed_after_a_crash_counts_the_steps_it_trains_again(tmp_path):
    # The first run reaches step 3 (its progress noted at each line), its last checkpoint is step 2, and a NaN at
    # step 4 ends it without a final save: the resumed world trains step 3 again.
    crashed = train(steps=5, checkpoint_dir=str(tmp_path), checkpoint_every=2, log_every=1, inject_nan_at_step=4)
    assert crashed["code"].startswith("loss became NaN/inf at step 4")
    run = train(steps=5, checkpoint_dir=str(tmp_path), checkpoint_every=2, log_every=1)
    s = run["series"]
    assert (s["ddp_steps_redone_total"], s["ddp_optimizer_steps_total"], s["ddp_world_generation"]) == (1, 3, 2)
    assert s["ddp_reformation_seconds"] > 0  # newest checkpoint written -> this world's first step


def test_no_rank_reports_finished_before_rank_0s_final_checkpoint_is_written(tmp_path):
    # The last barrier: every rank leaves together, after rank 0's final save (a peer that left first could be torn
    # down while rank 0 still writes). Rank 0's final write is made a second slower: rank 1 returns after it all the
    # same.
    ranks = run_world(_train, 2, {"steps": 2, "checkpoint_dir": str(tmp_path)}, False, True, timeout=240)
    assert [r["code"] for r in ranks] == [0, 0]
    (written,) = ranks[0]["saved"]
    assert ranks[1]["returned"] >= written
