"""Weights in and out (app.worker.checkpoint.weights, app.export, ``init_from``): every source a user may point at
is read safely, loaded by name, refused in one line when it does not fit; the export loads into the bare model.

The resumes across kinds (ddp -> zero2 -> ddp on other world sizes, zero3 <-> ddp) and the export of a sharded
checkpoint run for real in tests/integration/test_train_sharded.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.export import main as export_main
from app.worker.checkpoint.files import save_checkpoint
from app.worker.checkpoint.weights import WeightsError, load_model_state, read_model_state
from app.worker.config import ConfigError, TrainConfig
from app.worker.models import MiniMLP
from app.worker.workload import build_model


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def _trained() -> MiniMLP:
    torch.manual_seed(7)
    return MiniMLP()


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_state_dict_file_loads_by_name(tmp_path):
    torch.save(_trained().state_dict(), tmp_path / "w.pt")
    model = MiniMLP()
    load_model_state(model, read_model_state(tmp_path / "w.pt"), "w.pt")
    assert _equal(model, _trained())


def test_a_checkpoint_file_and_a_checkpoint_dir_give_their_model(tmp_path):
    state = {"step": 3, "model_name": "mini_mlp", "model": _trained().state_dict(), "optimizer": {}, "data": {}}
    save_checkpoint(tmp_path, state | {"rng": {}}, keep=2)
    for source in (tmp_path, tmp_path / "step-00000003.pt"):
        model = MiniMLP()
        load_model_state(model, read_model_state(source), str(source))
        assert _equal(model, _trained()), source


def test_a_file_that_would_run_pickled_code_is_refused_not_run(tmp_path):
    torch.save({"w": torch.zeros(1), "how": Tied}, tmp_path / "evil.pt")  # a class: only a full unpickler runs it
    with pytest.raises(WeightsError, match="not a weights file torch can read safely") as e:
        read_model_state(tmp_path / "evil.pt")
    assert "\n" not in str(e.value)


def test_weights_of_another_model_name_the_first_mismatches_in_one_line(tmp_path):
    other = nn.Sequential(nn.Linear(3, 5))
    with pytest.raises(WeightsError) as e:
        load_model_state(MiniMLP(), other.state_dict(), "other.pt")
    message = str(e.value)
    assert (
        message.startswith("other.pt does not fit the model (missing: ") and "unexpected: 0.weight, 0.bias" in message
    )
    assert "\n" not in message
    shaped = {k: torch.zeros(1) if k.endswith("bias") else v for k, v in MiniMLP().state_dict().items()}
    with pytest.raises(WeightsError, match=r"shape: .*bias \(1,\) != "):
        load_model_state(MiniMLP(), shaped, "shaped.pt")


def test_a_tied_weight_may_be_given_under_either_name():
    source = Tied()
    only_head = {"head.weight": source.head.weight.detach().clone()}
    model = Tied()
    load_model_state(model, only_head, "tied.pt")
    assert torch.equal(model.embed.weight, source.embed.weight)


def test_export_writes_safetensors_the_bare_model_loads(tmp_path, capsys):
    pytest.importorskip("safetensors", reason="the export extra: pip install safetensors")
    from safetensors.torch import load_file

    torch.save(_trained().state_dict(), tmp_path / "w.pt")
    assert export_main([str(tmp_path / "w.pt"), str(tmp_path / "m.safetensors")]) == 0
    model = MiniMLP()
    model.load_state_dict(load_file(tmp_path / "m.safetensors"))
    assert _equal(model, _trained())
    assert "exported 6 tensors" in capsys.readouterr().out


@pytest.mark.parametrize(
    "source, output, cause",
    [
        ("missing", "m.pt", "missing: no such file or directory"),
        ("w.pt", "m.bin", "m.bin: name it *.pt or *.safetensors"),
        ("w.pt", "nowhere/m.pt", "does not exist"),
    ],
)
def test_a_bad_export_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, monkeypatch, source, output, cause):
    monkeypatch.chdir(tmp_path)
    torch.save(_trained().state_dict(), tmp_path / "w.pt")
    assert export_main([source, output]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m app.export: error: ") and cause in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.pt"]


def test_init_from_starts_any_kind_from_the_given_weights(tmp_path):
    torch.save(_trained().state_dict(), tmp_path / "w.pt")
    model = build_model(TrainConfig(init_from=str(tmp_path / "w.pt")))
    assert _equal(model, _trained())


def test_init_from_that_does_not_fit_is_a_config_error_naming_the_setting(tmp_path):
    torch.save(nn.Linear(2, 2).state_dict(), tmp_path / "small.pt")
    with pytest.raises(ConfigError, match=r"^init_from='.*small\.pt': .*does not fit the model \(missing: "):
        build_model(TrainConfig(init_from=str(tmp_path / "small.pt")))


def test_a_checkpoint_dir_gives_its_newest_checkpoint_that_loads_and_is_left_as_it_was(tmp_path, caplog):
    import json

    from app.parallel.zero.checkpoint import FORMAT

    state = {"step": 3, "model_name": "mini_mlp", "model": _trained().state_dict(), "optimizer": {}, "data": {}}
    save_checkpoint(tmp_path, state | {"rng": {}}, keep=5)
    (tmp_path / "step-00000004.pt").write_bytes(b"torn")  # a plain file that does not load
    newest = tmp_path / "sharded-step-00000005"  # a sharded one whose shard is gone
    newest.mkdir()
    shard = {"rank": 0, "file": "shard-00000-of-00001-ab.pt", "sha256": "0" * 64, "pieces": {}}
    manifest = {"format": FORMAT, "params": {}, "shards": [shard], "param_groups": [], "extra": {"step": 5}}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    model = MiniMLP()
    load_model_state(model, read_model_state(tmp_path), str(tmp_path))
    assert _equal(model, _trained())  # step 3's
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and "sharded-step-00000005" in warned[0] and "step-00000004.pt" in warned[1], warned
    assert "listed in the manifest but unreadable" in warned[0]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # a reader renames nothing
    (tmp_path / "step-00000003.pt").write_bytes(b"torn too")
    with pytest.raises(WeightsError, match=r"none of its 3 checkpoints loads"):
        read_model_state(tmp_path)


def test_an_optimizer_state_by_name_comes_back_to_a_plain_optimizer_as_it_was():
    # parallel=ddp resuming a ZeRO run's checkpoint: each parameter's AdamW moments, held by name, must land at that
    # parameter's position in a plain optimizer, or the resumed run restarts its moments from zero.
    from app.worker.checkpoint.weights import consolidated_from_plain, plain_optimizer_state

    torch.manual_seed(0)
    model = MiniMLP()
    trained = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 32)).sum().backward()
    trained.step()
    names = [n for n, _ in model.named_parameters()]
    whole = consolidated_from_plain(
        {"model": model.state_dict(), "optimizer": trained.state_dict(), "param_names": names}
    )
    fresh_model = MiniMLP()
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.01)
    fresh.load_state_dict(plain_optimizer_state(whole, fresh_model, fresh))
    want, got = trained.state_dict()["state"], fresh.state_dict()["state"]
    assert sorted(got) == sorted(want) == list(range(len(names)))
    for i in want:
        assert all(torch.equal(want[i][k], got[i][k]) for k in want[i]), names[i]


def test_a_long_list_of_mismatches_names_the_first_three_and_counts_the_rest():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])  # 6 tensors, none of them in the file
    with pytest.raises(WeightsError) as e:
        load_model_state(model, {"x": torch.zeros(1)}, "w.pt")
    assert str(e.value) == (
        "w.pt does not fit the model (missing: 0.weight, 0.bias, 1.weight and 3 more; unexpected: x); "
        "give weights of this model"
    )
    three = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, bias=False))
    with pytest.raises(WeightsError, match=r"\(missing: 0\.weight, 0\.bias, 1\.weight\); give"):
        load_model_state(three, {}, "w.pt")


def test_the_saved_hyperparameters_come_back_per_group_where_the_groups_match_and_else_the_optimizers_own():
    from app.worker.checkpoint.weights import consolidated_from_plain, plain_optimizer_state

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    names = [n for n, _ in model.named_parameters()]
    two = torch.optim.AdamW(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "weight_decay": 0.5}], lr=0.2
    )
    whole = consolidated_from_plain({"model": model.state_dict(), "optimizer": two.state_dict(), "param_names": names})
    assert whole.optimizer == {} and whole.extra == {}
    again = torch.optim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.9, weight_decay=0.0
    )
    groups = plain_optimizer_state(whole, model, again)["param_groups"]
    assert [(g["lr"], g["weight_decay"], g["params"]) for g in groups] == [(0.1, 0.01, [0, 1]), (0.2, 0.5, [2, 3])]
    one = torch.optim.AdamW(model.parameters(), lr=0.9)  # another number of groups: its own hyperparameters
    assert [(g["lr"], g["params"]) for g in plain_optimizer_state(whole, model, one)["param_groups"]] == [
        (0.9, [0, 1, 2, 3])
    ]


def test_a_plain_checkpoint_that_does_not_name_its_parameters_cannot_be_cut_into_shards():
    from app.worker.checkpoint.weights import consolidated_from_plain

    with pytest.raises(WeightsError, match=r"^it does not name its optimizer's parameters \(saved by an older"):
        consolidated_from_plain({"model": {}, "optimizer": {"state": {}, "param_groups": []}})
