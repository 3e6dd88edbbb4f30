"""The Kubernetes manifests in k8s/: valid for the API server, accepted by the Python client, and wired right.

No cluster needed: every file is checked against the Kubernetes JSON schemas that ``kubernetes-validate`` ships
(offline; strict, so an unknown or misspelled field fails), loaded into the ``kubernetes`` client's typed models,
and read the way the Job controller and the kubelet read it (``render_pod``: hostname, DNS names, env with the
downward API and ``$(VAR)`` expansion) to check what a user would hit: pods that cannot find pod 0, a node rank
that is not the completion index, a config the trainer rejects, a pod that Pod Security "restricted" refuses.
tests/e2e/test_k8s_emulation.py runs the same rendered pods for real as Docker containers.

    make k8s-validate        # or: .venv/bin/python -m pytest tests/test_k8s.py
"""

from __future__ import annotations

import copy
import json
import math
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes.client import ApiClient
from kubernetes_validate.utils import SchemaNotFoundError

from app.config import load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
FILES = sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))
# The oldest release we support (podFailurePolicy and podReplacementPolicy on by default) and the newest schemas.
SCHEMA_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
SHARED_LABELS = {
    "app.kubernetes.io/name": "ddp-cluster",
    "app.kubernetes.io/instance": "ddp-train",
    "app.kubernetes.io/part-of": "ddp-cluster",
    "app.kubernetes.io/managed-by": "kubectl",
}
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
}


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def folder(path: Path) -> dict[tuple[str, str], dict]:
    """What `kubectl apply -f <path>` applies: the folder's own files, not its subfolders."""
    objs = [obj for f in sorted(path.iterdir()) if f.suffix in (".yaml", ".yml", ".json") for obj in load(f)]
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def container(job: dict) -> dict:
    return job["spec"]["template"]["spec"]["containers"][0]


def flags(args: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


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


JOBS = {"gpu": K8S / "job.yaml", "cpu": K8S / "cpu" / "job.yaml"}


@pytest.fixture(params=sorted(JOBS), ids=lambda v: f"{v}-job")
def variant(request):
    path = JOBS[request.param]
    return request.param, load(path)[0], folder(path.parent)


# ---------------------------------------------------------------------------------------------------------------
# Valid for the API server and the Python client
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(K8S)))
def test_each_file_is_one_object_in_two_space_yaml(path):
    assert len(load(path)) == 1, f"{path.name}: one Kubernetes object per file"
    odd = [n for n, line in enumerate(path.read_text().splitlines(), 1) if (len(line) - len(line.lstrip(" "))) % 2]
    assert not odd, f"{path.name}: lines {odd} are not indented by multiples of two spaces"


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(K8S)))
def test_built_in_objects_are_valid_against_the_kubernetes_schemas(path, version):
    obj = load(path)[0]
    try:
        kubernetes_validate.validate(obj, version, strict=True)  # strict: an unknown field is an error
    except SchemaNotFoundError:
        assert path.parent.name == "monitoring", f"{path.name}: {obj['kind']} needs a CRD; keep it in k8s/monitoring/"
        pytest.skip(f"{obj['kind']} is a CRD kind without a bundled schema: checked in test_crd_objects")


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
    crd_objects = [
        o
        for p in FILES
        for o in load(p)
        if "." in o["apiVersion"].split("/")[0] and not o["apiVersion"].split("/")[0].endswith(".k8s.io")
    ]
    assert [o["kind"] for o in crd_objects] == ["PodMonitor"]
    for obj in crd_objects:
        for part, ref in (
            (obj["metadata"], "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"),
            (obj["spec"]["selector"], "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"),
        ):
            schema = {"$ref": f"{defs['$id']}#/$defs/{ref}"}
            jsonschema.Draft202012Validator(schema, registry=registry).validate(part)


