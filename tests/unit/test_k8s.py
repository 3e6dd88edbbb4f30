"""The Kubernetes manifests, checked as each apply command sends them: valid for the API server, accepted by the
Python client, and wired right.

What reaches the API server is what is checked:

- ``kubectl apply -f k8s/``: the ``.yaml``/``.yml``/``.json`` files of ``k8s/`` itself, as written (links
  followed, subfolders not: kubectl reads a folder without ``-R`` that way);
- ``kubectl apply -k k8s/<name>/``: the render of ``kubectl kustomize k8s/<name>/``, the kustomize built into
  kubectl, which is what ``apply -k`` sends.

No cluster needed: every object is checked against the Kubernetes JSON schemas that ``kubernetes-validate`` ships
(offline; strict, so an unknown or misspelled field fails), loaded into the ``kubernetes`` client's typed models,
and read the way the Job controller and the kubelet read it (``render_pod``: hostname, DNS names, env with the
downward API and ``$(VAR)`` expansion) to check what a user would hit: pods that cannot find pod 0, a node rank
that is not the completion index, a config the trainer rejects, a pod that Pod Security "restricted" refuses.
tests/e2e/test_k8s_emulation.py runs the rendered CPU pods for real as Docker containers.

    make k8s-validate        # or: .venv/bin/python -m pytest tests/unit/test_k8s.py

kubectl comes with this project's machine image; without it the ``-k`` checks skip, saying so (under CI=true they
fail).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes.client import ApiClient
from kubernetes_validate.utils import SchemaNotFoundError

from app.exit_codes import BAD_CONFIG, OUT_OF_MEMORY
from app.worker.config import load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
# Every kustomization (folder under k8s/) that a documented `kubectl apply -k` names.
KUSTOMIZATIONS = ("base", "cpu", "monitoring", "elastic")
COMMANDS = ("kubectl apply -f k8s/", *(f"kubectl apply -k k8s/{name}/" for name in KUSTOMIZATIONS))
# Everything written by hand that kubectl or kustomize reads: each a YAML file with one object.
YAML_FILES = sorted(
    {p.resolve() for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml")}
    | {ROOT / "docker/grafana/kustomization.yaml"}
)
# The oldest release we support (podFailurePolicy and podReplacementPolicy on by default) and the newest schemas.
SCHEMA_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
BUILTIN_API_VERSIONS = {"v1", "batch/v1", "networking.k8s.io/v1"}
CRD_KINDS = {"PodMonitor", "PrometheusRule"}
CONTRACT_METRICS = {
    "ddp_step_duration_seconds",
    "ddp_forward_duration_seconds",
    "ddp_backward_duration_seconds",
    "ddp_optimizer_duration_seconds",
    "ddp_allreduce_duration_seconds",
    "ddp_exposed_comm_duration_seconds",
    "ddp_allreduce_bytes_total",
    "ddp_allreduce_bus_bandwidth_bytes_per_second",
    "ddp_samples_total",
    "ddp_optimizer_steps_total",
    "ddp_gradient_syncs_total",
    "ddp_loss",
    "ddp_learning_rate",
    "ddp_world_size",
    "ddp_last_step_timestamp_seconds",
    "ddp_checkpoint_duration_seconds",
    "ddp_last_checkpoint_step",
    "ddp_rank_info",
    "ddp_step",
    "ddp_target_steps",
    # pipeline parallelism
    "ddp_pipeline_stage",
    "ddp_pipeline_compute_seconds",
    "ddp_pipeline_send_recv_seconds",
    "ddp_pipeline_bubble_ratio",
    "ddp_pipeline_activation_bytes_total",
    # ZeRO stages (--parallel zero1|zero2|zero3)
    "ddp_zero_stage",
    "ddp_zero_reduce_scatter_seconds",
    "ddp_zero_all_gather_seconds",
    "ddp_zero_reduce_scatter_bytes_total",
    "ddp_zero_all_gather_bytes_total",
    "ddp_zero_parameter_bytes",
    "ddp_zero_gradient_bytes",
    "ddp_zero_optimizer_state_bytes",
    # elastic worlds
    "ddp_min_world_size",
    "ddp_max_world_size",
    "ddp_elastic_restarts",  # not *_count: promtool reserves that suffix for histograms and summaries
    "ddp_world_generation",
    "ddp_reformation_seconds",
    "ddp_steps_redone_total",
    # throughput, MFU, memory and collective progress (app/worker/throughput_metrics.py)
    "ddp_samples_per_second",
    "ddp_tokens_per_second",
    "ddp_model_flops_per_second",
    "ddp_peak_flops_per_second",
    "ddp_mfu_ratio",
    "ddp_memory_rss_bytes",
    "ddp_memory_peak_rss_bytes",
    "ddp_cuda_memory_allocated_bytes",
    "ddp_cuda_memory_reserved_bytes",
    "ddp_last_collective_sequence",
}


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def folder(path: Path) -> dict[tuple[str, str], dict]:
    """What `kubectl apply -f <path>` sends: the folder's own files (links followed), not its subfolders."""
    objs = [obj for f in sorted(path.iterdir()) if f.suffix in (".yaml", ".yml", ".json") for obj in load(f)]
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the kustomize renders must be checked, not skipped)")
    pytest.skip(reason)


