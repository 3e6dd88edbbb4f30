"""Loading the settings (app.worker.config.load): each value's conversion from the words a user typed, the one-line
error for each way a value, a name or a file can be wrong, the --help lines, the digest and the start-up log."""

from __future__ import annotations

import re

import pytest

from app.worker.config.checks import ConfigError
from app.worker.config.load import FIELDS, build_parser, convert, describe, digest, load_config, read_env, read_yaml
from app.worker.config.schema import TrainConfig


def error(fn, *args) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    assert "\n" not in str(e.value)
    return str(e.value)


def yaml_file(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


# -- convert: a raw value into the field's type -----------------------------------------------------------------------


def test_a_count_is_read_from_its_digits_with_spaces_around_them():
    assert convert("steps", "12", "flag --steps") == 12
    assert convert("steps", " 12 ", "flag --steps") == 12
    assert convert("steps", 12.0, "config file x") == 12
    assert convert("steps", 12, "config file x") == 12


@pytest.mark.parametrize("raw", ["1.5", 1.5, True, "ten", {"a": 1}])
def test_a_count_refuses_what_is_no_whole_number(raw):
    assert error(convert, "steps", raw, "env DDP_STEPS") == f"steps={raw!r} (from env DDP_STEPS): must be an int"


def test_an_amount_is_read_as_a_float():
    assert convert("lr", "0.5", "flag --lr") == 0.5
    assert convert("lr", 1, "config file x") == 1.0 and isinstance(convert("lr", 1, "config file x"), float)
    for raw in (True, "fast", [1]):
        assert error(convert, "lr", raw, "flag --lr") == f"lr={raw!r} (from flag --lr): must be a float"


def test_a_word_is_taken_as_written_and_a_list_or_mapping_refused():
    assert convert("model", "mini_mlp", "flag --model") == "mini_mlp"
    assert convert("checkpoint_dir", "", "env DDP_CHECKPOINT_DIR") == ""  # a word may be empty: "" = none
    assert convert("checkpoint_dir", 7, "config file x") == "7"
    for raw in ([1, 2], {"a": 1}):
        assert error(convert, "model", raw, "config file x") == f"model={raw!r} (from config file x): must be a str"


def test_an_empty_number_is_unset_where_a_setting_may_be_unset_and_refused_elsewhere():
    assert convert("grad_accum_steps", "", "env DDP_GRAD_ACCUM_STEPS") is None
    assert convert("effective_batch", "  ", "flag --effective-batch") is None
    assert convert("effective_batch", None, "config file x") is None
    assert error(convert, "steps", "", "env DDP_STEPS") == "steps (from env DDP_STEPS) is empty: give a int"
    assert error(convert, "lr", None, "config file x") == "lr (from config file x) is empty: give a float"


def test_a_mapping_is_json_in_the_environment_and_a_mapping_in_the_file():
    assert convert("model_kwargs", '{"hidden": 16}', "env DDP_MODEL_KWARGS") == {"hidden": 16}
    assert convert("loss_kwargs", {"reduction": "sum"}, "config file x") == {"reduction": "sum"}
    assert convert("data_kwargs", "", "flag --data-kwargs") == {}
    assert convert("data_kwargs", None, "config file x") == {}


def test_a_mapping_that_is_not_json_names_the_column():
    assert error(convert, "model_kwargs", '{"hidden": 16', "flag --model-kwargs") == (
        "model_kwargs='{\"hidden\": 16' (from flag --model-kwargs): not JSON (Expecting ',' delimiter at column 14); "
        "give a JSON object, e.g. '{\"hidden\": 16}'"
    )


def test_json_that_is_no_mapping_of_names_says_what_it_is():
    assert error(convert, "model_kwargs", "[16]", "env DDP_MODEL_KWARGS") == (
        "model_kwargs='[16]' (from env DDP_MODEL_KWARGS): must be a mapping of keyword: value (a JSON object in env "
        "and flags), got a list"
    )
    assert error(convert, "model_kwargs", {1: 16}, "config file x") == (
        "model_kwargs={1: 16} (from config file x): must be a mapping of keyword: value (a JSON object in env and "
        "flags), got a mapping with non-string keys"
    )


# -- the file -------------------------------------------------------------------------------------------------------


def test_a_file_that_cannot_be_read_or_parsed_is_one_line(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    assert (
        error(read_yaml, missing)
        == f"config={missing}: cannot read it (No such file or directory); pass an existing YAML file"
    )
    bad = yaml_file(tmp_path, "steps: 5\nlr: [1\n")
    assert re.fullmatch(rf"config={re.escape(bad)}: not valid YAML line \d+ \(.+\)", error(read_yaml, bad))


def test_an_empty_file_sets_nothing(tmp_path):
    assert read_yaml(yaml_file(tmp_path, "")) == {}
    assert read_yaml(yaml_file(tmp_path, "# nothing yet\n")) == {}


def test_a_file_reads_each_value_into_its_type(tmp_path):
    path = yaml_file(tmp_path, "steps: 5\nlr: 1\nmodel: mini_mlp\nmodel_kwargs:\n  hidden: 8\n")
    assert read_yaml(path) == {"steps": 5, "lr": 1.0, "model": "mini_mlp", "model_kwargs": {"hidden": 8}}


def test_a_list_or_mapping_where_a_number_belongs_is_one_line_naming_the_file(tmp_path):
    # It was a TypeError's traceback and exit 1, not the one line and exit 2 every bad value promises.
    path = yaml_file(tmp_path, "steps:\n  a: 1\n")
    assert error(read_yaml, path) == f"steps={{'a': 1}} (from config file {path}): must be an int"
    path = yaml_file(tmp_path, "lr: [1]\n")
    assert error(load_config, ["--config", path], {}) == f"lr=[1] (from config file {path}): must be a float"


def test_an_unknown_key_names_the_nearest_setting_or_lists_them_all(tmp_path):
    path = yaml_file(tmp_path, "stepz: 5\n")
    assert error(read_yaml, path) == f"unknown setting 'stepz' in config file {path}; did you mean 'steps'?"
    far = yaml_file(tmp_path, "qqqqqqqq: 5\n")
    assert error(read_yaml, far) == f"unknown setting 'qqqqqqqq' in config file {far}; known: {', '.join(FIELDS)}"


# -- the environment --------------------------------------------------------------------------------------------------


def test_the_environment_sets_only_ddp_variables_and_the_file_variable_is_not_a_setting():
    assert read_env({"DDP_STEPS": "5", "DDP_LR": "0.5", "DDP_CONFIG": "x.yaml", "STEPS": "7", "PATH": "/bin"}) == {
        "steps": 5,
        "lr": 0.5,
    }


def test_an_unknown_ddp_variable_names_the_nearest_or_the_pattern():
    assert error(read_env, {"DDP_STESP": "5"}) == (
        "DDP_STESP: no such setting (did you mean DDP_STEPS?); unset it or fix its name (python -m app.train --help)"
    )
    assert error(read_env, {"DDP_QQQQQQQQ": "5"}) == (
        "DDP_QQQQQQQQ: no such setting (the settings are DDP_<FIELD>); unset it or fix its name "
        "(python -m app.train --help)"
    )


def test_the_same_unknown_variable_is_named_whatever_order_the_environment_lists_them():
    one = {"DDP_ZZZ": "1", "DDP_AAA": "1"}
    assert error(read_env, one) == error(read_env, dict(reversed(one.items())))
    assert error(read_env, one).startswith("DDP_AAA: ")


# -- load_config ----------------------------------------------------------------------------------------------------


def test_the_file_named_in_ddp_config_is_read_and_every_other_value_is_the_default(tmp_path):
    resolved = load_config([], {"DDP_CONFIG": yaml_file(tmp_path, "steps: 7\n")})
    assert resolved.config == TrainConfig(steps=7)
    assert [n for n, s in resolved.sources.items() if s == "default"] == [n for n in FIELDS if n != "steps"]
    assert resolved.warnings == []


def test_an_empty_ddp_config_reads_no_file():
    assert load_config([], {"DDP_CONFIG": ""}).config == TrainConfig()


def test_load_config_reads_the_process_arguments_and_environment_by_default(monkeypatch):
    monkeypatch.setattr("sys.argv", ["app.train", "--steps", "9"])
    monkeypatch.setenv("DDP_SEED", "4")
    resolved = load_config()
    assert (resolved.config.steps, resolved.config.seed) == (9, 4)
    assert (resolved.sources["steps"], resolved.sources["seed"]) == ("flag --steps", "env DDP_SEED")


def test_a_refused_value_names_its_source_and_a_refused_combination_of_defaults_does_not():
    assert error(load_config, ["--steps", "0"], {}) == "steps=0: must be an integer >= 1 (set by flag --steps)"
    # warmup_steps is the user's; steps is the default that it exceeds: the message names the field that failed.
    assert error(load_config, [], {"DDP_WARMUP_STEPS": "201"}) == (
        "warmup_steps=201 exceeds steps=200: lower it or raise steps (set by env DDP_WARMUP_STEPS)"
    )
    # The field that starts the message is at its default: no source to name.
    assert error(load_config, ["--wrapper", "none", "--parallel", "dp", "--lr-schedule", "cosine"], {}) == (
        "lr_schedule=cosine: the recipe runs with parallel=ddp|pipeline|zero1|zero2|zero3 (not yet in the dp step); "
        "unset it, or use one of those (set by flag --lr-schedule)"
    )
    assert error(load_config, ["--model", "pkg.mod:Net", "--data", "pkg.mod:d"], {}) == (
        'loss="": model=pkg.mod:Net is not a built-in model, so it has no built-in loss; set loss '
        "(cross_entropy | mse | 'package.module:callable')"
    )


def test_an_unknown_flag_is_one_line():
    assert "--stpes" in error(load_config, ["--stpes", "5"], {})


# -- --help, the digest, the start-up log -----------------------------------------------------------------------------


def test_every_setting_has_a_flag_whose_help_gives_its_doc_variable_and_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # one line per flag: argparse wraps at hyphens too
    text = " ".join(build_parser().format_help().split())
    defaults = TrainConfig()
    for name, f in FIELDS.items():
        doc = " ".join(f.metadata["doc"].split())
        default = "unset" if f.default is None else repr(getattr(defaults, name))
        assert f"--{name.replace('_', '-')} " in text and doc in text, name
        assert f"[env DDP_{name.upper()}; default {default}]" in text, name
    for flag in ("--steps INT", "--lr FLOAT", "--model STR", "--model-kwargs JSON", "--grad-accum-steps INT"):
        assert flag in text, flag
    assert text.startswith("usage: python -m app.train ") and "(or env DDP_CONFIG)" in text


def test_the_digest_is_12_hex_digits_that_change_with_any_setting():
    base = digest(TrainConfig())
    assert re.fullmatch(r"[0-9a-f]{12}", base)
    assert digest(load_config([], {}).config) == base
    others = {digest(TrainConfig(steps=201)), digest(TrainConfig(lr=0.004)), digest(TrainConfig(model_kwargs={"a": 1}))}
    assert base not in others and len(others) == 3


def test_the_start_up_log_gives_every_setting_its_value_and_source_one_per_line():
    text = describe(load_config(["--steps", "9"], {"DDP_SEED": "4"}))
    lines = text.splitlines()
    assert lines[0] == "configuration:" and len(lines) == 1 + len(FIELDS)
    width = max(map(len, FIELDS))
    assert f"  {'steps':<{width}} = {9!r:<12} (flag --steps)" in lines
    assert f"  {'seed':<{width}} = {4!r:<12} (env DDP_SEED)" in lines
    assert f"  {'model':<{width}} = {'mini_mlp'!r:<12} (default)" in lines


def test_an_optional_count_is_read_as_a_count_and_the_names_follow_the_field():
    from app.worker.config.load import env_name, flag_name

    assert convert("grad_accum_steps", "3", "env DDP_GRAD_ACCUM_STEPS") == 3
    assert error(convert, "effective_batch", "3.5", "flag --effective-batch") == (
        "effective_batch='3.5' (from flag --effective-batch): must be an int"
    )
    assert (env_name("grad_accum_steps"), flag_name("grad_accum_steps")) == (
        "DDP_GRAD_ACCUM_STEPS",
        "--grad-accum-steps",
    )
