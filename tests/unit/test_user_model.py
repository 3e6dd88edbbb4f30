"""The user package's ways onto the cluster, checked without Docker: what each file sends is what the others expect.

examples/user_model/ reaches the cluster three ways (docs/your-model.md, "On the cluster"): mounted into compose
(compose.user.yaml), baked into a derived image (Dockerfile, compose.user-image.yaml) and on Kubernetes through
that image (k8s/overlays/user-model/). These tests read those files as Compose, kustomize and torchrun read them;
tests/e2e/test_user_model.py runs them.

    .venv/bin/python -m pytest tests/unit/test_user_model.py
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.unit.test_k8s import ROOT, container, kustomize, render_pod

EXAMPLE = ROOT / "examples/user_model"
OVERLAY = "overlays/user-model"
SCRIPT = "/opt/user_model/train.py"  # where compose.user.yaml mounts the package and the Dockerfile copies it
SPEC_NAMES = ("DDP_MODEL", "DDP_MODEL_KWARGS", "DDP_DATA", "DDP_DATA_KWARGS", "DDP_LOSS")


def worker(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["services"]["worker"]


def with_defaults(arg: str) -> str:
    """Compose's interpolation where no variable is set: ``${NAME:-default}`` becomes ``default``."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)


def overlay_job() -> tuple[dict, dict]:
    objs = kustomize(OVERLAY)
    return objs[("Job", "ddp-train")], objs


def env_of(job: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(job)["env"]}


def test_the_overlay_changes_only_the_image_and_the_specs_of_the_cpu_job():
    job, objs = overlay_job()
    cpu = kustomize("cpu")
    (wanted,) = yaml.safe_load((ROOT / "k8s" / OVERLAY / "kustomization.yaml").read_text())["images"]
    assert container(job)["image"] == f"{wanted['newName']}:{wanted['newTag']}"
    assert container(cpu[("Job", "ddp-train")])["image"].split(":")[0] == wanted["name"], "images: must match"
    added = {k: v for k, v in env_of(job).items() if k not in env_of(cpu[("Job", "ddp-train")])}
    assert set(added) == set(SPEC_NAMES), added
    # Everything else as k8s/cpu/ sends it: the base and the CPU overlay are reused, not copied.
    stripped = copy.deepcopy(job)
    c = container(stripped)
    c["image"] = container(cpu[("Job", "ddp-train")])["image"]
    c["env"] = [e for e in c["env"] if e["name"] not in SPEC_NAMES]
    assert stripped == cpu[("Job", "ddp-train")]
    assert {k: v for k, v in objs.items() if k != ("Job", "ddp-train")} == {
        k: v for k, v in cpu.items() if k != ("Job", "ddp-train")
    }


def test_the_overlay_sends_valid_objects():
    for obj in kustomize(OVERLAY).values():
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_every_way_names_the_same_specs():
    job, _ = overlay_job()
    specs = {k: v for k, v in env_of(job).items() if k in SPEC_NAMES}
    for name in ("compose.user.yaml", "compose.user-image.yaml"):
        env = worker(EXAMPLE / name)["environment"]
        assert {k: v for k, v in env.items() if k in SPEC_NAMES} == specs, name
    # Each spec resolves in the package as it is (its folder on the path, as the mount and the image put it).
    from app.specs import resolve

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLE))
        for name in ("DDP_MODEL", "DDP_DATA", "DDP_LOSS"):
            resolve(specs[name])
        # docs/your-model.md runs `python -m app.check` on the package first: it takes a loss function too.
        from app.check.inputs import build_loss

        assert callable(build_loss(specs["DDP_LOSS"], {}))


def test_the_overlay_settings_are_valid_for_the_trainer(tmp_path):
    from app.worker.config import load_config

    job, objs = overlay_job()
    pod = render_pod(job, objs, 1)
    config_map = objs[("ConfigMap", "ddp-train-config")]["data"]["config.yaml"]
    (tmp_path / "config.yaml").write_text(config_map)
    resolved = load_config([], {**pod.env, "DDP_CONFIG": str(tmp_path / "config.yaml")})
    assert resolved.warnings == []
    # What app.train tries before the process group forms: the specs import, bind and run one sample.
    from app.worker.workload import check_workload

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLE))  # the image has the package installed
        check_workload(resolved.config, world_size=job["spec"]["completions"], grad_accum_steps=1)


def test_the_script_override_is_the_cluster_command_with_the_script_in_place_of_app_train():
    base, script = worker(ROOT / "compose.yaml")["command"], worker(EXAMPLE / "compose.user-script.yaml")["command"]
    assert base[-2:] == ["-m", "app.train"]
    cut = script.index(SCRIPT)
    assert script[:cut] == base[:-2], "compose.user-script.yaml must repeat compose.yaml's launcher flags"
    mount = worker(EXAMPLE / "compose.user.yaml")["volumes"][0]
    assert mount["target"] == str(Path(SCRIPT).parent) and mount["read_only"] is True
    assert f"cp /tmp/user_model/train.py {SCRIPT}" in (EXAMPLE / "Dockerfile").read_text()
    assert (EXAMPLE / Path(SCRIPT).name).is_file()


def test_the_launcher_runs_the_script_as_torchrun_does():
    from torch.distributed.run import parse_args

    from app.cluster.launch import check_trainer_config

    command = worker(EXAMPLE / "compose.user-script.yaml")["command"]
    assert command[:3] == ["python", "-m", "app.cluster.launch"]
    args = parse_args([with_defaults(a) for a in command[3:]])
    assert (args.module, args.training_script, args.training_script_args) == (False, SCRIPT, ["--steps=200"])
    assert check_trainer_config(args) is None, "the trainer's settings are app.train's: a script is not checked"
