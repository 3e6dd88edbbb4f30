"""Shared by every test folder: the markers, and the layout they stand for.

- ``tests/unit``: one process, no network, seconds in all (``make test-fast``).
- ``tests/integration``: real gloo ranks on loopback, torchrun, a real Prometheus (``-m integration``).
- ``tests/e2e``: Docker Compose and containers for real (``-m e2e``).

Each test is marked by the folder it sits in, so ``pytest -m "not e2e"`` selects without per-file decorators.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
        if folder in ("unit", "integration", "e2e"):
            item.add_marker(getattr(pytest.mark, folder))


@pytest.fixture(autouse=True)
def _keep_worker_output(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Where tests.trainer_run.keep_output writes a failed worker's whole output: one folder per test under
    pytest's tmp dir (created only when something is written)."""
    from tests import trainer_run

    name = re.sub(r"[^\w.-]+", "_", request.node.name)[:120]
    # Resolved only when something is written: most tests never need pytest's tmp dir.
    trainer_run.OUTPUT_DIR = lambda: tmp_path_factory.getbasetemp() / "worker-output" / name
    yield
    trainer_run.OUTPUT_DIR = None