@functools.cache
def _render(name: str) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        _unavailable("kubectl not found: its built-in kustomize renders what `kubectl apply -k` sends")
    result = subprocess.run([kubectl, "kustomize", str(K8S / name)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize k8s/{name}/ failed:\n{result.stderr}"
    return result.stdout


def kustomize(name: str) -> dict[tuple[str, str], dict]:
    """What `kubectl apply -k k8s/<name>/` sends, rendered by `kubectl kustomize` (a fresh copy each call)."""
    objs = [doc for doc in yaml.safe_load_all(_render(name)) if doc]
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def sent(command: str) -> dict[tuple[str, str], dict]:
    """The objects one of COMMANDS sends to the API server."""
    target = command.split()[-1].removeprefix("k8s/").strip("/")
    return folder(K8S) if " -f " in command else kustomize(target)


def container(job: dict) -> dict:
    return job["spec"]["template"]["spec"]["containers"][0]


def flags(args: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


def gpus_per_pod(job: dict) -> int:
    """Processes per pod: the GPU limit, or 1 where the pod has no GPU (the CPU variant)."""
    return int(container(job)["resources"]["limits"].get("nvidia.com/gpu", 1))


# ---------------------------------------------------------------------------------------------------------------
# How the Job controller and the kubelet turn the pod template into pod i
# ---------------------------------------------------------------------------------------------------------------
_UNITS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(text: str | int) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text)).groups()
    return float(number) * _UNITS[unit]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, $$ escapes, anything else stays as written."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


@dataclass
class Pod:
    index: int
    name: str
    hostname: str
    dns_names: list[str]  # what other pods can resolve to this one
    env: dict[str, str]
    argv: list[str]  # command + args, expanded
    container: dict
    spec: dict


def render_pod(job: dict, objs: dict, index: int, namespace: str = "default") -> Pod:
    job_name, spec = job["metadata"]["name"], job["spec"]["template"]["spec"]
    c = spec["containers"][0]
    hostname = f"{job_name}-{index}"  # Indexed Jobs name the pod's host <job>-<index>
    labels = {
        **job["spec"]["template"]["metadata"].get("labels", {}),
        "batch.kubernetes.io/job-name": job_name,
        "job-name": job_name,
        "batch.kubernetes.io/job-completion-index": str(index),
    }
    annotations = {
        **job["spec"]["template"]["metadata"].get("annotations", {}),
        "batch.kubernetes.io/job-completion-index": str(index),
    }
    fields = {
        "metadata.name": f"{hostname}-{uuid.uuid4().hex[:5]}",
        "metadata.namespace": namespace,
        "spec.nodeName": "emulated-node",
        "spec.serviceAccountName": "default",
        **{f"metadata.labels['{k}']": v for k, v in labels.items()},
        **{f"metadata.annotations['{k}']": v for k, v in annotations.items()},
    }
    env: dict[str, str] = {}
    for var in c.get("env", []):
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = expand(var.get("value", ""), env)  # only variables defined above it expand
        elif "fieldRef" in source:
            env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = objs[("ConfigMap", ref["name"])]["data"][ref["key"]]
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            kind, resource = ref["resource"].split(".", 1)
            value = quantity(c["resources"][kind][resource]) / quantity(ref.get("divisor", "1"))
            env[var["name"]] = str(math.ceil(value))  # the kubelet rounds up to a whole divisor
        else:
            raise NotImplementedError(f"env {var['name']}: {sorted(source)} is not emulated; extend render_pod")
    env["JOB_COMPLETION_INDEX"] = str(index)  # added by the Job controller
    subdomain = spec.get("subdomain")
    dns = [
        f"{hostname}.{subdomain}",
        f"{hostname}.{subdomain}.{namespace}",
        f"{hostname}.{subdomain}.{namespace}.svc",
        f"{hostname}.{subdomain}.{namespace}.svc.cluster.local",
    ]
    argv = [expand(a, env) for a in c.get("command", []) + c.get("args", [])]
    return Pod(index, fields["metadata.name"], hostname, dns if subdomain else [], env, argv, c, spec)


LAUNCHER = ["python", "-m", "app.cluster.k8s_launch"]


@pytest.fixture(params=["gpu", "cpu"], ids=lambda v: f"{v}-job")
def variant(request):
    objs = folder(K8S) if request.param == "gpu" else kustomize("cpu")
    return request.param, objs[("Job", "ddp-train")], objs


# ---------------------------------------------------------------------------------------------------------------
# Each apply command sends valid Kubernetes objects, and only those
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_file_is_one_object_in_two_space_yaml(path):
    assert len(load(path)) == 1, f"{path.name}: one object per file"
    odd = [n for n, line in enumerate(path.read_text().splitlines(), 1) if (len(line) - len(line.lstrip(" "))) % 2]
    assert not odd, f"{path.name}: lines {odd} are not indented by multiples of two spaces"


def test_apply_minus_f_sends_no_kustomization_and_no_crd():
    # kubectl sends every .yaml/.yml/.json of the folder: a Kustomization there would be refused by the API server.
    files = [f for f in K8S.iterdir() if f.suffix in (".yaml", ".yml", ".json")]
    assert files and all(f.is_symlink() and f.resolve().parent == K8S / "base" for f in files), (
        "k8s/*.yaml are links to k8s/base/, so the GPU manifests exist once"
    )
    objs = folder(K8S)
    assert {o["apiVersion"] for o in objs.values()} <= BUILTIN_API_VERSIONS, "only built-in kinds in a plain apply"
    assert {kind for kind, _ in objs} == {"Job", "Service", "ConfigMap", "PersistentVolumeClaim", "NetworkPolicy"}


def test_apply_minus_f_and_the_base_render_send_the_same_objects():
    # The files repeat the shared labels for `-f`; kustomize adds them for `-k`. Equal renders: the files carry
    # exactly the component's labels, and every overlay starts from what `-f` applies.
    assert folder(K8S) == kustomize("base")


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("command", COMMANDS)
def test_every_object_sent_is_valid_against_the_kubernetes_schemas(command, version):
    objs = sent(command)
    assert objs
    for obj in objs.values():
        if obj["kind"] in CRD_KINDS:
            continue  # no bundled schema: test_crd_objects_have_valid_metadata_and_selectors
        try:
            kubernetes_validate.validate(obj, version, strict=True)  # strict: an unknown field is an error
        except SchemaNotFoundError:
            pytest.fail(f"{obj['kind']} has no schema: a CRD kind belongs in k8s/monitoring/ and in CRD_KINDS")


def test_crd_objects_have_valid_metadata_and_selectors():
    # No schema ships for the Prometheus Operator's kinds: validate the parts of them that are Kubernetes types.
    import jsonschema
    from referencing import Registry, Resource

    defs = json.loads(
        (
            Path(kubernetes_validate.__file__).parent
            / "kubernetes-json-schema"
            / f"v{kubernetes_validate.latest_version()}-local-strict"
            / "_definitions.json"
        ).read_text()
    )
    registry = Resource.from_contents(defs) @ Registry()
    objs = kustomize("monitoring")
    crd_objects = [o for o in objs.values() if o["kind"] in CRD_KINDS]
    assert sorted(o["kind"] for o in crd_objects) == sorted(CRD_KINDS)
    meta = "io.k8s.apimachinery.pkg.apis.meta.v1"
    for obj in crd_objects:
        parts = [(obj["metadata"], f"{meta}.ObjectMeta")]
        if obj["kind"] == "PodMonitor":
            parts.append((obj["spec"]["selector"], f"{meta}.LabelSelector"))
        for part, ref in parts:
            schema = {"$ref": f"{defs['$id']}#/$defs/{ref}"}
            jsonschema.Draft202012Validator(schema, registry=registry).validate(part)


def _paths(value, prefix=""):
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in _paths(v, f"{prefix}.{k}")} | {prefix}
    if isinstance(value, list):
        return {p for i, v in enumerate(value) for p in _paths(v, f"{prefix}[{i}]")} | {prefix}
    return {prefix}


