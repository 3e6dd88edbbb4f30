"""The trainer's start-up helpers (app/worker/startup.py): the one start-up line, and torch._dynamo deferred.

.venv/bin/python -m pytest tests/unit/test_startup.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.worker.startup import StartupClock

ROOT = Path(__file__).resolve().parents[2]

# Three AdamW steps and a state_dict round trip (every torch.optim entry point that touches torch._dynamo), then
# whether the real torch._dynamo was imported, then a submodule import (what torch.compile would need).
STEPS = """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
opt.load_state_dict(opt.state_dict())
opt.step()
"""
TRAIN = (
    """
import json, sys, torch
from app.torch_patches import DeferredDynamo
from app.worker.startup import defer_dynamo_import
deferred = defer_dynamo_import({} if sys.argv[1] == "unset" else {"TRAINER_DEFER_DYNAMO": sys.argv[1]})
"""
    + STEPS
    + """stand_in = isinstance(sys.modules.get("torch._dynamo"), DeferredDynamo)
import torch._dynamo.config
print(json.dumps({
    "deferred": deferred,
    "stand_in_after_training": stand_in,
    "real_after_submodule": type(sys.modules["torch._dynamo"]).__name__ == "module"
    and hasattr(torch._dynamo, "optimize"),
    "params": [p.detach().double().flatten().tolist() for p in model.parameters()],
}))
"""
)


def train_deferred(setting: str = "unset") -> dict:
    """TRAIN in a fresh interpreter (no torch._dynamo imported yet), TRAINER_DEFER_DYNAMO unset or set to this."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", TRAIN, setting], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_here() -> list:
    """TRAIN's parameters, in this process, with torch's own torch._dynamo."""
    scope = {"torch": torch}
    exec(STEPS, scope)  # the very steps TRAIN takes
    model = scope["model"]
    return [p.detach().double().flatten().tolist() for p in model.parameters()]


def test_deferred_dynamo_trains_the_same_without_importing_it_and_gives_way_to_the_real_one():
    deferred = train_deferred()
    assert deferred["deferred"]
    assert deferred["stand_in_after_training"], "torch.optim imported the real torch._dynamo despite the stand-in"
    assert deferred["params"] == train_here()  # bit for bit: the stand-in changes nothing torch computes
    assert deferred["real_after_submodule"], "a torch._dynamo submodule import did not bring the real one"


def test_told_0_torch_optim_imports_the_real_dynamo_as_it_does_without_the_trainer():
    kept = train_deferred("0")
    assert not kept["deferred"] and not kept["stand_in_after_training"]


def test_the_start_up_line_names_each_phase_and_their_sum():
    clock = StartupClock()
    torch.zeros(1)
    clock.mark("torch import")
    clock.mark("model build")
    names = [name for name, _ in clock.phases]
    assert names == ["process", "torch import", "model build"]  # process: this process's age, read from /proc
    line = clock.line()
    assert line.startswith("start-up: process ") and ", torch import " in line and ", model build " in line
    assert line.endswith(f"= {sum(s for _, s in clock.phases):.2f} s")


def test_a_process_whose_start_cannot_be_read_has_no_age_rather_than_an_error(monkeypatch):
    # Where /proc/<pid>/stat is missing (another OS, a sandbox without /proc) the start-up line leaves the process
    # phase out; it must not end the run. A pid no process has stands for it here: its stat file does not exist.
    from app.worker.startup import process_age_s

    assert 0 <= process_age_s() < 3600  # this very process, read from /proc
    monkeypatch.setattr(os, "getpid", lambda: 2**22 + 1)  # above the kernel's pid_max: no such process
    assert process_age_s() is None


def test_a_run_that_compiles_gets_the_real_dynamo_not_the_stand_in():
    # app.train passes compiling=True when the compile setting is on: the stand-in must not be put in place, so the
    # train() import that follows brings torch's own (its disable() and graph_break() are not no-ops under compile).
    # tests/integration/test_train_compile.py runs such a run to its end.
    code = (
        "import sys\n"
        "from app.worker.startup import defer_dynamo_import\n"
        "print(defer_dynamo_import({}, compiling=True), 'torch._dynamo' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False"]  # not deferred, and nothing in torch._dynamo's place


def test_a_processs_age_is_the_time_since_the_kernel_started_it():
    """The "process" phase is this process's age as the kernel keeps it: what ps says (whole seconds), not 0 or a
    clock of another kind."""
    import shutil

    from app.worker.startup import process_age_s

    if shutil.which("ps") is None:
        pytest.skip("no ps here to read the process's age independently")
    age = process_age_s()
    elapsed = int(
        subprocess.run(["ps", "-o", "etimes=", "-p", str(os.getpid())], capture_output=True, text=True).stdout
    )
    assert elapsed - 1 <= age <= elapsed + 2, (age, elapsed)
