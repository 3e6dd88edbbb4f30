"""Promises that span files, which no single module's tests can see.

- A stopped trainer checkpoints and exits within ``stop_timeout_seconds`` (then it is forced: app.worker.control);
  the launcher then exits after it. Kubernetes (``terminationGracePeriodSeconds``) and Docker (``stop_grace_period``)
  kill the container once their grace period is over: it must outlast the trainer's stop, or an evicted pod or a
  stopped container is killed before its checkpoint is written and loses the steps since the last one.
  A stop that comes before the config is read (the signal handler is installed first) is forced after the same
  documented default as one that comes later.
- Every ``torch.load`` in the code a user runs loads with ``weights_only=True``: a checkpoint or token file of
  unknown origin must not run code it carries (torch's own default could change back; the call says it).

Two more such promises are tested beside the module they concern (issue 38's list, so that none is looked for here
in vain): the alert thresholds against the world sizes the cluster files declare (compose's ``MAX_WORKERS`` and the
Makefile's, each Kubernetes Job's ``--nnodes``) in tests/unit/test_alerts.py, and every setting reaching the
trainer by each documented route (flag, ``DDP_*``, config file: tests/unit/test_config.py; compose's list of
``DDP_*`` names and ``make up``'s env file: tests/unit/test_compose_env.py; all of them through a real cluster:
EVERY_SETTING in tests/e2e/test_compose_cluster.py).
"""

from __future__ import annotations

import ast
import re

import pytest
import yaml

from app.worker.config import load_config
from tests.unit.test_k8s import ROOT, folder, kustomize, render_pod

# Between the trainer's forced exit (stop_timeout_seconds after the signal) and the container's end: torchrun's agent
# sees its worker gone, the launcher logs and exits. Seconds on a loaded machine; the files keep more.
LAUNCHER_EXIT_SECONDS = 10


def _k8s_trainer_config(objs: dict, job: dict, tmp_path):
    """The trainer's settings as pod 0 of ``job`` resolves them: its env and the ConfigMap's file."""
    pod = render_pod(job, objs, 0)
    env = dict(pod.env)
    if "DDP_CONFIG" in env:
        mounts = {m["mountPath"]: m["name"] for m in pod.container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        path = env["DDP_CONFIG"]
        parent, name = path.rsplit("/", 1)
        config_map = objs[("ConfigMap", volumes[mounts[parent]]["configMap"]["name"])]
        (tmp_path / name).write_text(config_map["data"][name])
        env["DDP_CONFIG"] = str(tmp_path / name)
    return load_config([], env).config


@pytest.mark.parametrize("render", ["apply -f k8s/", "cpu", "elastic"])
def test_kubernetes_waits_longer_than_the_trainers_stop(render, tmp_path):
    objs = folder(ROOT / "k8s") if render.startswith("apply") else kustomize(render)
    job = objs[("Job", "ddp-train")]
    grace = job["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)  # 30: Kubernetes' default
    stop = _k8s_trainer_config(objs, job, tmp_path).stop_timeout_seconds
    assert grace >= stop + LAUNCHER_EXIT_SECONDS, (
        f"{render}: terminationGracePeriodSeconds={grace} does not outlast stop_timeout_seconds={stop} "
        f"(+{LAUNCHER_EXIT_SECONDS} s for the launcher): an evicted pod is killed before it has checkpointed"
    )


def _seconds(text: str) -> float:
    units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|s|m|h)", str(text)))


def test_docker_waits_longer_than_the_trainers_stop():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    worker = compose["services"]["worker"]
    grace = _seconds(worker.get("stop_grace_period", "10s"))  # 10 s: Docker's default
    env = {k: v for k, v in worker["environment"].items() if k == "DDP_CONFIG"}
    env["DDP_CONFIG"] = str(ROOT / env["DDP_CONFIG"].removeprefix("/app/"))  # the image copies the repo to /app
    stop = load_config([], env).config.stop_timeout_seconds
    assert grace >= stop + LAUNCHER_EXIT_SECONDS, (
        f"compose.yaml: stop_grace_period={grace:g}s does not outlast stop_timeout_seconds={stop:g} "
        f"(+{LAUNCHER_EXIT_SECONDS} s for the launcher): a stopped container is killed before it has checkpointed"
    )


def _torch_loads(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        is_load = isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and func.attr == "load"
        if is_load and isinstance(func.value, ast.Name) and func.value.id == "torch":
            yield node


def test_a_stop_before_the_config_is_read_is_forced_after_the_documented_default():
    from app.worker.config import TrainConfig
    from app.worker.control import StopSignal

    assert StopSignal().timeout_s == TrainConfig().stop_timeout_seconds


def test_every_torch_load_loads_weights_only():
    files = [p for d in ("app", "bench", "tools", "examples") for p in (ROOT / d).rglob("*.py")]
    calls = [(p, call) for p in files for call in _torch_loads(p)]
    assert calls, "no torch.load found: has the scan gone blind?"
    bad = [
        f"{p.relative_to(ROOT)}:{call.lineno}"
        for p, call in calls
        if not any(
            k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in call.keywords
        )
    ]
    assert not bad, f"torch.load without weights_only=True (a file could run code on load): {', '.join(bad)}"
