"""app.parallel.compile's choice of units (``compile_units``): which modules are compiled one by one, without
compiling anything. What compiling them does to DDP's overlap runs in tests/integration/test_ddp_compile.py.

    .venv/bin/python -m pytest tests/unit/test_compile.py
"""

from __future__ import annotations

from torch import nn

from app.parallel.compile import default_units
from app.worker.models import TinyTransformer


def test_the_units_are_the_classes_a_setting_names_and_else_the_largest_lists_items():
    model = TinyTransformer(layers=2)
    assert sorted(default_units(model)) == ["blocks.0", "blocks.1"]  # none named: the blocks
    named = default_units(model, ["Linear"])  # compile_units=Linear: every Linear, inside the blocks or not
    assert named and all(isinstance(m, nn.Linear) for m in named.values()), sorted(named)
    assert "head" in named