def _paths(value, prefix=""):
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in _paths(v, f"{prefix}.{k}")} | {prefix}
    if isinstance(value, list):
        return {p for i, v in enumerate(value) for p in _paths(v, f"{prefix}[{i}]")} | {prefix}
    return {prefix}


@pytest.mark.parametrize(
    "path",
    [p for p in FILES if p.parent.name != "monitoring" or "grafana" in p.name],
    ids=lambda p: str(p.relative_to(K8S)),
)
def test_python_client_loads_every_field(path):
    obj = load(path)[0]
    client = ApiClient()
    model = client.deserialize(json.dumps(obj), f"V1{obj['kind']}", "application/json")  # typed, validated
    # The models silently drop fields they do not know: every field of the file must survive the round trip.
    lost = _paths(obj) - _paths(client.sanitize_for_serialization(model))
    assert not lost, f"{path.name}: the kubernetes client does not know {sorted(lost)}"


# ---------------------------------------------------------------------------------------------------------------
# Wired right
# ---------------------------------------------------------------------------------------------------------------
def test_plain_apply_needs_no_crd_and_the_cpu_folder_is_complete():
    builtin = {"v1", "batch/v1", "networking.k8s.io/v1"}
    for path in (K8S, K8S / "cpu"):
        objs = folder(path)
        assert {o["apiVersion"] for o in objs.values()} <= builtin, f"{path}: only built-in kinds in a plain apply"
        assert {kind for kind, _ in objs} == {"Job", "Service", "ConfigMap", "PersistentVolumeClaim", "NetworkPolicy"}


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
        assert pod.argv[0] == "torchrun" and pod.argv[-2:] == ["-m", "app.train"]
        assert f["nnodes"] == str(n), "--nnodes must equal completions"
        assert f["node-rank"] == str(pod.index) == pod.env["JOB_COMPLETION_INDEX"]
        assert f["rdzv-backend"] == "static"
        assert f["master-addr"] in pods[0].dns_names, "the rendezvous must be pod 0's DNS name"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        svc_ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        assert int(f["master-port"]) == ports["rendezvous"] == svc_ports["rendezvous"]


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
    job = load(K8S / "job.yaml")[0]
    c = container(job)
    pod = render_pod(job, folder(K8S), 0)
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert flags(pod.argv)["nproc-per-node"] == "gpu", "one process per visible GPU"
    assert pod.env["NCCL_SOCKET_IFNAME"] == "eth0" and pod.env["NCCL_DEBUG"] in {"WARN", "INFO"}
    shm = next(v for v in pod.spec["volumes"] if v["name"] == "dshm")
    assert {"mountPath": "/dev/shm", "name": "dshm"} in c["volumeMounts"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert quantity(shm["emptyDir"]["sizeLimit"]) < quantity(c["resources"]["limits"]["memory"])


def test_cpu_variant_differs_from_the_gpu_job_only_in_cpu_gpu_settings():
    gpu, cpu = load(K8S / "job.yaml")[0], load(K8S / "cpu" / "job.yaml")[0]
    allowed_env = {"DDP_DEVICE"} | {e["name"] for e in container(gpu)["env"] if "NCCL" in e["name"]}
    for job in (gpu, cpu):
        c = container(job)
        c["args"] = [a for a in c["args"] if not a.startswith("--nproc-per-node=")]
        c["env"] = [e for e in c["env"] if e["name"] not in allowed_env]
        for key in ("image", "resources"):
            c.pop(key)
        job["spec"]["template"]["spec"].pop("tolerations", None)
        next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")["emptyDir"].pop("sizeLimit")
    assert cpu == gpu


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
    spec = copy.deepcopy(load(K8S / "job.yaml")[0]["spec"]["template"]["spec"])
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


def test_failures_are_retried_as_a_group_and_bounded(variant):
    _, job, _ = variant
    spec = job["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["backoffLimit"] >= spec["completions"], "one incident fails every pod of the group"
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    fail = next(r for r in rules if r["action"] == "FailJob")["onExitCodes"]
    assert fail["containerName"] == container(job)["name"] and 2 in fail["values"]
    assert spec["activeDeadlineSeconds"] > 0


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


def test_every_object_and_pod_carries_the_shared_labels():
    for path in FILES:
        obj = load(path)[0]
        assert SHARED_LABELS.items() <= obj["metadata"]["labels"].items(), path.name
        assert "app.kubernetes.io/component" in obj["metadata"]["labels"], path.name
        if obj["kind"] == "Job":
            assert SHARED_LABELS.items() <= obj["spec"]["template"]["metadata"]["labels"].items(), path.name


def test_prometheus_finds_the_workers():
    job = load(K8S / "job.yaml")[0]
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    monitor = load(K8S / "monitoring" / "podmonitor.yaml")[0]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"] for p in container(job)["ports"]}
    for endpoint in monitor["podMetricsEndpoints"]:
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
        assert {"targetLabel": "job", "replacement": "ddp-worker", "action": "replace"} in endpoint["relabelings"]


COMPOSE_DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "ddp-cluster.json"
DASHBOARD_CM = K8S / "monitoring" / "grafana-dashboard.yaml"
_DASHBOARD_HEAD = """\
# The compose stack's Grafana dashboard (docker/grafana/dashboards/ddp-cluster.json) for Grafana on Kubernetes:
# the dashboard sidecar of kube-prometheus-stack loads every ConfigMap labelled grafana_dashboard: "1" from its
# namespace. Generated: edit the JSON file, then `make k8s-dashboard` (tests/test_k8s.py fails on drift).
#   kubectl apply -n monitoring -f k8s/monitoring/grafana-dashboard.yaml
# Its panels use the datasource uid "prometheus" (kube-prometheus-stack's default) and job="ddp-worker" (set by
# k8s/monitoring/podmonitor.yaml).
apiVersion: v1
kind: ConfigMap
metadata:
  name: ddp-cluster-dashboard
  labels:
    app.kubernetes.io/name: ddp-cluster
    app.kubernetes.io/instance: ddp-train
    app.kubernetes.io/component: dashboard
    app.kubernetes.io/part-of: ddp-cluster
    app.kubernetes.io/version: "0.1.0"
    app.kubernetes.io/managed-by: kubectl
    grafana_dashboard: "1"
data:
  ddp-cluster.json: |
"""


def dashboard_config_map_text() -> str:
    dashboard = json.dumps(json.loads(COMPOSE_DASHBOARD.read_text()), indent=2, ensure_ascii=False)
    return _DASHBOARD_HEAD + "".join(f"    {line}\n" for line in dashboard.splitlines())


def write_dashboard_config_map() -> None:
    """`make k8s-dashboard`: regenerate k8s/monitoring/grafana-dashboard.yaml from the compose dashboard."""
    DASHBOARD_CM.write_text(dashboard_config_map_text())


def test_grafana_dashboard_config_map_is_the_compose_dashboard_and_queries_contract_metrics():
    assert DASHBOARD_CM.read_text() == dashboard_config_map_text(), (
        "k8s/monitoring/grafana-dashboard.yaml is out of date with the compose dashboard: run `make k8s-dashboard`"
    )
    cm = load(DASHBOARD_CM)[0]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1", "the label kube-prometheus-stack's sidecar watches"
    dashboard = json.loads(cm["data"]["ddp-cluster.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bddp_[a-z_]+", e)}
    assert used and used <= {m + s for m in CONTRACT_METRICS for s in ("", "_bucket", "_sum", "_count")}
    jobs = {j for e in exprs for j in re.findall(r'job="([^"]+)"', e)}
    monitor = load(K8S / "monitoring" / "podmonitor.yaml")[0]["spec"]["podMetricsEndpoints"][0]["relabelings"]
    assert jobs <= {r["replacement"] for r in monitor if r["targetLabel"] == "job"}
