"""The sharded checkpoint's promises (app/parallel/zero/checkpoint.py) on a world of 2: what the files and the
manifest hold, a shard that fails to read after its check, the consolidated state of a save, the save's files cut
at SHARD_FILE_BYTES, and the checks on load. The resumes on another world size are in
tests/integration/test_zero_checkpoint.py.

    .venv/bin/python -m pytest tests/unit/test_checkpoint_sharded.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.parallel.ddp import DistributedDataParallel as DDP
from app.parallel.zero import checkpoint as zero_checkpoint
from app.parallel.zero.checkpoint import (
    FORMAT,
    CheckpointError,
    DamagedCheckpoint,
    consolidate,
    load_sharded,
    read_manifest,
    save_sharded,
    stage_of,
)
from app.parallel.zero.stage1 import ZeroRedundancyOptimizer
from app.parallel.zero.stage2 import ShardedGradDataParallel
from app.parallel.zero.stage3 import FullyShardedDataParallel
from app.world import run_world


class Model(nn.Module):
    """Two layers, a buffer and a frozen parameter: replicated tensors beside the sharded ones."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.tensor([1.5]), requires_grad=False)
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x):
        self.seen += 1
        return self.b(torch.tanh(self.a(x))) * self.scale


def wrap(stage: int, seed: int = 0):
    torch.manual_seed(seed)
    model = Model()
    if stage == 1:
        ddp = DDP(model)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    if stage == 2:
        wrapped = ShardedGradDataParallel(model, bucket_cap_mb=0.0001)
        return wrapped, wrapped.build_optimizer(torch.optim.AdamW, lr=0.01)
    wrapped = FullyShardedDataParallel(model)
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=0.01)


def train(wrapped, opt, rank: int, steps: int = 2) -> None:
    for step in range(steps):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        opt.zero_grad()
        F.mse_loss(wrapped(x), x[:, :3]).backward()
        opt.step()


def whole(stage: int, wrapped) -> dict[str, torch.Tensor]:
    """The bare model's state dict (stage 3: gathered; every rank calls it, rank 0 gets it)."""
    if stage == 3:
        return wrapped.full_state_dict()
    return {k: v.detach().clone() for k, v in wrapped.module.state_dict().items()}


def stage_and_load(rank, world, stage, directory):
    wrapped, opt = wrap(stage)
    train(wrapped, opt, rank)
    saved = whole(stage, wrapped)
    save_sharded(directory, wrapped, opt, extra={"step": 2, "note": "x"})
    other, other_opt = wrap(stage, seed=1)
    extra = load_sharded(directory, other, other_opt)
    return stage_of(wrapped, opt), saved, whole(stage, other), extra


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_save_loads_back_its_parameters_buffers_frozen_parameters_and_extra(stage, tmp_path):
    (found, saved, loaded, extra), other_rank = run_world(stage_and_load, 2, stage, str(tmp_path))
    assert found == stage
    # Every rank whole again (stage 3: rank 0 gathers the whole state, rank 1 gets none): what it saved.
    assert other_rank[1].keys() == other_rank[2].keys() and other_rank[3] == extra
    assert all(torch.equal(other_rank[1][k], other_rank[2][k]) for k in other_rank[1])
    assert (other_rank[1] == {}) == (stage == 3)
    assert extra == {"step": 2, "note": "x"}
    assert saved.keys() == loaded.keys() == Model().state_dict().keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved), stage
    assert loaded["seen"].tolist() == [2.0, 2.0] and loaded["scale"].tolist() == [1.5]
    manifest = read_manifest(tmp_path)
    assert manifest["format"] == FORMAT and manifest["stage"] == stage and manifest["world_size"] == 2
    shapes = {"a.weight": [6, 4], "a.bias": [6], "b.weight": [3, 6], "b.bias": [3]}
    # Stage 1 pieces are the optimizer's parameters (the frozen one too, as the worker passes them all).
    assert manifest["params"] == (shapes | {"scale": [1]} if stage == 1 else shapes)
    assert sorted(s["rank"] for s in manifest["shards"]) == [0, 1]
    assert manifest["param_groups"][0]["lr"] == 0.01 and "params" not in manifest["param_groups"][0]
    if stage == 1:
        assert manifest["units"] == []
    else:
        units = manifest["units"]
        assert sorted(n for u in units for n in u["names"]) == sorted(manifest["params"])
        assert all(u["numel"] == sum(torch.Size(manifest["params"][n]).numel() for n in u["names"]) for u in units)


