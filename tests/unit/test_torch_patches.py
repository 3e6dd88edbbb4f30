"""app.torch_patches against the installed torch: each private a patch relies on is there with the shape it uses,
each patch changes what torch does, and another torch is refused in one line. A test here that fails after a torch
upgrade names the patch to port (then set ``TORCH_VERSION``).

.venv/bin/python -m pytest tests/unit/test_torch_patches.py
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.launcher.api as launcher_api
import torch.distributed.run as torchrun
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _RendezvousState,
)

from app import torch_patches
from app.exit_codes import BAD_CONFIG
from app.torch_patches import TORCH_VERSION, TorchChanged, check_torch

ROOT = Path(__file__).resolve().parents[2]


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


# -- the version check ------------------------------------------------------------------------------------------------
def test_the_installed_torch_is_the_one_the_patches_were_written_for():
    check_torch()  # every patch's privates, and the version


@pytest.mark.parametrize("version", [TORCH_VERSION, f"{TORCH_VERSION}+cpu", f"{TORCH_VERSION}+cu128"])
def test_a_local_suffix_is_the_same_torch(version):
    check_torch(version=version)


@pytest.mark.parametrize("version", ["2.14.0", "2.13.1", "2.13.0a0", "3.0.0+cpu"])
def test_another_version_is_refused_in_one_line_naming_both(version):
    with pytest.raises(TorchChanged) as e:
        check_torch(version=version)
    line = str(e.value)
    assert "\n" not in line and f"torch {version} is installed" in line and f"torch {TORCH_VERSION}" in line
    assert f"torch=={TORCH_VERSION}" in line and e.value.code == BAD_CONFIG  # what to do; exit 2, as a bad setting


def test_a_private_torch_removed_is_named_before_the_version(monkeypatch):
    monkeypatch.delattr(DynamicRendezvousHandler, "_node_desc_generator")  # as a torch that dropped it would
    with pytest.raises(TorchChanged) as e:
        check_torch(version="2.14.0")
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("torch 2.14.0: DynamicRendezvousHandler._node_desc_generator._local_id is gone from ")
    assert "(node identity patch)" in line and f"written for torch {TORCH_VERSION}" in line


def test_a_patch_refuses_before_it_writes_into_another_torch(monkeypatch):
    monkeypatch.setattr(torch_patches, "installed_version", lambda: "2.14.0")
    before = DynamicRendezvousHandler._node_desc_generator._local_id
    with pytest.raises(TorchChanged):
        torch_patches.set_node_local_id(before + 12345)
    assert DynamicRendezvousHandler._node_desc_generator._local_id == before


def test_the_launcher_refuses_another_torch_in_one_line_and_exit_2(monkeypatch, caplog):
    from app.cluster.launch import launch

    monkeypatch.delenv("LAUNCH_STATE_DIR", raising=False)
    monkeypatch.setattr(torch_patches, "installed_version", lambda: "2.14.0")
    with caplog.at_level("ERROR", logger="app.cluster.launch"):
        assert launch(["--standalone", "--nproc-per-node=1", "-m", "app.train", "--steps", "1"]) == BAD_CONFIG
    assert [r.getMessage().split(";")[0] for r in caplog.records] == ["torch 2.14.0 is installed"]


# -- node identity ----------------------------------------------------------------------------------------------------
def test_node_identity_a_new_handler_is_named_with_the_local_id_set(monkeypatch):
    generator = DynamicRendezvousHandler._node_desc_generator  # one, shared by the class: what the patch sets
    assert isinstance(generator._local_id, int)
    monkeypatch.setattr(generator, "_local_id", generator._local_id)  # undone after the test
    torch_patches.set_node_local_id(424242)
    store = torch.distributed.HashStore()
    handler = DynamicRendezvousHandler.from_backend("job", store, C10dRendezvousBackend(store, "job"), 1, 2)
    assert handler._this_node.local_id == 424242  # torch's (addr, pid, local id): the id is the one set


# -- first world ------------------------------------------------------------------------------------------------------
def test_first_world_the_join_hook_sees_the_state_and_completes_the_round(monkeypatch):
    executor_class = _DistributedRendezvousOpExecutor
    assert parameters(executor_class._add_to_participants) == ["self"]
    assert parameters(executor_class._mark_rendezvous_complete) == ["self"]
    assert "self._state" in inspect.getsource(executor_class)  # the state the hook is handed
    monkeypatch.setattr(executor_class, "_add_to_participants", executor_class._add_to_participants)
    seen = []

    def hook(state, complete):
        seen.append(sorted(n.addr for n in state.participants))
        complete()

    torch_patches.after_joining_participants(hook)
    timeout = RendezvousTimeout(join=timedelta(seconds=120), last_call=timedelta(seconds=15))
    settings = RendezvousSettings("job", 1, 8, timeout, timedelta(seconds=2), 5)
    holder = SimpleNamespace(state=_RendezvousState(), mark_dirty=lambda: None)  # what the executor reads and marks
    executor = executor_class(_NodeDesc("replica-0", 1, 0), holder, settings)
    executor._state = holder.state  # what the executor's run() does before each action
    executor._add_to_participants()
    assert seen == [["replica-0"]]
    assert holder.state.complete and holder.state.deadline is None  # torch's own completion, through the hook


# -- the agent class --------------------------------------------------------------------------------------------------
def test_agent_class_launch_agent_builds_the_class_set(monkeypatch):
    # launch_agent reads the module-level name at each call (a global lookup, not a reference bound at import).
    assert "LocalElasticAgent" in launcher_api.launch_agent.__code__.co_names
    for step in ("_rendezvous", "_monitor_workers", "_restart_workers"):  # the steps ReportingAgent overrides
        assert parameters(getattr(LocalElasticAgent, step)) == ["self", "worker_group"], step
    assert parameters(LocalElasticAgent._shutdown)[:3] == ["self", "death_sig", "timeout"]
    # What ReportingAgent reads and sets in its steps: the restarts left, the trainers' processes.
    assert "self._remaining_restarts" in inspect.getsource(LocalElasticAgent.__mro__[1])
    assert "self._pcontext" in inspect.getsource(LocalElasticAgent.__init__)

    class Agent(LocalElasticAgent):
        pass

    monkeypatch.setattr(launcher_api, "LocalElasticAgent", LocalElasticAgent)
    torch_patches.use_agent_class(Agent)
    assert launcher_api.LocalElasticAgent is Agent


# -- the forked trainer -----------------------------------------------------------------------------------------------
def test_forked_trainer_run_path_calls_the_entrypoint_set(monkeypatch):
    assert parameters(torchrun.run_script_path) == ["training_script", "training_script_args"]
    assert parameters(torch.multiprocessing._set_thread_name) == ["name"]
    monkeypatch.setattr(torchrun, "run_script_path", torchrun.run_script_path)

    def entrypoint(script, *argv):
        pass

    torch_patches.set_run_script_path(entrypoint)
    args = torchrun.parse_args(["--standalone", "--nproc-per-node=1", "--run-path", "train.py", "--steps", "5"])
    _, cmd, cmd_args = torchrun.config_from_args(args)
    assert (cmd, cmd_args) == (entrypoint, ["train.py", "--steps", "5"])


# -- torch._dynamo, deferred ------------------------------------------------------------------------------------------
def dynamo_uses(path: Path) -> set[str]:
    """The names read of ``torch._dynamo`` (``torch._dynamo.NAME``) in one of torch's source files."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "_dynamo"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "torch"
    }


def test_deferred_dynamo_torch_optim_reads_only_what_the_stand_in_has():
    torch_dir = Path(torch.__file__).parent
    files = [*sorted((torch_dir / "optim").glob("*.py")), torch_dir / "_compile.py"]
    used = set().union(*(dynamo_uses(f) for f in files))
    assert used == {"disable", "graph_break"}  # DeferredDynamo's two no-ops; anything else needs the real one
    assert parameters(torch._disable_dynamo)[:2] == ["fn", "recursive"]


DEFERRED = """
import json, sys, torch
from app import torch_patches
torch_patches.defer_dynamo()
import torch._dynamo as stand_in
ran = torch._disable_dynamo(lambda: 7)()  # what torch.optim's steps go through
real = "torch._dynamo.eval_frame" in sys.modules
import torch._dynamo.config
print(json.dumps([type(stand_in).__name__, ran, real, type(sys.modules["torch._dynamo"]).__name__]))
"""


def test_deferred_dynamo_stands_in_until_a_submodule_is_imported():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", DEFERRED], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["DeferredDynamo", 7, False, "module"]