@pytest.mark.parametrize("command", COMMANDS)
def test_python_client_loads_every_field(command):
    client = ApiClient()
    for obj in sent(command).values():
        if obj["kind"] in CRD_KINDS:
            continue
        model = client.deserialize(json.dumps(obj), f"V1{obj['kind']}", "application/json")  # typed, validated
        # The models silently drop fields they do not know: every field must survive the round trip.
        lost = _paths(obj) - _paths(client.sanitize_for_serialization(model))
        assert not lost, f"{obj['kind']}: the kubernetes client does not know {sorted(lost)}"


def shared_labels() -> dict[str, str]:
    (entry,) = load(K8S / "labels" / "kustomization.yaml")[0]["labels"]
    return entry["pairs"]


def test_shared_labels_are_set_in_one_place_and_carried_by_everything_sent():
    labels = shared_labels()
    assert labels["app.kubernetes.io/name"] == "ddp-cluster"
    kustomizations = [p for p in YAML_FILES if p.name == "kustomization.yaml" and p.parent.name != "labels"]
    for path in kustomizations:
        spec = load(path)[0]
        assert not {"labels", "commonLabels"} & set(spec), f"{path}: shared labels belong in k8s/labels/ only"
    for command in COMMANDS:
        for (kind, name), obj in sent(command).items():
            assert labels.items() <= obj["metadata"]["labels"].items(), f"{command}: {kind}/{name}"
            assert "app.kubernetes.io/component" in obj["metadata"]["labels"], f"{command}: {kind}/{name}"
            if kind == "Job":
                assert labels.items() <= obj["spec"]["template"]["metadata"]["labels"].items(), command


