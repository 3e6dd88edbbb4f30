"""A pytest plugin of ``make mutants`` (tools/mutation.py): ``--timeout N`` caps every test at N seconds, a test's
own ``@pytest.mark.timeout`` included (pytest-timeout lets a marker win over the command line).

Why: the launcher tests mark themselves ``timeout(600)`` so that a loaded CI machine does not fail them, and a
mutant that hangs one of them would cost ten minutes. The cap applies to the unmutated rerun of each killing test as
well (``confirm_kills``), so a test that is merely slow on this machine is not counted as a kill.

    python -m pytest -p tools.mutation_timeout --timeout 120 tests/integration/test_launch.py
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cap = config.getoption("timeout", None)
    if not cap:
        return
    for item in items:
        marker = item.get_closest_marker("timeout")
        own = marker.args[0] if marker and marker.args else (marker.kwargs.get("timeout") if marker else None)
        if own is None or float(own) > float(cap):
            item.add_marker(pytest.mark.timeout(float(cap)), append=False)
