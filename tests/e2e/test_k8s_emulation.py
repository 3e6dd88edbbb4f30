"""The Kubernetes Job, run for real without Kubernetes: its pod template as N Docker containers.

Why: no cluster can run here, yet the wiring of k8s/ (torchrun's node rank from the completion index, the
rendezvous at pod 0 through the headless Service's DNS name, the env the trainer reads, the volumes, the
security context, the metrics port Prometheus is told about) is only proven when it trains. So this test takes
what `kubectl apply -k k8s/cpu/` sends (the CPU/gloo variant, the one kind/minikube run, rendered by
`kubectl kustomize`; tests/unit/test_k8s.py checks that the GPU default differs from it only in GPU settings),
renders pod i the way the Job controller and kubelet would (tests/unit/test_k8s.py:render_pod), and starts it
from the `ddp-cluster:latest` image on a Docker network where each container answers to exactly the pod's DNS
names (ddp-train-i.ddp-train, and the namespace-qualified forms):

- command + args as written in the manifest, $(VAR) expanded from the pod's env;
- env as the kubelet builds it (downward API fields, resource limits, JOB_COMPLETION_INDEX);
- volumes: the ConfigMap's files mounted read-only, one shared host directory for the PVC (group-owned by the
  pod's fsGroup, as the kubelet does), tmpfs for each emptyDir, --shm-size for the memory-backed /dev/shm;
- securityContext: the pod's uid/gid and fsGroup, read-only root filesystem, all capabilities dropped,
  no-new-privileges (Docker's default seccomp profile is RuntimeDefault); memory and CPU limits.

Pod 0 starts last, a few seconds after the others: its DNS name does not exist while they first dial it, which
is what happens on a cluster before pod 0's record is published. The test then asserts what a user sees: every
pod exits 0 and prints FINISHED with its own rank, one world size, the configured step count and one checksum;
each pod's annotated metrics port serves its metrics; rank 0's checkpoints land on the shared volume.

    make k8s-emulate      (= make image, then .venv/bin/python -m pytest tests/e2e/test_k8s_emulation.py)

Outside CI it skips (saying why) without Docker or the image; under CI=true it fails without Docker and builds
the image with `make image` if it is missing.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from tests.unit.test_k8s import ROOT, container, kustomize, quantity, render_pod

# Bounded by DEADLINE_S once started; the rest is room for a cold `make image` under CI.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


def cpu_render() -> tuple[dict, dict]:
    """(the Job, every object) as `kubectl apply -k k8s/cpu/` sends them."""
    objs = kustomize("cpu")
    return objs[("Job", "ddp-train")], objs


def image() -> str:
    """The manifest's own image (ddp-cluster:latest, what `make image` builds); DDP_IMAGE runs another build."""
    return os.environ.get("DDP_IMAGE") or container(cpu_render()[0])["image"]


NAMESPACE = "default"
POD0_DELAY_S = 4.0  # pod 0 starts this long after the others
DEADLINE_S = 180.0
FINISHED = re.compile(r"^FINISHED rank=(\d+) world_size=(\d+) step=(\d+) checksum=([0-9a-f]{16})$", re.M)


def docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