# ---------------------------------------------------------------------------------------------------------------
# Wired right
# ---------------------------------------------------------------------------------------------------------------
def test_pods_find_pod_zero_through_the_headless_service(variant):
    _, job, objs = variant
    spec, c = job["spec"], container(job)
    service = objs[("Service", spec["template"]["spec"]["subdomain"])]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert spec["completionMode"] == "Indexed"
    n = spec["completions"]
    assert spec["parallelism"] == n, "parallelism must equal completions: every node at once, or no world forms"
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    pods = [render_pod(job, objs, i) for i in range(n)]
    for pod in pods:
        f = flags(pod.argv)
        assert pod.argv[:3] == LAUNCHER and pod.argv[-2:] == ["-m", "app.train"]
        assert f["nnodes"] == str(n), "--nnodes must equal completions"
        assert f["node-rank"] == str(pod.index) == pod.env["JOB_COMPLETION_INDEX"]
        assert f["rdzv-backend"] == "static"
        assert f["master-addr"] in pods[0].dns_names, "the rendezvous must be pod 0's DNS name"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        svc_ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        assert int(f["master-port"]) == ports["rendezvous"] == svc_ports["rendezvous"]


def test_launcher_accepts_the_manifest_arguments(variant):
    from torch.distributed.run import parse_args

    _, job, objs = variant
    args = parse_args(render_pod(job, objs, 1).argv[len(LAUNCHER) :])  # app.cluster.k8s_launch's own parser: torchrun's
    assert (args.node_rank, args.module, args.training_script) == (1, True, "app.train")
    assert args.max_restarts == 0, "a static rendezvous cannot re-form around one restarted node: the Job restarts"