def save_twice(rank, world, directory):
    wrapped, opt = wrap(2)
    train(wrapped, opt, rank, 1)
    save_sharded(directory, wrapped, opt, extra={"step": 1})
    first = sorted(p.name for p in Path(directory).iterdir())
    train(wrapped, opt, rank, 1)
    save_sharded(directory, wrapped, opt, extra={"step": 2})
    return first, sorted(p.name for p in Path(directory).iterdir())


def test_a_second_save_into_the_directory_writes_new_names_and_removes_the_first_saves_shards(tmp_path):
    (first, second), _ = run_world(save_twice, 2, str(tmp_path))
    listed = sorted(s["file"] for s in read_manifest(tmp_path)["shards"])
    assert second == sorted(["manifest.json", *listed])
    assert not set(first) & set(listed)  # fresh names: the files the old manifest listed were never rewritten
    assert all(n.startswith(("shard-00000-of-00002-", "shard-00001-of-00002-")) for n in listed)


def consolidated(rank, world, stage, directory):
    wrapped, opt = wrap(stage)
    train(wrapped, opt, rank)
    save_sharded(directory, wrapped, opt, extra={"step": 2})
    return whole(stage, wrapped)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_consolidated_state_is_the_whole_model_and_each_parameters_adamw_state(stage, tmp_path):
    saved = run_world(consolidated, 2, stage, str(tmp_path))[0]
    state = consolidate(tmp_path)
    assert state.extra == {"step": 2}
    assert state.model.keys() == saved.keys() and all(torch.equal(state.model[k], saved[k]) for k in saved)
    assert state.param_groups[0]["lr"] == 0.01
    for name in ("a.weight", "a.bias", "b.weight", "b.bias"):
        assert sorted(state.optimizer[name]) == ["exp_avg", "exp_avg_sq", "step"], name
        assert state.optimizer[name]["exp_avg"].shape == saved[name].shape
        assert state.optimizer[name]["step"].item() == 2
    # Each parameter its own step: AdamW adds 1 in place, once per parameter.
    assert state.optimizer["a.weight"]["step"] is not state.optimizer["a.bias"]["step"]


def consolidated_into_plain(rank, world, directory):
    # A plain DDP run resumes the consolidated state: the same numbers as a ZeRO-2 run going on from its save.
    wrapped, opt = wrap(2)
    train(wrapped, opt, rank)
    save_sharded(directory, wrapped, opt, extra={"step": 2})
    train(wrapped, opt, rank, 1)
    return whole(2, wrapped)


def test_a_consolidated_state_resumed_by_a_zero1_run_goes_on_as_the_zero2_run_that_saved_it(tmp_path):
    going_on = run_world(consolidated_into_plain, 2, str(tmp_path))[0]
    state = consolidate(tmp_path)
    resumed = run_world(resume_from, 2, state)[0]
    worst = max((resumed[k] - going_on[k]).abs().max().item() for k in going_on)
    assert worst <= 1e-6, worst


def resume_from(rank, world, state):
    wrapped, opt = wrap(1, seed=3)
    extra = load_sharded("(consolidated)", wrapped, opt, source=state)
    train(wrapped, opt, rank, 1) if extra == {"step": 2} else None
    return whole(1, wrapped)


def read_fails_after_the_check(rank, world, directory):
    wrapped, opt = wrap(2)
    train(wrapped, opt, rank)
    save_sharded(directory, wrapped, opt, extra={"step": 2})
    other, other_opt = wrap(2, seed=1)
    plain = zero_checkpoint._load_shard

    def vanished(directory, shard):  # the file passed its digest check, then changed or went before its read
        raise FileNotFoundError(2, "No such file or directory", str(directory / shard["file"]))

    checked_read = zero_checkpoint._read_shard  # the check's own read (rank 0's replicated tensors) still works
    zero_checkpoint._read_shard = lambda d, s: (zero_checkpoint._check_shard(d, s), plain(d, s))[1]
    zero_checkpoint._load_shard = vanished if rank == 1 else plain
    try:
        load_sharded(directory, other, other_opt)
    except CheckpointError as e:
        return str(e), type(e).__name__
    finally:
        zero_checkpoint._load_shard, zero_checkpoint._read_shard = plain, checked_read
    return None, None


def test_a_shard_that_fails_to_read_after_its_check_stops_every_rank_with_restart_not_a_fallback(tmp_path):
    # Some of this rank's parameters may already hold the checkpoint's values: an older checkpoint must not be
    # loaded over them as if nothing had happened (DamagedCheckpoint would let the worker try the one before).
    for message, kind in run_world(read_fails_after_the_check, 2, str(tmp_path)):
        assert kind == "CheckpointError", (kind, message)
        assert message.endswith("read after its check, so this rank's parameters are partly loaded: restart")
        assert "FileNotFoundError" in message and "\n" not in message