def require_docker_and_image() -> None:
    def unavailable(reason: str) -> None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI=true: the emulation must run, not skip)")
        pytest.skip(reason)

    try:
        info = docker("info", "--format", "{{.ServerVersion}}", timeout=20, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        unavailable("no Docker client or the engine does not answer: run `make docker-setup`")
    if info.returncode != 0:
        unavailable(f"Docker engine not reachable ({info.stderr.strip()[:120]}): run `make docker-setup`")
    if docker("image", "inspect", image(), check=False).returncode != 0:
        if os.environ.get("CI") != "true":
            pytest.skip(f"image {image()} not built: run `make image` (or `make k8s-emulate`, which builds it)")
        # CI builds it for the compose tests, which run first; alone, build it here (minutes when cold).
        build = subprocess.run(["make", "image"], cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert build.returncode == 0, f"make image failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"


def docker_run_args(pod, objs: dict, workdir: Path, name: str, network: str) -> list[str]:
    """`docker run` flags that give the container what the kubelet would give pod ``pod``."""
    spec, c = pod.spec, pod.container
    pod_sc, sc = spec.get("securityContext", {}), {**spec.get("securityContext", {}), **c["securityContext"]}
    argv = [
        "run",
        "-d",
        "--name",
        name,
        "--network",
        network,
        "--hostname",
        pod.hostname,
        # /etc/hosts then holds "<ip> ddp-train-i.ddp-train.<ns>.svc.cluster.local ddp-train-i", like a pod's.
        "--domainname",
        pod.dns_names[-1].split(".", 1)[1],
    ]
    for alias in pod.dns_names:
        argv += ["--network-alias", alias]
    argv += ["--user", f"{sc['runAsUser']}:{sc['runAsGroup']}"]
    if "fsGroup" in pod_sc:
        argv += ["--group-add", str(pod_sc["fsGroup"])]
    if sc.get("readOnlyRootFilesystem"):
        argv.append("--read-only")
    if "ALL" in sc.get("capabilities", {}).get("drop", []):
        argv += ["--cap-drop", "ALL"]
    if sc.get("allowPrivilegeEscalation") is False:
        argv += ["--security-opt", "no-new-privileges"]
    limits = c["resources"]["limits"]
    argv += ["--memory", str(int(quantity(limits["memory"]))), "--cpus", str(quantity(limits["cpu"]))]

    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in c["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            host = workdir / f"configmap-{volume['configMap']['name']}"
            host.mkdir(exist_ok=True)
            for key, text in objs[("ConfigMap", volume["configMap"]["name"])]["data"].items():
                (host / key).write_text(text)
            host.chmod(0o755)
            argv += ["-v", f"{host}:{mount['mountPath']}:ro"]
        elif "persistentVolumeClaim" in volume:
            host = workdir / f"pvc-{volume['persistentVolumeClaim']['claimName']}"  # one volume for all pods
            host.mkdir(exist_ok=True)
            if "fsGroup" in pod_sc and os.geteuid() == 0:  # the kubelet makes it group-owned, setgid, for fsGroup
                os.chown(host, 0, pod_sc["fsGroup"])
                host.chmod(0o2775)
            else:
                host.chmod(0o777)
            argv += ["-v", f"{host}:{mount['mountPath']}{':ro' if mount.get('readOnly') else ''}"]
        elif "emptyDir" in volume:
            size = volume["emptyDir"].get("sizeLimit")
            if mount["mountPath"] == "/dev/shm" and volume["emptyDir"].get("medium") == "Memory":
                argv += ["--shm-size", str(int(quantity(size or "64Mi")))]
            else:
                argv += [
                    "--tmpfs",
                    f"{mount['mountPath']}:rw,mode=1777" + (f",size={int(quantity(size))}" if size else ""),
                ]
        else:
            raise NotImplementedError(f"volume {mount['name']}: {sorted(volume)} is not emulated")
    for key, value in pod.env.items():
        argv += ["-e", f"{key}={value}"]
    command, args = c.get("command"), pod.argv[len(c.get("command", [])) :]
    if command:  # the manifest's command replaces the image's entrypoint, as in Kubernetes
        argv += ["--entrypoint", pod.argv[0], image(), *pod.argv[1 : len(command)], *args]
    else:
        argv += [image(), *args]
    return argv


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=3) as response:
        return response.read().decode()


def test_job_pod_template_trains_as_containers_named_like_the_pods(tmp_path):
    require_docker_and_image()
    job, objs = cpu_render()
    n = job["spec"]["completions"]
    pods = [render_pod(job, objs, i, NAMESPACE) for i in range(n)]
    config = yaml.safe_load(objs[("ConfigMap", "ddp-train-config")]["data"]["config.yaml"])
    metrics_port = int(job["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])

    run_id = uuid.uuid4().hex[:8]
    network, names = f"ddpk8s-{run_id}", {p.index: f"ddpk8s-{run_id}-{p.hostname}" for p in pods}
    started: list[str] = []
    docker("network", "create", network)
    try:
        for pod in sorted(pods, key=lambda p: -p.index):  # pod 0 last
            if pod.index == 0:
                time.sleep(POD0_DELAY_S)
            docker(*docker_run_args(pod, objs, tmp_path, names[pod.index], network))
            started.append(names[pod.index])

        # Wait for every pod to exit; while each lingers after training, scrape the port Prometheus is given.
        scraped: dict[int, str] = {}
        t0 = time.monotonic()
        seen_finished: dict[int, float] = {}
        deadline = t0 + DEADLINE_S
        while time.monotonic() < deadline:
            running = []
            for pod in pods:
                state = docker(
                    "inspect",
                    "-f",
                    '{{.State.Running}} {{(index .NetworkSettings.Networks "' + network + '").IPAddress}}',
                    names[pod.index],
                ).stdout.split()
                if state[0] == "true":
                    running.append(pod.index)
                    if pod.index not in scraped and "FINISHED" in docker("logs", names[pod.index]).stdout:
                        seen_finished.setdefault(pod.index, time.monotonic() - t0)
                        # not listening yet or already gone: try again on the next round
                        with contextlib.suppress(OSError):
                            scraped[pod.index] = scrape(f"http://{state[1]}:{metrics_port}/metrics")
            if not running:
                break
            time.sleep(0.5)
        logs = {p.index: docker("logs", names[p.index]) for p in pods}
        unresolved = sum(log.stderr.count("Name or service not known") for i, log in logs.items() if i)
        print(
            f"k8s emulation: {n} pods; FINISHED seen at {seen_finished} s after pod 0 started; all exited after "
            f"{time.monotonic() - t0:.1f} s (metrics linger included); pod 0's name was unresolvable "
            f"{unresolved} times for its peers before it started"
        )
        codes = {p.index: int(docker("inspect", "-f", "{{.State.ExitCode}}", names[p.index]).stdout) for p in pods}
        still_running = docker("ps", "-q", "--filter", f"network={network}").stdout.split()
        built = docker("image", "inspect", "-f", "{{.Created}}", image()).stdout.strip()
        report = f"image {image()} built {built} (older than app/? `make image`)\n" + "\n".join(
            f"--- pod {i} (exit {codes[i]}) ---\n{log.stdout[-3000:]}\n{log.stderr[-3000:]}" for i, log in logs.items()
        )
        assert not still_running, f"pods still running after {DEADLINE_S:.0f} s\n{report}"
        assert all(code == 0 for code in codes.values()), f"exit codes {codes}\n{report}"

        finished = {i: FINISHED.findall(log.stdout) for i, log in logs.items()}
        assert all(len(lines) == 1 for lines in finished.values()), f"one FINISHED line per pod\n{report}"
        lines = {i: lines[0] for i, lines in finished.items()}
        # One process per pod: rank = node rank = the pod's completion index.
        assert {i: int(line[0]) for i, line in lines.items()} == {i: i for i in range(n)}
        assert {int(line[1]) for line in lines.values()} == {n}
        assert {int(line[2]) for line in lines.values()} == {int(config["steps"])}
        assert len({line[3] for line in lines.values()}) == 1, f"ranks ended with different parameters: {lines}"

        assert sorted(scraped) == list(range(n)), (
            f"metrics port {metrics_port} never answered on pods {sorted(set(range(n)) - set(scraped))}"
        )
        for i, text in scraped.items():
            assert f'ddp_world_size{{rank="{i}"}} {float(n)}' in text
            steps = re.search(rf'^ddp_optimizer_steps_total{{rank="{i}"}} ([0-9.e+]+)$', text, re.M)
            assert steps and math.isclose(float(steps.group(1)), float(config["steps"])), text[:2000]

        mount = next(m for m in container(job)["volumeMounts"] if m["mountPath"] == pods[0].env["DDP_CHECKPOINT_DIR"])
        claim = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
        pvc = tmp_path / f"pvc-{claim['persistentVolumeClaim']['claimName']}"
        saved = sorted(p.name for p in pvc.glob("step-*.pt"))
        assert saved and saved[-1] == f"step-{int(config['steps']):08d}.pt", saved
        assert len(saved) <= int(config["keep_checkpoints"]), saved
    finally:
        if started:
            docker("rm", "-f", *started, check=False)
        docker("network", "rm", network, check=False)