def test_config_map_and_env_give_the_trainer_a_valid_config(variant, tmp_path):
    name, job, objs = variant
    pod = render_pod(job, objs, 1)
    mounts = {m["mountPath"]: m["name"] for m in pod.container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod.spec["volumes"]}
    config_path = Path(pod.env["DDP_CONFIG"])
    config_map = objs[("ConfigMap", volumes[mounts[str(config_path.parent)]]["configMap"]["name"])]
    (tmp_path / config_path.name).write_text(config_map["data"][config_path.name])
    resolved = load_config([], {**pod.env, "DDP_CONFIG": str(tmp_path / config_path.name)})  # raises if bad
    assert resolved.warnings == [], "a DDP_* variable that matches no setting is a typo"
    config = resolved.config
    assert "persistentVolumeClaim" in volumes[mounts[config.checkpoint_dir]], "checkpoints must outlive the pod"
    metrics = {p["name"]: p["containerPort"] for p in pod.container["ports"]}["metrics"]
    assert (
        config.metrics_port == metrics == int(job["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
    )
    assert config.metrics_linger_seconds > 0, "without linger Prometheus never sees a finished pod's last values"
    assert config.device == {"gpu": "cuda", "cpu": "cpu"}[name]


def test_gpu_job_is_the_default_and_runs_one_nccl_process_per_gpu():
    job = folder(K8S)[("Job", "ddp-train")]
    c = container(job)
    pod = render_pod(job, folder(K8S), 0)
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert int(limits["nvidia.com/gpu"]) >= 1 and limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"]
    assert flags(pod.argv)["nproc-per-node"] == "gpu", "one process per visible GPU"
    assert pod.env["NCCL_SOCKET_IFNAME"] == "eth0" and pod.env["NCCL_DEBUG"] in {"WARN", "INFO"}
    shm = next(v for v in pod.spec["volumes"] if v["name"] == "dshm")
    assert {"mountPath": "/dev/shm", "name": "dshm"} in c["volumeMounts"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert quantity(shm["emptyDir"]["sizeLimit"]) < quantity(c["resources"]["limits"]["memory"])


def test_each_process_gets_its_share_of_the_cpu_limit(variant):
    from app.cluster.k8s_launch import set_omp_threads

    _, job, objs = variant
    pod = render_pod(job, objs, 0)
    assert "OMP_NUM_THREADS" not in pod.env, "a fixed value would be the whole pod's for each of its processes"
    assert pod.env["CPU_LIMIT"] == str(math.ceil(quantity(container(job)["resources"]["limits"]["cpu"])))
    env = dict(pod.env)
    set_omp_threads(str(gpus_per_pod(job)), env)  # what app.cluster.k8s_launch does, for the pod's process count
    assert int(env["OMP_NUM_THREADS"]) * gpus_per_pod(job) <= max(int(pod.env["CPU_LIMIT"]), gpus_per_pod(job))
    eight = dict(pod.env, CPU_LIMIT="64")
    set_omp_threads("8", eight)
    assert eight["OMP_NUM_THREADS"] == "8", "8 GPUs on 64 CPUs: 8 threads each, not 64"


def metrics_ports(job: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(job)["ports"] if p["name"].startswith("metrics")}


def test_every_local_rank_has_a_declared_metrics_port(variant):
    _, job, _ = variant
    base = int(job["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
    expected = {"metrics" if r == 0 else f"metrics-{r}": base + r for r in range(gpus_per_pod(job))}
    assert metrics_ports(job) == expected, "one port per GPU, 9400 + local rank (app.train serves there)"


def _normalized(job: dict) -> dict:
    job = copy.deepcopy(job)
    c = container(job)
    c["args"] = [a for a in c["args"] if not a.startswith("--nproc-per-node=")]
    c["env"] = sorted(  # the order matters only to $(VAR) references, and none of these has one
        (e for e in c["env"] if e["name"] != "DDP_DEVICE" and "NCCL" not in e["name"]), key=lambda e: e["name"]
    )
    for key in ("image", "resources"):
        c.pop(key)
    c["ports"] = [p for p in c["ports"] if not p["name"].startswith("metrics-")]
    pod = job["spec"]["template"]["spec"]
    pod.pop("tolerations", None)
    next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"].pop("sizeLimit")
    pod["volumes"].sort(key=lambda v: v["name"])  # a strategic merge patch puts the items it touched first
    return job


def test_cpu_variant_differs_from_the_gpu_job_only_in_cpu_gpu_settings():
    gpu, cpu = folder(K8S), kustomize("cpu")
    assert set(gpu) == set(cpu)
    assert _normalized(cpu[("Job", "ddp-train")]) == _normalized(gpu[("Job", "ddp-train")])
    assert flags(container(cpu[("Job", "ddp-train")])["args"])["nproc-per-node"] == "1"
    for key in set(gpu) - {("Job", "ddp-train"), ("PersistentVolumeClaim", "ddp-train-checkpoints")}:
        assert cpu[key] == gpu[key], f"{key}: the CPU variant changes only the Job and the volume claim"


RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod_spec: dict) -> list[str]:
    """Pod Security Standards, "restricted" profile (which includes "baseline"), for the fields a pod sets."""
    bad = [f for f in ("hostNetwork", "hostPID", "hostIPC") if pod_spec.get(f)]
    bad += [f"volume {v['name']}" for v in pod_spec.get("volumes", []) if set(v) - {"name"} - RESTRICTED_VOLUMES]
    pod_sc = pod_spec.get("securityContext", {})
    for c in pod_spec.get("initContainers", []) + pod_spec["containers"]:
        sc = {**pod_sc, **c.get("securityContext", {})}  # container settings override the pod's
        caps = sc.get("capabilities", {})
        checks = {
            "privileged": not sc.get("privileged"),
            "hostPort": not any(p.get("hostPort") for p in c.get("ports", [])),
            "allowPrivilegeEscalation": sc.get("allowPrivilegeEscalation") is False,
            "runAsNonRoot": sc.get("runAsNonRoot") is True,
            "runAsUser": sc.get("runAsUser") != 0,
            "capabilities.drop": "ALL" in caps.get("drop", []),
            "capabilities.add": set(caps.get("add", [])) <= {"NET_BIND_SERVICE"},
            "seccompProfile": sc.get("seccompProfile", {}).get("type") in {"RuntimeDefault", "Localhost"},
        }
        bad += [f"{c['name']}: {name}" for name, ok in checks.items() if not ok]
    return bad


def test_pods_meet_pod_security_restricted(variant):
    _, job, _ = variant
    assert restricted_violations(job["spec"]["template"]["spec"]) == []
    assert container(job)["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("breach", ["escalation", "capability", "root", "hostpath", "seccomp"])
def test_restricted_check_catches_a_breach(breach):
    spec = copy.deepcopy(folder(K8S)[("Job", "ddp-train")]["spec"]["template"]["spec"])
    sc = spec["containers"][0]["securityContext"]
    if breach == "escalation":
        sc["allowPrivilegeEscalation"] = True
    elif breach == "capability":
        sc["capabilities"]["add"] = ["IPC_LOCK"]  # what RDMA would need
    elif breach == "root":
        sc["runAsUser"] = 0
    elif breach == "hostpath":
        spec["volumes"].append({"name": "h", "hostPath": {"path": "/dev/infiniband"}})
    else:
        spec["securityContext"]["seccompProfile"] = {"type": "Unconfined"}
    assert restricted_violations(spec)


def test_every_container_has_requests_and_limits(variant):
    _, job, _ = variant
    for c in job["spec"]["template"]["spec"]["containers"]:
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
        assert {"cpu", "memory"} <= set(c["resources"]["limits"]), c["name"]
        for kind in ("cpu", "memory"):
            assert quantity(c["resources"]["requests"][kind]) <= quantity(c["resources"]["limits"][kind])


def test_stops_spend_no_retry_budget_and_crashes_a_bounded_one(variant):
    from app.cluster.k8s_launch import EXIT_PEER, EXIT_STOPPED

    _, job, _ = variant
    spec = job["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["podReplacementPolicy"] == "Failed", "a replacement must not share the old pod's hostname"
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    by_action = {r["action"]: r["onExitCodes"] for r in rules if "onExitCodes" in r}
    for action, codes in by_action.items():
        assert codes["containerName"] == container(job)["name"] and codes["operator"] == "In", action
    assert {BAD_CONFIG, OUT_OF_MEMORY} <= set(by_action["FailJob"]["values"]), "no retry fixes these: fail at once"
    assert set(by_action["Ignore"]["values"]) == {EXIT_PEER, EXIT_STOPPED}, "a peer's failure, a requested stop"
    assert 1 not in by_action["Ignore"]["values"] and 137 not in by_action["Ignore"]["values"], "own failures count"
    assert spec["backoffLimit"] >= 2 * spec["completions"], "a crash costs every pod: allow more than one"
    assert spec["activeDeadlineSeconds"] > 0, "bounds a group whose failures all look like a peer's"


def test_network_policy_opens_ports_to_peers_and_metrics_to_monitoring_only():
    objs = folder(K8S)
    job, policy = objs[("Job", "ddp-train")], objs[("NetworkPolicy", "ddp-train")]["spec"]
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    rules = policy["ingress"]
    assert all(rule.get("from") for rule in rules), "a rule without `from` admits everyone"
    peers = next(r for r in rules if r["from"] == [{"podSelector": policy["podSelector"]}])
    assert {"protocol": "TCP", "port": 29500} in peers["ports"]
    (monitoring,) = [r for r in rules if r is not peers]
    assert monitoring["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    metrics = int(job["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
    assert monitoring["ports"] == [{"protocol": "TCP", "port": metrics, "endPort": metrics + 7}]  # 8 local ranks
    assert set(metrics_ports(job).values()) <= set(range(metrics, metrics + 8))


def _kept_by_pod_monitor(endpoint: dict, port_name: str) -> bool:
    """Prometheus' `keep` relabeling on the port name, as the operator's generated scrape job applies it."""
    keep = [r for r in endpoint["relabelings"] if r.get("action") == "keep"]
    return all(
        re.fullmatch(r["regex"], port_name)
        for r in keep
        if r["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    )


def test_prometheus_scrapes_every_local_rank_and_nothing_else():
    job = folder(K8S)[("Job", "ddp-train")]
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    monitor = kustomize("monitoring")[("PodMonitor", "ddp-train")]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert "port" not in endpoint and endpoint["path"] == "/metrics", "every declared port is a target, then kept"
    eight_gpus = ["metrics"] + [f"metrics-{r}" for r in range(1, 8)]
    assert all(_kept_by_pod_monitor(endpoint, name) for name in [*metrics_ports(job), *eight_gpus])
    others = [p["name"] for p in container(job)["ports"] if not p["name"].startswith("metrics")]
    assert others and not any(_kept_by_pod_monitor(endpoint, name) for name in others), (
        "the rendezvous port is no target"
    )


COMPOSE_DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "ddp-cluster.json"


def test_grafana_dashboard_config_map_is_generated_from_the_compose_dashboard():
    cm = kustomize("monitoring")[("ConfigMap", "ddp-cluster-dashboard")]
    assert cm["data"] == {"ddp-cluster.json": COMPOSE_DASHBOARD.read_text()}, "the compose file, byte for byte"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1", "the label kube-prometheus-stack's sidecar watches"
    assert cm["metadata"]["namespace"] == "monitoring", "the sidecar's namespace in kube-prometheus-stack"
    dashboard = json.loads(cm["data"]["ddp-cluster.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    # Recorded series (level:metric:operations, docker/prometheus/recording.yml) are checked with their rules.
    used = {m for e in exprs for m in re.findall(r"(?<![:\w])ddp_[a-z_]+", e)}
    assert used and used <= {m + s for m in CONTRACT_METRICS for s in ("", "_bucket", "_sum", "_count")}
    # Compose names its scrape job ddp-worker, a cluster's Prometheus names it as it likes: select on neither.
    assert not [e for e in exprs if "job=" in e], "a job= filter matches one scrape configuration only"


def test_prometheus_rule_carries_the_compose_alerts():
    rule = kustomize("monitoring")[("PrometheusRule", "ddp-train")]
    alerts = yaml.safe_load((ROOT / "docker/prometheus/alerts.yml").read_text())
    recording = yaml.safe_load((ROOT / "docker/prometheus/recording.yml").read_text())
    assert rule["spec"] == {"groups": alerts["groups"] + recording["groups"]}, (
        "k8s/monitoring/prometheusrule.yaml differs from docker/prometheus/alerts.yml + recording.yml: "
        "run `make k8s-rules`"
    )


def test_elastic_variant_meets_at_its_own_store_and_keeps_the_rest():
    from torch.distributed.run import parse_args

    objs, base = kustomize("elastic"), folder(K8S)
    job = objs[("Job", "ddp-train")]
    store, service = objs[("Deployment", "ddp-rendezvous")], objs[("Service", "ddp-rendezvous")]
    args = parse_args(render_pod(job, objs, 1).argv[len(LAUNCHER) :])
    low, high = (int(n) for n in args.nnodes.split(":"))
    assert args.rdzv_backend == "c10d" and args.max_restarts > 0, "an elastic world re-forms in place"
    assert 1 <= low <= high == job["spec"]["completions"] == job["spec"]["parallelism"]
    host, port = args.rdzv_endpoint.split(":")
    assert host == service["metadata"]["name"] and int(port) == service["spec"]["ports"][0]["port"]
    template = store["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert store["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert restricted_violations(template["spec"]) == []
    store_container = template["spec"]["containers"][0]
    assert {"cpu", "memory"} <= set(store_container["resources"]["limits"])
    assert str(port) in store_container["command"], "the store listens where the workers dial"
    # Everything else is the base's: the same Job apart from its rendezvous flags.
    container(job)["args"] = container(base[("Job", "ddp-train")])["args"]
    assert job == base[("Job", "ddp-train")]
    assert {k: v for k, v in objs.items() if k in base} == base