def mismatches(rank, world, directory, change):
    wrapped, opt = wrap(1)
    save_sharded(directory, wrapped, opt)
    if rank == 0:
        path = Path(directory) / "manifest.json"
        manifest = json.loads(path.read_text())
        if change == "shape":
            manifest["params"]["b.weight"] = [3, 7]
        elif change == "name":
            manifest["params"]["b.renamed"] = manifest["params"].pop("b.weight")
        elif change == "format":
            manifest["format"] = "another.v0"
        elif change == "buffer":
            first = next(s for s in manifest["shards"] if s["rank"] == 0)
            payload = torch.load(Path(directory) / first["file"], weights_only=True)
            del payload["replicated"]["seen"]
            torch.save(payload, Path(directory) / first["file"])
            first["sha256"] = __import__("hashlib").sha256((Path(directory) / first["file"]).read_bytes()).hexdigest()
        path.write_text(json.dumps(manifest))
    torch.distributed.barrier()
    other, other_opt = wrap(1, seed=1)
    before = [p.detach().clone() for p in other.parameters()]
    try:
        load_sharded(directory, other, other_opt)
    except CheckpointError as e:
        unchanged = all(torch.equal(b, p) for b, p in zip(before, other.parameters()))
        return str(e), isinstance(e, DamagedCheckpoint), unchanged
    return None, None, None


@pytest.mark.parametrize(
    ("change", "says", "damaged"),
    [
        ("shape", "'b.weight' has shape (3, 7), this model (3, 6)", False),
        ("name", "no parameter 'b.weight' (saved from a different model?)", False),
        ("format", "format 'another.v0', expected 'ddp-cluster.sharded-checkpoint.v1'", False),
        ("buffer", "rank 0's shard lacks 'seen' (a buffer or frozen parameter)", False),
    ],
)
def test_a_checkpoint_of_another_model_is_one_line_on_every_rank_and_changes_nothing(change, says, damaged, tmp_path):
    for message, is_damaged, unchanged in run_world(mismatches, 2, str(tmp_path), change):
        assert message is not None and says in message and "\n" not in message, message
        assert is_damaged is damaged and unchanged


def test_a_directory_without_a_manifest_or_with_an_unreadable_one_is_damaged(tmp_path):
    with pytest.raises(DamagedCheckpoint, match="no manifest"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DamagedCheckpoint, match="unreadable manifest"):
        read_manifest(tmp_path)


