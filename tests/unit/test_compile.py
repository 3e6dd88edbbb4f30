"""app.parallel.compile's choice of units (``compile_units``): which modules are compiled one by one, without
compiling anything. What compiling them does to DDP's overlap runs in tests/integration/test_ddp_compile.py.

    .venv/bin/python -m pytest tests/unit/test_compile.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from app.parallel.compile import BACKENDS, compile_at_buckets, compile_units, default_units
from app.worker.models import TinyTransformer


def test_the_units_are_the_classes_a_setting_names_and_else_the_largest_lists_items():
    model = TinyTransformer(layers=2)
    assert sorted(default_units(model)) == ["blocks.0", "blocks.1"]  # none named: the blocks
    named = default_units(model, ["Linear"])  # compile_units=Linear: every Linear, inside the blocks or not
    assert named and all(isinstance(m, nn.Linear) for m in named.values()), sorted(named)
    assert "head" in named


def test_the_backends_are_readable_without_importing_torch_and_a_bad_one_is_refused_naming_them():
    # app.worker.config reads BACKENDS: a bad --compile must fail before the seconds-long torch import.
    code = (
        "import sys, app.parallel.compile as c; assert 'torch' not in sys.modules, 'torch imported'; print(c.BACKENDS)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True)
    assert done.returncode == 0 and done.stdout == b"('aot_eager', 'inductor')\n", done.stderr.decode()[-300:]
    assert BACKENDS == ("aot_eager", "inductor")
    for compile_fn in (compile_units, compile_at_buckets):
        with pytest.raises(ValueError, match=r"^backend='eager': choose one of aot_eager, inductor$"):
            compile_fn([], "eager")


def test_a_unit_is_compiled_once_and_a_unit_without_parameters_is_no_unit():
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    assert compile_units([first], "aot_eager") == [first]
    assert compile_units([first, second], "aot_eager") == [second]  # the first was compiled already: left as it is
    assert getattr(first.forward, "_compiled_unit", False)
    assert sorted(first.state_dict()) == ["bias", "weight"]  # only forward changed: names and keys did not
    with pytest.raises(ValueError, match=r"^none of 0, 1 holds a parameter$"):
        default_units(nn.Sequential(nn.ReLU(), nn.Tanh()))
    assert list(default_units(nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))) == ["1"]
