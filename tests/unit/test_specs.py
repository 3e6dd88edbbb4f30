"""Import specs (``app.specs``): a spec builds what it names, and each way of getting one wrong is one line that names
the spec and the cause, raised before the callable runs where it can be."""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch import nn

from app.specs import MODEL_SPECS, SpecError, build, build_model, expand
from app.worker.models import MiniMLP, TinyTransformer
from tests.trainer_run import REPO


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's module on sys.path: ``write("name", source)`` makes ``name`` importable."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        sys.modules.pop(name, None)
        return name

    return write


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


def test_a_spec_builds_the_model_with_its_keywords():
    model = build_model("app.worker.models:MiniMLP", {"hidden": 32})
    assert isinstance(model, MiniMLP)
    assert model.net[0].out_features == 32


def test_the_built_in_names_are_aliases_of_specs():
    assert MODEL_SPECS["mini_mlp"] == "app.worker.models:MiniMLP"
    assert isinstance(build_model("mini_mlp"), MiniMLP)
    assert isinstance(build_model("tiny_transformer", {"layers": 1}), TinyTransformer)
    assert expand("pkg.mod:fn", MODEL_SPECS) == "pkg.mod:fn"


def test_a_dotted_attribute_and_any_result_without_a_type(user_module):
    user_module("user_factory", "class Factory:\n    @staticmethod\n    def make(n=1):\n        return [n] * n\n")
    assert build("user_factory:Factory.make", {"n": 2}) == [2, 2]


def test_spec_error_is_a_value_error():
    assert issubclass(SpecError, ValueError)


def test_a_spec_without_a_colon():
    with pytest.raises(SpecError) as e:
        build_model("app.worker.models.MiniMLP")
    assert "'app.worker.models.MiniMLP'" in one_line(e)
    assert "package.module:callable" in str(e.value) and "mini_mlp" in str(e.value)


def test_a_module_that_does_not_import_names_the_failed_import(user_module):
    user_module("user_models", "import a_package_nobody_installed\n")
    with pytest.raises(SpecError) as e:
        build_model("user_models:Net")
    assert "'user_models'" in one_line(e)
    assert "a_package_nobody_installed" in str(e.value)


def test_a_module_that_is_not_there():
    with pytest.raises(SpecError) as e:
        build_model("no_such_module_here:Net")
    assert "no_such_module_here" in one_line(e) and "does not import" in str(e.value)


def test_a_missing_attribute():
    with pytest.raises(SpecError) as e:
        build_model("app.worker.models:NoSuchModel")
    assert "has no attribute 'NoSuchModel'" in one_line(e)


def test_a_keyword_the_callable_does_not_take_is_refused_before_calling_it(user_module):
    user_module("user_counted", "CALLS = []\ndef make(width=4):\n    CALLS.append(width)\n    return width\n")
    with pytest.raises(SpecError) as e:
        build("user_counted:make", {"depth": 3})
    assert "'user_counted:make'" in one_line(e)
    assert "depth" in str(e.value) and "it takes: width" in str(e.value)
    assert sys.modules["user_counted"].CALLS == []  # refused from the signature, never called


def test_a_result_of_the_wrong_kind():
    with pytest.raises(SpecError) as e:
        build_model("tests.models_broken:not_a_model")
    assert "returned a list, not a torch.nn.Module" in one_line(e)


def test_a_callable_that_raises_is_one_line_with_where(user_module):
    user_module("user_raises", "def make():\n    raise RuntimeError('no GPU\\nhere')\n")
    with pytest.raises(SpecError) as e:
        build("user_raises:make")
    assert "RuntimeError: no GPU here (user_raises.py:2)" in one_line(e)


def test_something_that_is_not_callable():
    with pytest.raises(SpecError) as e:
        build("app.specs:MODEL_SPECS")
    assert "is a dict, not a function or class" in one_line(e)


def test_build_checks_the_type_it_is_asked_for():
    assert isinstance(build("torch.nn:Linear", {"in_features": 2, "out_features": 3}, returns=nn.Module), nn.Linear)
    with pytest.raises(SpecError, match="returned an int, not Module"):
        build("builtins:int", returns=nn.Module)


def test_a_loss_gets_its_keywords_as_a_function_and_as_a_class():
    import torch

    from app.specs import build_loss

    out, target = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)), torch.arange(6)
    plain = nn.functional.cross_entropy(out, target)
    scaled = build_loss("tests.models_user:scaled_cross_entropy", {"scale": 2.0})  # a function: keywords bound
    assert scaled(out, target).item() == pytest.approx(2 * plain.item(), rel=1e-6)
    assert build_loss("tests.models_user:scaled_cross_entropy", {})(out, target).item() == pytest.approx(plain.item())
    smoothed = build_loss("torch.nn:CrossEntropyLoss", {"label_smoothing": 0.2})  # a class: instantiated with them
    expected = nn.functional.cross_entropy(out, target, label_smoothing=0.2)
    assert smoothed(out, target).item() == pytest.approx(expected.item()) != pytest.approx(plain.item())
    with pytest.raises(SpecError, match="unexpected keyword argument 'scal'"):
        build_loss("tests.models_user:scaled_cross_entropy", {"scal": 2.0})


def test_importing_specs_does_not_import_torch():
    code = "import sys, app.specs; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
