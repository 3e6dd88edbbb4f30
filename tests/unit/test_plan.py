"""``python -m app.plan``: the formula's arithmetic, the one-line errors, and its predictions against the peaks the
memory bench measured (``bench/results/memory.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app import plan
from app.plan import ModelFacts, PlanError, parse_memory, parse_worlds, predict, split_state, state_bytes

PSI = 1_000_003  # odd: the ceil of the sharded terms shows
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "memory.json"


@pytest.mark.parametrize(
    ("kind", "per_param_times_n"),
    # bytes per parameter times N at N=4, AdamW fp32: ddp 16, zero1 4+4+8/4, zero2 4+12/4, zero3 16/4
    [("ddp", 64), ("zero1", 40), ("zero2", 28), ("zero3", 16)],
)
def test_state_bytes_follow_zero_formula(kind, per_param_times_n):
    psi = 4 * 1000  # divisible by 4: exact
    assert state_bytes(kind, psi, 4) * 4 == per_param_times_n * psi


def test_sharded_terms_round_up_and_world_one_is_ddp():
    p, g, k = split_state("zero3", PSI, 4)
    assert (p, g, k) == (-(-4 * PSI // 4), -(-4 * PSI // 4), -(-8 * PSI // 4))
    assert {kind: state_bytes(kind, PSI, 1) for kind in plan.KINDS} == dict.fromkeys(plan.KINDS, 16 * PSI)
    assert state_bytes("zero1", PSI, 2, optimizer_bytes=4) == 4 * PSI + 4 * PSI + 2 * PSI  # SGD's momentum


def test_predict_adds_what_each_kind_keeps_in_flight():
    facts = ModelFacts(psi=PSI, largest_unit=1000, activation_bytes=7)
    ddp = predict("ddp", 2, facts, base=100)
    assert ddp.in_flight == 4 * PSI  # one bucket (25 MiB) holds this small model whole
    assert ddp.peak == 100 + 16 * PSI + 4 * PSI + 7
    # The load maps the file and copies it out tensor by tensor: it holds what training holds, no more.
    assert ddp.resume_held == 16 * PSI and ddp.resume_peak == ddp.peak
    z2 = predict("zero2", 2, facts, base=100)
    assert z2.in_flight == 4 * PSI  # two buckets (the one filling, one reduce-scattering) hold this model whole
    # its parameters, the optimizer state it fills, one file (installed straight into the parameters: no staging)
    assert z2.resume_held == 4 * PSI + -(-8 * PSI // 2) + -(-12 * PSI // 2)
    z3 = predict("zero3", 2, facts, base=100)
    assert z3.largest_unit == 4000 and z3.in_flight == 3 * 4000
    assert z3.peak == max(100 + state_bytes("zero3", PSI, 2) + 4 * 4000 + 7, 100 + 4 * PSI)
    tiny_unit = ModelFacts(psi=PSI, largest_unit=1, activation_bytes=0)
    assert predict("zero3", 64, tiny_unit, base=0).peak_phase == "construction"  # the whole model, once


@pytest.mark.parametrize(
    ("text", "expected"), [("1300m", 1300 * 2**20), ("1.5g", 3 * 2**29), ("800MiB", 800 * 2**20), ("2GB", 2 * 2**30)]
)
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "12x", "m", "-1g", "0m", "1.2.3g"])
def test_parse_memory_refuses_in_one_line(text):
    with pytest.raises(PlanError, match="--memory") as e:
        parse_memory(text)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["", "two", "0,2", "2,-4"])
def test_parse_worlds_refuses(text):
    with pytest.raises(PlanError, match="--world"):
        parse_worlds(text)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["app.worker.models:MiniMLP", "--memory", "lots"], "--memory 'lots'"),
        (["app.worker.models:MiniMLP", "--world", "2,x"], "--world '2,x'"),
        (["no_such_module_here:Model"], "spec 'no_such_module_here:Model'"),
        (["app.worker.models:MiniMLP", "--model-kwargs", "{hidden"], "--model-kwargs"),
        (["app.worker.models:MiniMLP", "--model-kwargs", '{"depth": 3}'], "depth"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(argv, says, capsys):
    assert plan.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m app.plan: error: ") and says in err


def test_cli_prints_every_kind_and_world_with_a_verdict(capsys):
    assert plan.main(["mini_mlp", "--world", "2,3", "--memory", "64m", "--base", "10m"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.split()[:1] and line.split()[0] in plan.KINDS]
    assert len(rows) == 8 and all(line.endswith("FITS") for line in rows)  # a tiny model in 64 MiB
    assert plan.main(["mini_mlp", "--world", "2", "--memory", "1m", "--base", "10m"]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_predictions_within_15_percent_of_the_measured_peaks():
    """The planner, from the model facts and bases the bench recorded, against every peak it measured."""
    doc = json.loads(RESULTS.read_text())
    facts = ModelFacts(**doc["facts"])
    for world, rows in doc["results"].items():
        for kind, row in rows.items():
            plan_ = predict(kind, int(world), facts, row["base"]["peak_bytes"])
            assert plan_.peak == row["predicted"]["peak"], f"{kind} N={world}: the file's prediction is stale"
            for run, predicted in (("fresh", plan_.peak), ("resume", plan_.resume_peak)):
                measured = row[run]["peak_bytes"]
                assert abs(predicted / measured - 1) <= 0.15, f"{kind} N={world} {run}: {predicted=} {measured=}"


def test_activation_checkpointing_is_measured_and_moves_every_kinds_line(capsys):
    # tiny_transformer's blocks are its units: with them checkpointed a micro-batch keeps less, and the planner's
    # every prediction (and its word on what moves the line further) follows.
    assert plan.main(["tiny_transformer", "--world", "2", "--base", "10m", "--json"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert (
        plan.main(
            ["tiny_transformer", "--world", "2", "--base", "10m", "--json", "--activation-checkpointing", "units"]
        )
        == 0
    )
    on = json.loads(capsys.readouterr().out)
    facts = off["facts"]
    saved = facts["activation_bytes"] - facts["activation_bytes_checkpointed"]
    assert saved > 0
    assert [a["peak"] - b["peak"] for a, b in zip(off["predictions"], on["predictions"])] == [saved] * 4
    predictions = [
        plan.Prediction(**{k: v for k, v in r.items() if k in plan.Prediction.__dataclass_fields__})
        for r in off["predictions"]
    ]
    said = plan.what_moves_the_line(predictions, ModelFacts(**facts))  # the plain output's last two lines
    assert said[0].startswith(f"activation checkpointing (units) lowers each peak by {saved / 2**20:.1f} MiB")
    # its AdamW state is smaller than one micro-batch's activations: checkpointing moves the line further
    assert said[1].endswith("activation checkpointing moves the line further for this model and micro-batch")


def test_the_measured_activation_checkpointing_runs_are_within_15_percent_of_the_plan():
    doc = json.loads(RESULTS.read_text())
    ac = doc["activation_checkpointing"]
    for setting, run in ac["runs"].items():
        plan_ = predict(
            ac["kind"],
            ac["world_size"],
            ModelFacts(**ac["facts"]),
            ac["base_bytes"],
            activation_checkpointing=setting == "units",
        )
        assert plan_.peak == run["predicted_bytes"], f"{setting}: the file's prediction is stale"
        assert abs(plan_.peak / run["peak_bytes"] - 1) <= 0.15, f"{setting}: {plan_.peak=} {run['peak_bytes']=}"


def test_zero1_in_flight_uses_stage1s_broadcast_bucket():
    # The planner imports no torch, so it repeats stage 1's bucket: a change to one must reach the other.
    from app import plan
    from app.parallel.zero import stage1

    assert plan.BROADCAST_BUCKET_BYTES == stage1.BROADCAST_BUCKET_BYTES


def test_resume_term_uses_the_sharded_checkpoints_file_size():
    from app import plan
    from app.parallel.zero import checkpoint

    assert plan.SHARD_FILE_BYTES == checkpoint.SHARD_FILE_BYTES