def test_a_model_and_optimizer_that_are_not_sharded_are_named_in_the_error():
    model = nn.Linear(2, 2)
    with pytest.raises(CheckpointError) as info:
        stage_of(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert str(info.value) == "Linear with SGD: not sharded; use app.worker.checkpoint for plain DDP"


def cut_into_files(rank, world, directory, file_bytes):
    zero_checkpoint.SHARD_FILE_BYTES = file_bytes
    try:
        wrapped, opt = wrap(1)
        train(wrapped, opt, rank)
        save_sharded(directory, wrapped, opt, extra={"step": 2})
    finally:
        zero_checkpoint.SHARD_FILE_BYTES = 64 * 2**20
    other, other_opt = wrap(1, seed=1)
    load_sharded(directory, other, other_opt)
    return whole(1, wrapped), whole(1, other)


def test_a_ranks_shard_is_cut_into_files_of_at_most_shard_file_bytes_and_loads_whole(tmp_path):
    # Each piece carries its parameter and AdamW's two tensors of its size, 12 bytes an element: rank 0 holds
    # a.weight (288 bytes) and b.bias (36), rank 1 b.weight (216) and a.bias (72) (and "scale": 4, no state):
    # a larger piece is a file alone, the small ones share one.
    (saved, loaded), _ = run_world(cut_into_files, 2, str(tmp_path), 100)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    shards = read_manifest(tmp_path)["shards"]
    for rank in (0, 1):
        mine = [s for s in shards if s["rank"] == rank]
        assert [s["part"] for s in mine] == list(range(len(mine)))
    assert [len([s for s in shards if s["rank"] == r]) for r in (0, 1)] == [2, 2]  # one file a rank by default
    assert all(s["file"].endswith(f"-{s['part']}.pt" if s["part"] else ".pt") for s in shards)


def save_the_disk_refuses(rank, world, directory, failing_rank, into_existing):
    import errno
    import os

    wrapped, opt = wrap(2)
    train(wrapped, opt, rank)
    target = Path(directory) / "save"
    if into_existing == "empty":  # a directory someone made for it: it stays
        target.mkdir(exist_ok=True)
    elif into_existing:
        save_sharded(target, wrapped, opt, extra={"step": 1})
    torch.distributed.barrier()
    before = sorted(p.name for p in target.iterdir()) if target.exists() else None
    plain = zero_checkpoint.write_atomically

    def full(path, write):
        if rank == failing_rank or (failing_rank == "manifest" and Path(path).name == "manifest.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return plain(path, write)

    zero_checkpoint.write_atomically = full
    try:
        save_sharded(target, wrapped, opt, extra={"step": 2})
    except zero_checkpoint.ShardWriteError as e:
        torch.distributed.barrier()
        return str(e), e.where, e.cause, before, sorted(p.name for p in target.iterdir()) if target.exists() else None
    finally:
        zero_checkpoint.write_atomically = plain
    return None


@pytest.mark.parametrize(("failing_rank", "into_existing"), [(1, False), (1, "empty"), (1, True), ("manifest", True)])
def test_a_save_the_disk_refuses_raises_on_every_rank_and_leaves_nothing_of_itself(
    failing_rank, into_existing, tmp_path
):
    results = run_world(save_the_disk_refuses, 2, str(tmp_path), failing_rank, into_existing)
    assert results[0][:3] == results[1][:3]  # the same error on every rank: the first rank's file and cause
    message, where, cause, before, after = results[0]
    assert cause == "No space left on device (ENOSPC)"
    if failing_rank == 1:
        assert where.startswith(str(tmp_path / "save" / "shard-00001-of-00002-")) and where.endswith(".pt (rank 1)")
    else:
        assert where == f"{tmp_path / 'save' / 'manifest.json'} (rank 0)"
    assert message == f"{where}: cannot write ({cause}); no manifest written, the previous checkpoint is whole"
    # Nothing of the failed save is left: no directory it created, no shard beside the previous checkpoint's.
    assert after == before
    if into_existing is True:
        consolidate(tmp_path / "save")  # the previous checkpoint still loads whole


def a_rank_holding_nothing(rank, world, directory):
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)  # one parameter: rank 1's partition is empty
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    save_sharded(directory, DDP(model), opt, extra={"step": 1})
    other = nn.Linear(3, 1, bias=False)
    other_opt = ZeroRedundancyOptimizer(other.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    load_sharded(directory, DDP(other), other_opt)
    return torch.equal(model.weight, other.weight), len(opt.owned_parameters())


def test_a_rank_that_holds_no_piece_still_writes_its_file_and_the_world_loads(tmp_path):
    results = run_world(a_rank_holding_nothing, 2, str(tmp_path))
    assert results == [(True, 1), (True, 0)]
    shards = read_manifest(tmp_path)["shards"]
    assert [(s["rank"], s["pieces"]) for s in sorted(shards, key=lambda s: s["rank"])] == [
        (0, {"weight": [0, 3]}),
        (1, {}),
    ]


def test_shards_that_cover_an_element_twice_or_not_at_all_are_a_damaged_checkpoint(tmp_path):
    run_world(consolidated, 2, 2, str(tmp_path))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    first = min(manifest["shards"], key=lambda s: s["rank"])
    manifest["shards"].append(first)  # rank 0's file listed twice: every element of it covered twice
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DamagedCheckpoint, match=r"the shards do not cover every element of '[ab]\.\w+' exactly once"):
        consolidate(tmp_path)
    manifest["shards"] = manifest["shards"][1:-1]  # and now without it
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DamagedCheckpoint, match="exactly once"):
        consolidate(tmp_path)


def sgd_momentum_resumed(rank, world, directory):
    """A ZeRO-2 run of SGD with momentum (its state: a buffer per parameter and no scalar, unlike AdamW's step), saved,
    loaded into another, then one more step of each: do they go on alike?"""

    def sgd(seed: int):
        torch.manual_seed(seed)
        wrapped = ShardedGradDataParallel(Model(), bucket_cap_mb=0.0001)
        return wrapped, wrapped.build_optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)

    wrapped, opt = sgd(0)
    train(wrapped, opt, rank)
    save_sharded(directory, wrapped, opt)
    other, other_opt = sgd(1)
    load_sharded(directory, other, other_opt)
    train(wrapped, opt, rank, steps=1)
    train(other, other_opt, rank, steps=1)
    went_on, resumed = whole(2, wrapped), whole(2, other)
    return all(torch.equal(went_on[k], resumed[k]) for k in went_on)


def test_an_optimizer_state_of_buffers_alone_resumes_sgds_momentum(tmp_path):
    # Without its momentum the resumed step would differ from the uninterrupted run's on every parameter.
    assert run_world(sgd_momentum_resumed, 2, str(tmp_path)) == [True, True]
